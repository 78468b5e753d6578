"""`python -m benchmarks.sm90`: the SM90 forward and backward against Triton's, in one process.

On an H200 (or any compute capability 9.0 GPU), for M3 shapes (Hq = 64, Hkv = 4, D = 128,
block 128, top-16, bf16) and random selections: the first-call compile times, then per problem
two lines, each with the agreement with the Triton kernels and both sides' milliseconds and
effective TF/s (the count of docs/performance.md and `torch_msa.flops`: `4 Hq D S` forward, 2.5 times
that backward, S the attended (query, key) pairs per KV head):

* forward: the SM90 time split into its plan build (the public API builds it once per step, not
  per call), blocks kernel and combine;
* backward (given the step's plan, as in a training step): the SM90 time and its blocks kernel
  (the rest is delta and the casts), then deterministic mode's: the SM90 deterministic variant
  (its share of the SM90 speed) and the Triton deterministic backward.

Problems the kernels decline are reported as declined.
"""

import argparse
import math
import sys
import time

import torch

from torch_msa.backends import UnsupportedInputs
from torch_msa.contract import M3
from torch_msa.documents import Documents, locate_queries
from torch_msa.flops import attention_backward, attention_forward
from torch_msa.ops import backend_arguments
from torch_msa.plan.schedule import bucket_key_count, entries_per_item, unpack
from torch_msa.testing import cu_seqlens, random_block_indices

from . import command
from .flops import selected_key_counts

HQ, HKV, D, BLOCK, TOPK = M3.query_heads, M3.kv_heads, M3.head_dim, M3.block_size, M3.topk
SCALE = D**-0.5


def _milliseconds(fn, iterations: int) -> float:
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iterations


def _problem(text: str) -> str:
    """An argparse `type`: a `--docs` item, checked (a document length, or COUNTxLENGTH)."""
    count, _, length = text.rpartition("x")
    if not (length.isdigit() and int(length) > 0 and (not count or (count.isdigit() and int(count) > 0))):
        raise argparse.ArgumentTypeError(f"expected a document length such as 8192 or COUNTxLENGTH such as 8x16384, "
                                         f"got {text!r}")
    return text


@command.exits_on_interrupt
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sm90", description=__doc__.splitlines()[0])
    parser.add_argument("--docs", nargs="+", type=_problem, default=["8192", "32768", "8x16384"],
                        help="problems: a document length, or COUNTxLENGTH for a pack")
    parser.add_argument("--iterations", type=command.at_least(1), default=10)
    args = parser.parse_args(argv)
    command.cuda_device(parser, None, "it times the SM90 kernels of H100/H200", capability=(9, 0))
    print(command.torch_msa_origin())

    from torch_msa.plan import kernels as plan_kernel
    from torch_msa.sm90 import backward_deterministic as sm90_deterministic
    from torch_msa.sm90 import backward_host, common, forward_host
    from torch_msa.stages.combine import combine
    from torch_msa.stages.delta import compute_delta
    from torch_msa.triton import backward as triton_backward
    from torch_msa.triton import backward_deterministic as triton_deterministic
    from torch_msa.triton import forward as triton_forward

    cu = torch.tensor([0, 256], dtype=torch.int32, device="cuda")
    tiny = torch.zeros(256, HQ, D, dtype=torch.bfloat16, device="cuda")
    tiny_kv = torch.zeros(256, HKV, D, dtype=torch.bfloat16, device="cuda")
    blocks = random_block_indices(cu, cu, HKV, TOPK, BLOCK).cuda()
    began = time.perf_counter()
    tiny_out, tiny_lse = forward_host.forward(tiny, tiny_kv, tiny_kv, blocks, Documents(cu, cu, 256, 256), BLOCK, SCALE)
    torch.cuda.synchronize()
    print(f"forward first call (compile + launch): {time.perf_counter() - began:.1f} s", flush=True)
    began = time.perf_counter()
    backward_host.backward(tiny, tiny, tiny_kv, tiny_kv, tiny_out, tiny_lse, blocks, Documents(cu, cu, 256, 256), BLOCK, SCALE)
    torch.cuda.synchronize()
    print(f"backward first call (compile + launch): {time.perf_counter() - began:.1f} s", flush=True)

    for problem in args.docs:
        count, _, length = problem.rpartition("x")
        lengths = [int(length)] * int(count or 1)
        num_tokens = sum(lengths)
        generator = torch.Generator().manual_seed(0)
        cu_q, cu_k = cu_seqlens(lengths, lengths, device="cuda")
        blocks = random_block_indices(cu_q, cu_k, HKV, TOPK, BLOCK, generator=generator).cuda()
        q = torch.randn(num_tokens, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(num_tokens, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(num_tokens, HKV, D, device="cuda", dtype=torch.bfloat16)
        position = locate_queries(cu_q, cu_k, num_tokens, num_tokens).position
        pairs = selected_key_counts(blocks, position, BLOCK).sum().item() / HKV
        flops = attention_forward(HQ, D, pairs)
        inputs = (q, k, v, blocks, cu_q, cu_k, max(lengths), max(lengths), BLOCK, SCALE)

        want_out, want_lse = triton_forward.forward(*backend_arguments("forward", *inputs))
        try:
            out, lse = forward_host.forward(*backend_arguments("forward", *inputs))
        except UnsupportedInputs as declined:
            print(f"{problem}: declined ({declined})", flush=True)
            continue
        out_error = ((out.float() - want_out.float()).norm() / want_out.float().norm()).item()
        lse_error = (lse - want_lse).abs().max().item()

        def plan():
            return plan_kernel.plan(blocks, Documents(cu_q, cu_k, max(lengths), max(lengths)), num_tokens, BLOCK,
                                    entries_per_item(HQ, HKV))

        schedule = unpack(plan(), blocks, num_tokens, len(lengths), BLOCK)
        key_count = bucket_key_count(schedule.bucket_key_row, cu_k, BLOCK)
        rows = num_tokens * HKV * TOPK * common.HEADS_PER_KV
        partial_out = torch.empty(rows, D, dtype=q.dtype, device="cuda")
        partial_lse = torch.full((rows,), -math.inf, device="cuda")
        times = {
            "triton": _milliseconds(lambda: triton_forward.forward(*backend_arguments("forward", *inputs)), args.iterations),
            "sm90": _milliseconds(lambda: forward_host.forward(*backend_arguments("forward", *inputs)), args.iterations),
            "plan": _milliseconds(plan, args.iterations),
            "blocks": _milliseconds(
                lambda: forward_host.launch_blocks(
                    q, k, v, partial_out, partial_lse, schedule, key_count, TOPK, SCALE
                ),
                args.iterations,
            ),
            "combine": _milliseconds(
                lambda: combine(partial_out, partial_lse, out, lse, HKV, TOPK), args.iterations
            ),
        }

        def rate(name):
            return f"{times[name]:.2f} ms ({flops / (times[name] * 1e-3) / 1e12:.0f} TF/s)"

        print(
            f"{problem} forward: triton {rate('triton')} | sm90 {rate('sm90')} = plan {times['plan']:.2f} ms"
            f" + blocks {rate('blocks')} + combine {times['combine']:.2f} ms"
            f" | vs triton: out rel. error {out_error:.1e}, lse max error {lse_error:.1e}",
            flush=True,
        )
        _time_backward(problem, inputs, out, lse, schedule, key_count, plan(), attention_backward(HQ, D, pairs),
                       args.iterations, triton_backward, triton_deterministic, backward_host, sm90_deterministic,
                       compute_delta)
    return 0


def _time_backward(problem, inputs, out, lse, schedule, key_count, plan, flops, iterations, triton_backward,
                   triton_deterministic, backward_host, sm90_deterministic, compute_delta) -> None:
    q, k, v, blocks, cu_q, cu_k, max_q, max_k, _, _ = inputs
    grad_out = torch.randn_like(q)
    args = (grad_out, q, k, v, out, lse, blocks, cu_q, cu_k, max_q, max_k, BLOCK, SCALE, None, plan)
    want = triton_backward.backward(*backend_arguments("backward", *args))
    try:
        got = backward_host.backward(*backend_arguments("backward", *args))
    except UnsupportedInputs as declined:
        print(f"{problem} backward: declined ({declined})", flush=True)
        return
    errors = "/".join(f"{((g.float() - w.float()).norm() / w.float().norm()).item():.1e}" for g, w in zip(got, want))
    num_tokens = q.shape[0]
    delta = torch.empty(num_tokens, HQ, device="cuda")
    compute_delta(grad_out, out, None, delta, (q.device, q.dtype, D, BLOCK, HQ // HKV, TOPK))
    dq_acc = torch.zeros(num_tokens, HQ, D, device="cuda")
    dk_acc, dv_acc = (torch.zeros(num_tokens, HKV, D, device="cuda") for _ in range(2))
    times = {
        "triton": _milliseconds(lambda: triton_backward.backward(*backend_arguments("backward", *args)), iterations),
        "sm90": _milliseconds(lambda: backward_host.backward(*backend_arguments("backward", *args)), iterations),
        "blocks": _milliseconds(
            lambda: backward_host.launch_blocks(
                q, k, v, grad_out, lse, delta, dq_acc, dk_acc, dv_acc, schedule, key_count, TOPK, SCALE
            ),
            iterations,
        ),
        "sm90 deterministic": _milliseconds(lambda: sm90_deterministic.backward(*backend_arguments("backward", *args)),
                                            iterations),
        "triton deterministic": _milliseconds(lambda: triton_deterministic.backward(*backend_arguments("backward", *args)),
                                              iterations),
    }

    def rate(name):
        return f"{times[name]:.2f} ms ({flops / (times[name] * 1e-3) / 1e12:.0f} TF/s)"

    print(
        f"{problem} backward: triton {rate('triton')} | sm90 {rate('sm90')}, blocks {rate('blocks')}"
        f" | deterministic: sm90 {rate('sm90 deterministic')}"
        f" = {times['sm90'] / times['sm90 deterministic']:.0%} of sm90, triton {rate('triton deterministic')}"
        f" | vs triton: dq/dk/dv rel. error {errors}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
