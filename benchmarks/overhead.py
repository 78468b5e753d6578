"""`python -m benchmarks.overhead [T ...]`: what one eager call costs the host and the GPU.

For one document of `T` tokens at M3 shapes and at 16 query heads over 1 KV head (`--heads`; bf16,
the index branch's selection of random index inputs), each of these calls:

- `select_blocks`; `build_plan`;
- `forward, plan given`: `sparse_attention` with a plan, no autograd;
- `forward + backward`: `sparse_attention` (its plan built inside) and the gradients of q, k, v;
- `msa_attention step`: selection, plan, forward and the gradients of q, k, v;
- `step + index loss`: the same with `index_loss=True`, and the gradients of the index inputs too;

and, over `--iters` packs whose length changes every call (`--varying T`: `T +- T / 4` tokens in one
to four documents, as packed training feeds them), the two steps again (`varying` rows);

is measured five ways (docs/performance.md, "Host overhead") over `--iters` calls after warm-ups:

- host ms: the median host time of one call while the GPU queue is kept busy (a spin kernel
  queued before it), so that nothing the call launches waits for the GPU: its Python, dispatch
  and launch work alone (a host sync inside the call would show up as the spin's length), as a
  loop that syncs before every step pays it;
- loop ms: the mean host time per call of up to `LOOP_CALLS` calls back to back behind one spin,
  as an eager loop that does not sync pays it (fewer calls where they would queue more than
  `QUEUED_LAUNCHES` launches, about half the device's launch queue; a spin that ends before the
  loop voids the number: `loop_error` in its place);
- GPU ms: the mean sum of the call's kernels (torch.profiler), and `launches`, their count;
- wall ms: the median of one call event-timed on an empty queue and synchronised, as a loop that
  syncs every step sees it;
- graph ms: the median of the call captured in a CUDA graph and replayed: its kernels without
  host work (not for the varying rows: a graph holds one length).

A call whose loop ms exceeds its GPU ms leaves the GPU idle in an eager loop that does not sync.
CUDA only.
"""

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

import torch_msa
from torch_msa.contract import M3, Shape

from . import command
from .cli import parse_heads
from .problems import ProblemSpec, make_inputs, parse_length, parse_seqlens
from .timing import capture_graph

WARMUPS = 3
SPIN_MS = 50.0  # GPU work queued before each host-timed call: longer than any call's host time
LOOP_CALLS = 20  # most calls of the loop ms
QUEUED_LAUNCHES = 512  # most launches the loop queues: the device's launch queue holds about a thousand


def calls(tokens: int, device: torch.device, shape: Shape = M3) -> dict[str, Callable[[], object]]:
    """The measured calls at `tokens` tokens, by name (each a function of no arguments)."""
    return calls_of(make_inputs(ProblemSpec((tokens,)), shape, device, "index", seed=0))


def calls_of(inputs) -> dict[str, Callable[[], object]]:
    """The measured calls on a problem's `inputs` (one document), by name."""
    docs, shape, tokens = inputs.document_args, inputs.shape, inputs.spec.tokens
    q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
    index_q, index_k = (x.detach().requires_grad_() for x in (inputs.index_q, inputs.index_k))
    block_indices, grad_out = inputs.block_indices, inputs.grad_out
    plan = torch_msa.build_plan(block_indices, *docs, num_keys=tokens, num_heads=shape.query_heads)

    def forward_with_plan():
        with torch.no_grad():
            return torch_msa.sparse_attention(inputs.q, inputs.k, inputs.v, block_indices, *docs, plan=plan)

    def forward_backward():
        out = torch_msa.sparse_attention(q, k, v, block_indices, *docs)
        return torch.autograd.grad(out, (q, k, v), grad_out)

    return {
        "select_blocks": lambda: torch_msa.select_blocks(inputs.index_q, inputs.index_k, *docs),
        "build_plan": lambda: torch_msa.build_plan(block_indices, *docs, num_keys=tokens, num_heads=shape.query_heads),
        "forward, plan given": forward_with_plan,
        "forward + backward": forward_backward,
        "msa_attention step": lambda: training_step(q, k, v, inputs.index_q, inputs.index_k, docs, grad_out, shape),
        "step + index loss": lambda: training_step(q, k, v, index_q, index_k, docs, grad_out, shape),
    }


def training_step(q, k, v, index_q, index_k, docs, grad_out, shape: Shape):
    """One `msa_attention` call (`shape`'s top-k and block size) and its backward: with the index
    loss when the index inputs require grad (the loss's gradient then reaches them), else the
    gradients of q, k, v."""
    sizes = {"topk": shape.topk, "block_size": shape.block_size}
    if not index_q.requires_grad:
        out = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, **sizes)
        return torch.autograd.grad(out, (q, k, v), grad_out)
    out, kl, _ = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, **sizes, index_loss=True)
    return torch.autograd.grad((out, kl), (q, k, v, index_q, index_k), (grad_out, torch.ones_like(kl)))


def varying_calls(center: int, device: torch.device, shape: Shape, steps: int) -> dict[str, Callable[[], object]]:
    """The two steps over `steps` packs of `center +- center // 4` tokens in one to four documents,
    each call taking the next pack (seeded): views of one set of inputs of the longest pack."""
    draw = random.Random(0)
    packs = []
    for _ in range(steps):
        total = draw.randint(center - center // 4, center + center // 4)
        cuts = sorted(draw.sample(range(1, total), draw.randint(0, min(3, total - 1))))
        packs.append([b - a for a, b in zip([0, *cuts], [*cuts, total])])
    inputs = make_inputs(ProblemSpec((max(sum(pack) for pack in packs),)), shape, device, "index", seed=0)
    bounds = [torch.tensor([0, *pack], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
              for pack in packs]
    turn = {"msa_attention step": 0, "step + index loss": 0}

    def step(name: str, index_grads: bool):
        def call():
            pack, cu = packs[turn[name] % steps], bounds[turn[name] % steps]
            turn[name] += 1
            tokens = sum(pack)
            q, k, v, index_q, index_k = (x[:tokens].detach().requires_grad_(grad) for x, grad in (
                (inputs.q, True), (inputs.k, True), (inputs.v, True), (inputs.index_q, index_grads),
                (inputs.index_k, index_grads)))
            return training_step(q, k, v, index_q, index_k, (cu, cu, max(pack), max(pack)), inputs.grad_out[:tokens],
                                 shape)

        return call

    return {"msa_attention step": step("msa_attention step", False), "step + index loss": step("step + index loss", True)}


def spin_cycles(device: torch.device, milliseconds: float) -> int:
    """GPU clock cycles of `torch.cuda._sleep` that take about `milliseconds` on `device`."""
    cycles = 10_000_000
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(device)
    return int(cycles * milliseconds / max(begin.elapsed_time(end), 1e-3))


def host_ms(fn, device: torch.device, iters: int, cycles: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        torch.cuda._sleep(cycles)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def loop_calls(iters: int, launches: float) -> int:
    """Calls of the loop ms: at most `iters` and `LOOP_CALLS`, and no more than it takes to queue
    `QUEUED_LAUNCHES` launches of `launches` each (at least one call)."""
    return max(1, min(iters, LOOP_CALLS, int(QUEUED_LAUNCHES // max(1.0, launches))))


def loop_host_ms(fn, device: torch.device, count: int, cycles: int) -> tuple[float, bool]:
    """`(host ms per call, spin outlasted)` of `count` calls back to back behind a spin of
    `cycles`; the number holds only when the spin was still running after the last call (no
    launch waited for the GPU)."""
    torch.cuda.synchronize(device)
    torch.cuda._sleep(cycles)
    spun = torch.cuda.Event()
    spun.record()
    start = time.perf_counter()
    for _ in range(count):
        fn()
    elapsed = (time.perf_counter() - start) * 1e3 / count
    outlasted = not spun.query()
    torch.cuda.synchronize(device)
    return elapsed, outlasted


def gpu_ms_and_launches(fn, device: torch.device, iters: int) -> tuple[float, float]:
    """Per call: the summed device time of the kernels (and copies and fills) it launches, and their count."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize(device)
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in kernels) / iters / 1e3, len(kernels) / iters


def wall_ms(fn, device: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn, device: torch.device, iters: int) -> float:
    graph = capture_graph(fn, device, WARMUPS)
    graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for begin, end in events:
        begin.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(begin.elapsed_time(end) for begin, end in events)


def measure(tokens: int, device: torch.device, iters: int, shape: Shape = M3, varying: bool = False) -> list[dict]:
    """One row per call: host, loop, GPU, wall and graph ms, and the launches; at `tokens` tokens,
    or with `varying` over `iters` packs around `tokens` (`varying_calls`, no graph)."""
    cycles = spin_cycles(device, SPIN_MS)
    rows = []
    found = varying_calls(tokens, device, shape, iters) if varying else calls(tokens, device, shape)
    for name, fn in found.items():
        for _ in range(WARMUPS):  # the first calls compile the kernels
            fn()
        gpu, launches = gpu_ms_and_launches(fn, device, iters)
        host = host_ms(fn, device, iters, cycles)
        count = loop_calls(iters, launches)
        # A spin meant to outlast the loop's host work twice over.
        loop, outlasted = loop_host_ms(fn, device, count, int(cycles * max(1.0, 2 * count * host / SPIN_MS)))
        row = {"call": name, "host_ms": host, "gpu_ms": gpu, "launches": launches, "wall_ms": wall_ms(fn, device, iters)}
        if outlasted:
            row["loop_ms"] = loop
        else:
            row["loop_error"] = "the spin ended before the loop did: a launch may have waited for the GPU"
        if varying:
            row["graph_error"] = "the length changes every call"
        else:
            try:
                row["graph_ms"] = graph_ms(fn, device, iters)
            except RuntimeError as error:  # a call that cannot be captured is reported, the others still run
                row["graph_error"] = str(error).splitlines()[0][:120]
        rows.append(row)
    return rows


@command.exits_on_interrupt
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("seqlens", nargs="*", default=["4K", "8K"], metavar="T",
                        help="document lengths (K = 1024; default 4K 8K)")
    parser.add_argument("--heads", nargs="+", metavar="HQ/HKV", default=[f"{M3.query_heads}/{M3.kv_heads}", "16/1"],
                        help=f"query and KV heads of each set of rows (default {M3.query_heads}/{M3.kv_heads} 16/1)")
    parser.add_argument("--varying", metavar="T", default="8K",
                        help="the packs of the varying rows take T +- T / 4 tokens (default 8K; 0: no such rows)")
    parser.add_argument("--iters", type=command.at_least(1), default=20,
                        help="measured calls per number, and packs of the varying rows (default 20)")
    args = parser.parse_args(argv)
    lengths = command.parsed(parser, parse_seqlens, args.seqlens, "argument T")
    shapes = [command.parsed(parser, parse_heads, text) for text in args.heads]
    varying = 0 if args.varying.strip() == "0" else command.parsed(parser, parse_length, args.varying, "argument --varying")
    if varying and varying < 8:
        parser.error(f"argument --varying: expected 0 or at least 8 tokens, got {args.varying!r}")
    device = command.cuda_device(parser, None, "it times GPU kernels and the host work that launches them")
    print(f"{'heads':>6} {'T':>10} {'call':<20} {'host ms':>8} {'loop ms':>8} {'GPU ms':>8} {'launches':>8} "
          f"{'wall ms':>8} {'graph ms':>9}")
    runs = [(shape, tokens, False) for shape in shapes for tokens in lengths]
    runs += [(shape, varying, True) for shape in shapes] if varying else []
    for shape, tokens, changing in runs:
        label = f"{tokens}+-{tokens // 4}" if changing else str(tokens)
        for row in measure(tokens, device, args.iters, shape, varying=changing):
            graph = f"{row['graph_ms']:9.3f}" if "graph_ms" in row else f"{'-':>9} ({row['graph_error']})"
            loop = f"{row['loop_ms']:8.3f}" if "loop_ms" in row else f"{'-':>8}"
            voided = f" (loop ms: {row['loop_error']})" if "loop_error" in row else ""
            print(f"{shape.query_heads:>3}/{shape.kv_heads:<2} {label:>10} {row['call']:<20} {row['host_ms']:8.3f} "
                  f"{loop} {row['gpu_ms']:8.3f} {row['launches']:8.0f} {row['wall_ms']:8.3f} {graph}{voided}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
