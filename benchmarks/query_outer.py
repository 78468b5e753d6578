"""`python -m benchmarks.query_outer [T ...]`: the forward with its query-outer part against the
KV-outer forward, call by call.

The query-outer part (`TORCH_MSA_QUERY_OUTER=1`) is the default only where its forward is no more
than `GATE` slower than the KV-outer one (`TORCH_MSA_QUERY_OUTER=0`; docs/performance.md, "The
default"); `--setting auto` times the default's rule itself against `0`. On the
GPU hosts measured so far, synchronised calls drift by more than that between two blocks of runs,
so timing each setting in a block of its own cannot tell. Here the two run in pairs: each of
`--rounds` rounds times one call of each, the order alternating from round to round, and the
verdict reads the ratios of the pairs.

For each document length `T` (`--pack` instead: one pack) and selection regime (`--selection`,
default all four; under `trained` a document longer than the trained ones becomes a pack of
trained-length documents, as in `python -m benchmarks`), M3 shapes (`--heads`), bf16,
`sparse_attention` with its plan built in the call: without autograd, where the forward builds
the plan it walks; with `--autograd` as a training step's forward runs it (q, k, v requiring
grad; the plan built for the backward too, which the query-outer part restricts to its KV-outer
part; no backward runs); or with `--step`, the whole training step: that forward and the backward
(`torch.autograd.grad` of a fixed output gradient), which the setting leaves as it is:

- synced: each call on an idle device, synchronised after it: what a loop that syncs pays,
  the host work the call cannot hide behind its kernels included;
- graph: the call replayed from a CUDA graph, event-timed: the device's share alone;
- for each: the median of either setting, the median of the rounds' ratios query-outer /
  KV-outer with its distribution-free 95% interval (`median_interval`), and the verdict
  (`verdict`): `within` when the interval lies at or below `1 + GATE`, `slower` when it lies
  above, `undecided` when it straddles it;
- `q-outer`: the share of (token, slot) pairs the plan's rule sends query-outer under the setting
  timed; `max diff`: the largest difference between the two settings' outputs (bf16 rounding: the
  partials merge in another order).

CUDA only, and the forward must resolve to a backend with a query-outer part (`triton`, `sm90`).
"""

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch

import torch_msa
from torch_msa.contract import M3, Shape

from . import command, trained_selection
from .cli import parse_heads
from .msa import with_query_outer_setting
from .problems import (
    QUERY_OUTER_BACKENDS,
    SELECTIONS,
    ProblemSpec,
    make_inputs,
    parse_pack,
    parse_seqlens,
    query_outer_bound,
)
from .problems import query_outer as query_outer_work
from .timing import graph_timer

GATE = 0.02
"""How much slower than the KV-outer forward the query-outer one may be and still be the default."""
CONFIDENCE = 0.95
WARMUPS = 3


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The distribution-free interval of the median of `values`: the `j`-th smallest and `j`-th
    largest, `j` the largest rank for which the interval covers the median with at least
    `confidence` (the binomial tail of `n` fair coins). Below 6 values no such `j` exists at 95%:
    the smallest and the largest."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("values: expected at least one value, got none")
    tail = 0.0  # P(fewer than j of the n values lie below the median)
    rank = 1
    for j in range(1, n // 2 + 1):
        tail += math.comb(n, j - 1) / 2**n
        if 1 - 2 * tail < confidence:
            break
        rank = j
    return ordered[rank - 1], ordered[n - rank]


def verdict(interval: tuple[float, float], gate: float = GATE) -> str:
    """`within`, `slower` or `undecided`: where the ratio's interval lies against `1 + gate`."""
    low, high = interval
    if high <= 1 + gate:
        return "within"
    if low > 1 + gate:
        return "slower"
    return "undecided"


@dataclasses.dataclass(frozen=True)
class Paired:
    """One way of timing both settings over the same rounds (milliseconds, round by round)."""

    kv_outer_ms: tuple[float, ...]
    query_outer_ms: tuple[float, ...]

    @property
    def ratios(self) -> tuple[float, ...]:
        """Query-outer / KV-outer, round by round."""
        return tuple(q / kv for kv, q in zip(self.kv_outer_ms, self.query_outer_ms, strict=True))

    @property
    def interval(self) -> tuple[float, float]:
        """The 95% interval of the ratios' median (`median_interval`)."""
        return median_interval(self.ratios)

    def summary(self) -> dict:
        return {"kv_outer_ms": statistics.median(self.kv_outer_ms),
                "query_outer_ms": statistics.median(self.query_outer_ms),
                "ratio": statistics.median(self.ratios), "interval": self.interval,
                "verdict": verdict(self.interval)}


def in_pairs(kv_outer: Callable[[], float], query_outer: Callable[[], float], rounds: int) -> Paired:
    """`rounds` rounds of one timed call of each (functions returning milliseconds), the KV-outer
    call first in even rounds and second in odd ones, so that a drift favours neither."""
    kv_outer_ms, query_outer_ms = [], []
    for round_index in range(rounds):
        if round_index % 2 == 0:
            kv_outer_ms.append(kv_outer())
            query_outer_ms.append(query_outer())
        else:
            query_outer_ms.append(query_outer())
            kv_outer_ms.append(kv_outer())
    return Paired(tuple(kv_outer_ms), tuple(query_outer_ms))


def synced_timer(fn: Callable[[], object], device: torch.device) -> Callable[[], float]:
    """Times one call of `fn` started on an idle device and synchronised after it."""

    def timed() -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3

    return timed


def problem_for(spec: ProblemSpec, selection: str) -> ProblemSpec:
    """`spec` as `selection` runs it: under `trained`, documents longer than the trained ones split
    into a pack of trained-length documents (as `python -m benchmarks` runs them)."""
    if selection != "trained":
        return spec
    split = trained_selection.split_beyond_trained(spec.lengths, min(trained_selection.load().lengths))
    return ProblemSpec(split, pack=spec.pack or split != spec.lengths)


MODES = ("forward", "autograd", "step")
"""What one timed call runs: the forward without autograd, the forward autograd records, or
that forward and its backward."""


def measure(spec: ProblemSpec, shape: Shape, selection: str, device: torch.device, rounds: int, seed: int,
            mode: str = "forward", setting: str = "1") -> dict:
    """One row: the problem's synced and graph pairs (`Paired.summary`), the share of pairs sent
    query-outer, and the largest difference between the two settings' outputs; `mode` one of
    `MODES`; `setting`: the value of `TORCH_MSA_QUERY_OUTER` timed against `0`."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    spec = problem_for(spec, selection)
    inputs = make_inputs(spec, shape, device, selection, seed)
    autograd = mode != "forward"
    # From a CPU generator: a capture that failed leaves the device's generator unusable.
    grad_out = (torch.randn(inputs.q.shape, generator=torch.Generator().manual_seed(seed)).to(inputs.q)
                if mode == "step" else None)

    def forward():
        # Leaves made in the call, on its stream, as a step's activations are: a leaf made once
        # would tie its gradient to the stream of its first backward, and a CUDA-graph capture on
        # another stream would fail.
        q, k, v = (x.detach().requires_grad_(autograd) for x in (inputs.q, inputs.k, inputs.v))
        with torch.set_grad_enabled(autograd):
            out = torch_msa.sparse_attention(q, k, v, inputs.block_indices, *inputs.document_args,
                                             block_size=shape.block_size)
        if grad_out is not None:
            torch.autograd.grad(out, (q, k, v), grad_out)
        return out

    kv_outer, query_outer = with_query_outer_setting(forward, "0"), with_query_outer_setting(forward, setting)
    for _ in range(WARMUPS):  # the first calls compile the kernels
        kv_out, query_out = kv_outer(), query_outer()
    difference = (query_out.detach().float() - kv_out.detach().float()).abs().max().item()
    least = with_query_outer_setting(lambda: query_outer_bound(device, shape), setting)()
    share = 0.0 if least is None else query_outer_work(inputs, least).entries
    row = {"problem": spec.name, "selection": selection, "query_outer_share": share,
           "max_difference": difference,
           # The setting changes outside the timed window: patching the environment costs the host
           # about 0.1 ms, which would pull both arms' times, and so their ratio, toward each other.
           "synced": in_pairs(with_query_outer_setting(synced_timer(forward, device), "0"),
                              with_query_outer_setting(synced_timer(forward, device), setting), rounds).summary()}
    try:
        row["graph"] = in_pairs(graph_timer(kv_outer, device, WARMUPS), graph_timer(query_outer, device, WARMUPS),
                                rounds).summary()
    except RuntimeError as error:  # a call that cannot be captured is reported; the synced pairs still stand
        row["graph_error"] = str(error).splitlines()[0][:120]
    return row


def format_pairs(summary: dict) -> str:
    """A `Paired.summary` as the table prints it: both medians (ms), the median change, its
    interval, the verdict."""
    low, high = summary["interval"]
    return (f"{summary['kv_outer_ms']:8.3f} {summary['query_outer_ms']:8.3f} {100 * (summary['ratio'] - 1):+6.1f}% "
            f"[{100 * (low - 1):+5.1f}, {100 * (high - 1):+5.1f}] {summary['verdict']:<9}")


@command.exits_on_interrupt
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.query_outer", description=__doc__.split("\n\n")[0])
    parser.add_argument("seqlens", nargs="*", default=[], metavar="T",
                        help="single-document lengths (K = 1024; default 8K 32K)")
    parser.add_argument("--pack", metavar="SPEC",
                        help="one varlen pack instead of single documents, e.g. 8x4K or 2x4K,8K")
    parser.add_argument("--selection", nargs="+", choices=SELECTIONS, default=list(SELECTIONS),
                        help="selection regimes (default all: " + " ".join(SELECTIONS) + ")")
    parser.add_argument("--heads", metavar="HQ/HKV", default=f"{M3.query_heads}/{M3.kv_heads}",
                        help=f"query and KV heads (default {M3.query_heads}/{M3.kv_heads})")
    parser.add_argument("--rounds", type=command.at_least(6), default=30,
                        help="pairs of timed calls per number (default 30; at least 6 for a 95%% interval)")
    timed = parser.add_mutually_exclusive_group()
    timed.add_argument("--autograd", action="store_true",
                       help="time the forward as a training step runs it: q, k, v require grad (no backward runs)")
    timed.add_argument("--step", action="store_true", help="time the training step: that forward and the backward")
    parser.add_argument("--setting", choices=("1", "auto"), default="1",
                        help="the TORCH_MSA_QUERY_OUTER value timed against 0: 1, the query-outer part in every "
                             "document (default), or auto, the default's rule")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    args = parser.parse_args(argv)
    if args.pack is not None and args.seqlens:
        parser.error(f"argument --pack: expected either document lengths or --pack, got both ({args.seqlens} and "
                     f"{args.pack!r})")
    if args.pack is not None:
        pack = command.parsed(parser, parse_pack, args.pack)
        if pack is None:
            parser.error(f"argument --pack: expected a pack such as 8x4K, got {args.pack!r}")
        specs = [ProblemSpec(pack, pack=True)]
    else:
        specs = [ProblemSpec((tokens,)) for tokens in command.parsed(parser, parse_seqlens, args.seqlens or ["8K", "32K"],
                                                                     "argument T")]
    shape = command.parsed(parser, parse_heads, args.heads)
    device = command.cuda_device(parser, None, "it times GPU kernels and the host work that launches them")
    backend = torch_msa.resolve("forward", device).name
    if backend not in QUERY_OUTER_BACKENDS:
        parser.error(f"needs a forward with a query-outer part (backend {' or '.join(QUERY_OUTER_BACKENDS)}); "
                     f"{torch.cuda.get_device_name(device)} resolves the forward to {backend!r}")
    mode = "step" if args.step else "autograd" if args.autograd else "forward"
    timed_call = {"forward": "forward, no autograd", "autograd": "forward, autograd recording",
                  "step": "forward and backward"}[mode]
    print(f"{torch.cuda.get_device_name(device)}, forward backend {backend}; Hq={shape.query_heads} "
          f"Hkv={shape.kv_heads}, bf16, plan built in the call, {timed_call}, setting {args.setting} against 0, "
          f"{args.rounds} rounds; ms KV-outer, query-outer, "
          f"median change [95% interval], verdict against +{GATE:.0%}")
    print(command.torch_msa_origin())
    print(f"{'problem':<18} {'selection':<9} {'q-outer':>7} {'max diff':>8} | {'synced':<48} | {'graph':<48}")
    for spec in specs:
        for selection in args.selection:
            row = measure(spec, shape, selection, device, args.rounds, args.seed, mode, args.setting)
            graph = format_pairs(row["graph"]) if "graph" in row else f"- ({row['graph_error']})"
            print(f"{row['problem']:<18} {selection:<9} {row['query_outer_share']:7.1%} {row['max_difference']:8.1e} | "
                  f"{format_pairs(row['synced'])} | {graph}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
