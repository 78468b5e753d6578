"""`python -m benchmarks.long_context`: one MiniMax-M3 training step on one long document.

For each length the step of the main benchmark (`select_blocks -> sparse_attention -> autograd
backward`, on random bf16 index inputs, M3 shapes) is timed (median of `--iters` synchronised
calls after one warm-up) and its peak device memory above the inputs (q, k, v, the index inputs
and the output gradient) is reported, in GiB and in KiB per token. cuDNN's dense causal
fwd+bwd on the same q, k, v is timed up to `--dense-up-to` tokens and, past that, extrapolated
from the longest timed length by the quadratic growth of its work. Results go to stdout and to
`long_context.json` under `--out`, written after every length; its `status` (`running`,
`interrupted`, `complete`) says whether it is partial.
"""

import argparse
import os
import sys

import torch

from torch_msa._progress import Progress
from torch_msa.contract import M3

from . import command
from .msa import msa_subject
from .peers import dense_subject
from .problems import ProblemSpec, make_inputs, parse_length, parse_seqlens
from .results import RUNNING, STEP, run_recorded, write_record
from .timing import free_memory, is_out_of_memory, measure


def _measurement(subject, phase):
    for measurement in subject.measurements():
        if measurement.phase == phase:
            return measurement
    raise LookupError(f"{subject.impl} has no phase {phase!r}")


def _peak_above(device, fn) -> int:
    """Bytes `fn()` allocates at its peak above what was allocated before it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def measure_length(tokens: int, device, iters: int, dense: bool) -> dict:
    """The step's time, TF/s and peak memory at `tokens`, and cuDNN's dense fwd+bwd when `dense`."""
    inputs = make_inputs(ProblemSpec((tokens,)), M3, device, "index", seed=0)
    step = _measurement(msa_subject(inputs, max_reference_tokens=0), STEP)
    if step.fn is None:
        raise RuntimeError(f"the step does not run here: {step.note}")
    peak = _peak_above(device, step.fn)
    ms = measure(step.fn, device, warmup=0, iters=iters).median_ms
    row = {"tokens": tokens, "step_ms": ms, "step_tflops": step.flops / ms / 1e9,
           "peak_above_inputs_gib": peak / 2**30, "peak_above_inputs_kib_per_token": peak / 2**10 / tokens}
    if dense:
        subject = dense_subject(inputs, "cudnn")
        measurements = subject.measurements()
        forward = next(measurements)
        row["dense_fwd_ms"] = measure(forward.fn, device, warmup=1, iters=iters).median_ms
        backward = next(measurements)
        row["dense_bwd_ms"] = measure(backward.fn, device, warmup=1, iters=iters).median_ms
        row["dense_step_ms"] = row["dense_fwd_ms"] + row["dense_bwd_ms"]
        del forward, backward, measurements
    del inputs, step
    free_memory(device)
    return row


@command.exits_on_interrupt
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_context", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", nargs="+", default=["128K", "256K", "512K", "1M"], metavar="T",
                        help="document lengths (K = 1024, M = 1024K; default 128K 256K 512K 1M)")
    parser.add_argument("--dense-up-to", default="256K", metavar="T",
                        help="time cuDNN dense fwd+bwd up to this length, extrapolate past it (default 256K; 0: never)")
    parser.add_argument("--iters", type=command.at_least(1), default=3, help="timed steps per length (default 3)")
    parser.add_argument("--device", help="a CUDA device (default: cuda)")
    parser.add_argument("--out", default="bench_out", help="directory of long_context.json (default: bench_out)")
    args = parser.parse_args(argv)
    lengths = command.parsed(parser, parse_seqlens, args.seqlens)
    dense_limit = command.parsed(parser, parse_length, args.dense_up_to, "--dense-up-to") \
        if args.dense_up_to.strip() != "0" else 0
    command.output_directory(parser, args.out)
    device = command.cuda_device(parser, args.device, "its lengths take tens of GiB")
    path = os.path.join(args.out, "long_context.json")
    rows: list[dict] = []
    record = {"status": RUNNING, "partial": True, "device": torch.cuda.get_device_name(device), "rows": rows}
    print(f"{'T':>8} {'step ms':>10} {'TF/s':>6} {'peak GiB':>9} {'KiB/token':>9} {'cuDNN dense ms':>15} {'speedup':>8}")

    def run():
        # Each length takes several times the one before: no rate estimate of the time left.
        with Progress("long context", len(lengths), rate_estimate=False) as progress:
            for tokens in lengths:
                progress.start(f"T={tokens}")
                row = _measure_or_out_of_memory(tokens, device, args.iters, tokens <= dense_limit, rows)
                rows.append(row)
                progress.write(_table_line(row), file=sys.stdout)
                write_record(path, record)  # after every length, so a run that is killed keeps what it measured
                progress.advance()

    code = run_recorded(path, record, run)
    if code == 0:
        print(f"wrote {path}", file=sys.stderr)
    return code


def _measure_or_out_of_memory(tokens: int, device, iters: int, dense: bool, earlier: list[dict]) -> dict:
    """`measure_length`'s row, with cuDNN's time extrapolated from the longest timed earlier row
    when it was not timed; a row saying so when the device ran out of memory."""
    try:
        row = measure_length(tokens, device, iters, dense)
    except Exception as error:  # one length's failure is recorded; the next length still runs
        if not is_out_of_memory(error):
            raise
        free_memory(device)
        return {"tokens": tokens, "error": f"out of memory: {str(error).splitlines()[0][:200]}"}
    timed = [r for r in earlier if "dense_step_ms" in r and not r.get("dense_extrapolated")]
    if "dense_step_ms" not in row and timed:
        row["dense_step_ms"] = timed[-1]["dense_step_ms"] * (tokens / timed[-1]["tokens"]) ** 2
        row["dense_extrapolated"] = True
    return row


def _table_line(row: dict) -> str:
    if "error" in row:
        return f"{row['tokens']:>8} {row['error']}"
    dense = row.get("dense_step_ms")
    dense_text = "-" if dense is None else f"{dense:.0f}{' (extrap.)' if row.get('dense_extrapolated') else ''}"
    speedup = "-" if dense is None else f"{dense / row['step_ms']:.1f}x"
    return (f"{row['tokens']:>8} {row['step_ms']:>10.1f} {row['step_tflops']:>6.0f} {row['peak_above_inputs_gib']:>9.2f} "
            f"{row['peak_above_inputs_kib_per_token']:>9.1f} {dense_text:>15} {speedup:>8}")



if __name__ == "__main__":
    sys.exit(main())
