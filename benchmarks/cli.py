"""`python -m benchmarks`: the command line of the benchmark."""

import argparse
import dataclasses
import datetime
import importlib.metadata
import os
import platform
import sys

import torch

import torch_msa
from torch_msa.contract import M3, Shape

from . import command, msa, peers, report, targets, trained_selection
from .devices import device_peak
from .problems import SELECTIONS, ProblemSpec, parse_pack, parse_seqlens
from .results import COMPLETE, INTERRUPTED, RUNNING, BenchResult, ProblemResult
from .runner import Config, run_problem

FULL_SEQLENS = (8192, 32768, 65536, 131072)
FULL_PACK = (16384,) * 8
QUICK_SEQLENS = (8192, 65536)
CPU_SEQLENS = (512,)
CPU_QUICK_SEQLENS = (128,)
DEFAULT_WARMUP, DEFAULT_ITERS = 5, 20
QUICK_WARMUP, QUICK_ITERS = 3, 10
CPU_QUICK_WARMUP, CPU_QUICK_ITERS = 0, 3  # the median of 3 interleaved rounds (the first pays the first calls)
MIN_RUNS = 10  # a measurement cut by --row-budget keeps at least this many timed runs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Times torch_msa against dense SDPA (cuDNN, flash), fla parallel_nsa and FlexAttention "
                    "with the exact MSA mask, in one process, on the same inputs and block indices "
                    "(M3 shapes by default: Hq=64, Hkv=4, D=128, block 128, top-16, bf16, index heads 4 x 128). "
                    "Prints a table (ms, effective TF/s, % of the device's dense bf16 rate, speedup vs the "
                    "dense baseline) and the performance goals of docs/performance.md, and writes bench.json, "
                    "bench.txt and bench.png.",
    )
    parser.add_argument("--seqlens", nargs="+", metavar="T",
                        help="single-document lengths, e.g. 8K 32K or 8192,32768 (K = 1024). Default on "
                             "CUDA: 8K 32K 64K 128K plus the pack 8x16K; on CPU: 512. Given alone, no pack runs")
    parser.add_argument("--pack", metavar="SPEC",
                        help="a varlen pack of documents: comma-separated NxL or L items, e.g. 8x16K or "
                             "2x4K,8K; 'none' for no pack. Given alone, no single document runs")
    parser.add_argument("--quick", action="store_true",
                        help=f"on CUDA: 8K and 64K only, no pack, {QUICK_WARMUP} warm-ups and {QUICK_ITERS} runs; "
                             f"on CPU: a smoke test of {CPU_QUICK_SEQLENS[0]} tokens, the median of {CPU_QUICK_ITERS} "
                             "interleaved runs of each phase, no peers but the dense baseline (explicit options "
                             "still win)")
    parser.add_argument("--heads", metavar="HQ/HKV", default=f"{M3.query_heads}/{M3.kv_heads}",
                        help="query and KV heads, e.g. 16/1 for one of 4 tensor-parallel shards of M3; the index "
                             f"heads follow the KV heads (default {M3.query_heads}/{M3.kv_heads})")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--out", default="bench_out", help="directory of bench.json, bench.txt, bench.png "
                                                          "(default: bench_out)")
    parser.add_argument("--skip-peers", action="store_true",
                        help="run only torch_msa and the dense baseline (cuDNN on CUDA, math on CPU)")
    parser.add_argument("--query-outer", action="store_true",
                        help="also time torch_msa's fwd and select+fwd+bwd with the forward's query-outer part "
                             "(TORCH_MSA_QUERY_OUTER=1), as 'torch_msa q-outer'")
    parser.add_argument("--warmup", type=command.at_least(0),
                        help=f"untimed calls before timing (default {DEFAULT_WARMUP})")
    parser.add_argument("--iters", type=command.at_least(1),
                        help=f"timed calls; the median is reported (default {DEFAULT_ITERS}). On CPU the phases "
                             "are timed interleaved: this many rounds, each timing every phase once")
    parser.add_argument("--selection", choices=SELECTIONS, default="index",
                        help="index: torch_msa.select_blocks on random index inputs; skewed: every token "
                             "picks block 0 and its newest blocks (load imbalance); tiled: the index selection "
                             "shared by each 128-query tile (its last query's), the case cuDNN's block-sparse "
                             "attention can express, which then runs as a peer; trained: the selections of a "
                             "trained index branch on held-out text (benchmarks/trained_selection.py; a document "
                             "longer than the trained ones becomes a pack of trained-length documents). "
                             "Default: index")
    parser.add_argument("--row-budget", type=command.at_least(0.0, float), default=20.0, metavar="SECONDS",
                        help="cap of the timed part of one measurement: slower ones get fewer runs (at "
                             f"least {MIN_RUNS}, marked *); 0 disables (default 20)")
    parser.add_argument("--max-reference-tokens", type=command.at_least(0), default=8192, metavar="T",
                        help="on CUDA, skip torch_msa phases served by the slow reference backend above "
                             "this many tokens (default 8192)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    args.device = command.device(parser, args.device)
    try:
        args.shape = parse_heads(args.heads)
        seqlens = parse_seqlens(args.seqlens) if args.seqlens is not None else None
        pack = parse_pack(args.pack) if args.pack is not None else None
    except ValueError as error:
        parser.error(str(error))
    on_cpu = args.device.type != "cuda"
    if args.seqlens is None and args.pack is None:
        if args.quick:
            seqlens, pack = list(CPU_QUICK_SEQLENS if on_cpu else QUICK_SEQLENS), None
        elif args.device.type == "cuda":
            seqlens, pack = list(FULL_SEQLENS), FULL_PACK
        else:
            seqlens, pack = list(CPU_SEQLENS), None
    problems = [ProblemSpec((length,)) for length in seqlens or []]
    if pack is not None:
        problems.append(ProblemSpec(pack, pack=True))
    if args.selection == "trained":
        try:
            trained_length = min(trained_selection.load().lengths)
        except ValueError as error:
            parser.error(str(error))
        problems = [ProblemSpec(split, pack=p.pack or split != p.lengths)
                    for p in problems for split in [trained_selection.split_beyond_trained(p.lengths, trained_length)]]
    if not problems:
        parser.error("argument --seqlens/--pack: nothing to run")
    args.problems = tuple(problems)
    if args.quick and on_cpu:
        args.skip_peers = True
    if args.warmup is None:
        args.warmup = (CPU_QUICK_WARMUP if on_cpu else QUICK_WARMUP) if args.quick else DEFAULT_WARMUP
    if args.iters is None:
        args.iters = (CPU_QUICK_ITERS if on_cpu else QUICK_ITERS) if args.quick else DEFAULT_ITERS
    return args


def parse_heads(text: str) -> Shape:
    """`"16/1"` -> M3's shape with 16 query heads and 1 KV head (and index head)."""
    query, _, kv = text.partition("/")
    if not (query.strip().isdigit() and kv.strip().isdigit()):
        raise ValueError(f"--heads: expected query heads / KV heads such as 64/4 or 16/1, got {text!r}")
    query_heads, kv_heads = int(query), int(kv)
    if kv_heads < 1 or query_heads < kv_heads or query_heads % kv_heads:
        raise ValueError(f"--heads: expected KV heads >= 1 dividing the query heads, got {query_heads}/{kv_heads}")
    return dataclasses.replace(M3, query_heads=query_heads, kv_heads=kv_heads)


def describe_shape(shape: Shape) -> str:
    return (f"Hq={shape.query_heads} Hkv={shape.kv_heads} D={shape.head_dim}, block {shape.block_size}, "
            f"top-{shape.topk}, bf16, index heads {shape.kv_heads} x {shape.index_dim}")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _served(device: torch.device) -> dict[str, str]:
    try:
        return msa.resolved_backends(device)
    except torch_msa.BackendError as error:
        return {"error": str(error)}


def _meta(args, argv) -> dict:
    device = args.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    peak = device_peak(device)
    shape = args.shape
    return {
        "command": "python -m benchmarks " + " ".join(argv),
        "torch_msa": torch_msa.__version__,
        "git_commit": command.git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "device_type": device.type,
        "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "fla_core": peers.fla_version(),
        "torch_msa_backends": _served(device),
        "shape": {"query_heads": shape.query_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                  "index_heads": shape.kv_heads, "index_dim": shape.index_dim, "block_size": shape.block_size,
                  "topk": shape.topk, "dtype": "bfloat16"},
        "shape_text": describe_shape(shape),
        "selection": args.selection,
        "timing": {"warmup": args.warmup, "iters": args.iters, "statistic": "median",
                   "interleaved": device.type != "cuda",
                   "clock": "CUDA events" if device.type == "cuda" else "time.perf_counter",
                   "row_budget_s": args.row_budget or None, "inputs_rotated": False},
        "peak_tflops": None if peak is None else peak.tflops,
        "peak_source": None if peak is None else peak.source,
    }


def _header(meta: dict, args) -> str:
    timing = meta["timing"]
    served = "  ".join(f"{op}={name}" for op, name in meta["torch_msa_backends"].items())
    warning = []
    if args.device.type == "cuda" and "reference" in meta["torch_msa_backends"].values():
        warning = [f"  warning    the reference backend serves some msa ops on CUDA (no fast kernel registered): "
                   f"those phases run only up to --max-reference-tokens {args.max_reference_tokens}"]
    return "\n".join([
        "torch_msa benchmark",
        f"  device     {meta['device']}   torch {meta['torch']}   triton {meta['triton']}   "
        f"fla-core {meta['fla_core'] or 'not installed'}",
        f"  torch_msa  {meta['torch_msa']} ({meta['git_commit'] or 'not a git checkout'})   {served}",
        f"  shapes     {meta['shape_text']}",
        f"  selection  {meta['selection']}",
        f"  timing     {timing['clock']}, {timing['warmup']} warm-ups, median of {timing['iters']} runs"
        f"{', interleaved (one run of every phase per round)' if timing['interleaved'] else ''} "
        f"(budget {timing['row_budget_s'] or 'none'} s per measurement); inputs not rotated (a problem whose "
        "q, k, v fit twice in the L2 says so)",
        *warning,
    ])


def _write_text_outputs(result: BenchResult, header: str, out: str) -> str:
    """Write bench.json and bench.txt for what has run so far; returns the table and target lines."""
    not_judged = targets.why_not_judged(result.meta)
    outcomes = [] if not_judged else targets.evaluate(result)
    text = report.format_table(result) + "\n\n" + targets.format_outcomes(outcomes, not_judged)
    report.write_json(result, outcomes, os.path.join(out, "bench.json"), not_judged)
    status = "" if result.status == COMPLETE else f"\nstatus: {result.status} (partial results)"
    with open(os.path.join(out, "bench.txt"), "w") as handle:
        handle.write(header + "\n" + text + status + "\n")
    return text


@command.exits_on_interrupt
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command.output_directory(_parser(), args.out)
    meta = _meta(args, argv)
    config = Config(device=args.device, problems=args.problems, shape=args.shape, selection=args.selection,
                    warmup=args.warmup, iters=args.iters, budget_s=args.row_budget or None, min_runs=MIN_RUNS,
                    skip_peers=args.skip_peers, query_outer=args.query_outer,
                    max_reference_tokens=args.max_reference_tokens, seed=args.seed)
    header = _header(meta, args)
    print(header, flush=True)
    result = BenchResult(meta, [], status=RUNNING)
    json_path = os.path.join(args.out, "bench.json")
    text_path = os.path.join(args.out, "bench.txt")
    try:
        for index, spec in enumerate(config.problems, 1):
            problem = ProblemResult(spec, None, config.baseline)
            result.problems.append(problem)
            run_problem(spec, config, problem, label=f"[{index}/{len(config.problems)}] {spec.name}")
            # Rewritten after every problem, so a run that is killed still leaves its finished problems.
            _write_text_outputs(result, header, args.out)
    except KeyboardInterrupt:
        if result.problems:
            result.problems[-1].add_sums()
            result.problems[-1].notes.append("interrupted (KeyboardInterrupt): the phases after its last row did not run")
        result.status = INTERRUPTED
        _write_text_outputs(result, header, args.out)
        return command.interrupted(f"the partial results are in {json_path} and {text_path}")
    result.status = COMPLETE
    text = _write_text_outputs(result, header, args.out)
    print(text)
    print()
    print(f"wrote {json_path} and {text_path}", flush=True)
    png = os.path.join(args.out, "bench.png")
    try:
        why_not = report.write_plot(result, png, targets.rate_goals(result))
    except KeyboardInterrupt:
        return command.interrupted(f"while drawing {png}, not written; the results are complete in {json_path} "
                                   f"and {text_path}")
    print(f"plot: {why_not}" if why_not else f"wrote {png}")
    return 0
