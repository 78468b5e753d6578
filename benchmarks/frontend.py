"""`python -m benchmarks.frontend`: what torch_msa's layers above the backends cost the host per call.

Every op is served by a stub backend that hands back results made beforehand, so no kernel runs
and what is timed is the host work around the kernels that no backend can remove: the public API,
the custom ops' dispatch and autograd Functions, the metadata checks and the backend registry.
It runs on the CPU (the default) as on a GPU. The calls are `benchmarks.overhead`'s: the selection,
the plan, a forward given a plan, a forward and backward, and the `msa_attention` step (the
gradients of q, k, v) with and without the index loss; each the median of `--iters` calls after
warm-ups, in microseconds.
"""

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch

from torch_msa import backends
from torch_msa.contract import M3, Shape
from torch_msa.plan.schedule import entries_per_item, plan_numel

from . import command
from .cli import parse_heads
from .overhead import calls_of
from .problems import ProblemSpec, make_inputs

STUB = "frontend-stub"
WARMUPS = 20


@contextlib.contextmanager
def stub_backend(inputs, served: list[str]) -> Iterator[None]:
    """Serve every op on `inputs`' device with results made beforehand, recording each op served
    in `served`, inside the block only."""
    q, k, v, index_q, index_k = inputs.q, inputs.k, inputs.v, inputs.index_q, inputs.index_k
    shape, tokens = inputs.shape, inputs.spec.tokens
    numel = plan_numel(inputs.block_indices.shape, tokens, len(inputs.spec.lengths), shape.block_size,
                       entries_per_item(shape.query_heads, shape.kv_heads))
    plan = torch.zeros(numel, dtype=torch.int32, device=q.device)
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    grads = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    index_grads = (torch.zeros_like(index_q), torch.zeros_like(index_k), torch.zeros((), device=q.device))

    def serving(op: str, result) -> Callable:
        def serve(*args):
            served.append(op)
            return result

        return serve

    ops = {"select_blocks": serving("select_blocks", inputs.block_indices), "plan": serving("plan", plan),
           "forward": serving("forward", (out, lse)), "backward": serving("backward", grads),
           "backward_with_index_loss": serving("backward_with_index_loss", (*grads, *index_grads))}
    backends.register_backend(backends.Backend(name=STUB, ops=ops, priority=10_000, device_types=(q.device.type,)))
    try:
        yield
    finally:
        backends.unregister_backend(STUB)


def measure(tokens: int, shape: Shape, device: torch.device, iters: int) -> dict[str, float]:
    """Median host microseconds of each call at `tokens` tokens, every op served by the stub."""
    inputs = make_inputs(ProblemSpec((tokens,)), shape, device, "skewed", seed=0)
    served: list[str] = []
    medians = {}
    with stub_backend(inputs, served):
        for name, fn in calls_of(inputs).items():
            for _ in range(WARMUPS):
                fn()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
            medians[name] = statistics.median(times)
    missing = {"select_blocks", "plan", "forward", "backward", "backward_with_index_loss"} - set(served)
    if missing:
        raise RuntimeError(f"the stub backend did not serve msa::{', msa::'.join(sorted(missing))}")
    return medians


@command.exits_on_interrupt
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frontend", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=command.at_least(1), default=64,
                        help="tokens of the one document (default 64: the host work does not grow with it)")
    parser.add_argument("--heads", metavar="HQ/HKV", default=f"{M3.query_heads}/{M3.kv_heads}",
                        help=f"query and KV heads (default {M3.query_heads}/{M3.kv_heads})")
    parser.add_argument("--device", default="cpu", help="cpu (the default), cuda or cuda:N")
    parser.add_argument("--iters", type=command.at_least(1), default=300, help="timed calls per number (default 300)")
    args = parser.parse_args(argv)
    shape = command.parsed(parser, parse_heads, args.heads)
    device = command.device(parser, args.device)
    print(f"{'call':<20} {'host us':>8}   ({args.tokens} tokens, Hq={shape.query_heads} Hkv={shape.kv_heads}, "
          f"{device}, every op a stub)")
    for name, micros in measure(args.tokens, shape, device, args.iters).items():
        print(f"{name:<20} {micros:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
