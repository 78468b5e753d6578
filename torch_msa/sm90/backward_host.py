"""`msa::backward` on Hopper (sm_90a): the host side of the CuTe DSL backward kernel.

Scope: the SM90 forward's: G = 16 query heads per KV head, D = 128, key blocks of 128, bf16 or
fp16 (MiniMax-M3); any top-k. `check_inputs` raises `UnsupportedInputs` for anything else before
any work.

* **`backward`**: `delta = rowsum(dO * O) - grad_lse` (Triton, `torch_msa.triton.stages.compute_delta`),
  the step's plan (or a new one), zeroed fp32 accumulators for dQ, dK and dV, one launch of the
  kernel on a persistent grid of one CTA per SM (capped by the item count), which adds into them
  with atomics, then the casts to the inputs' dtype (dQ's by the Triton stage `ungroup_dq`, which
  also undoes the kernel's dim grouping, `common.DQ_DIM_GROUP`).
* The bitwise-reproducible backward (for `torch.use_deterministic_algorithms(True)`) is
  `backward_deterministic.py`: the kernel's deterministic variant (`launch_blocks(...,
  deterministic=True)`) stores each item's dK/dV in the item's own workspace rows, and the Triton
  stages (`torch_msa.triton.stages`) reduce the workspace in a fixed order per key block and
  compute dQ query-outer, each element with one owner.

The kernel itself and its design: `backward_kernel.py`; the constants and checks it shares with
the forward: `common.py`. Importing this module imports neither cutlass nor triton:
`compile_blocks_kernel` imports the kernel module (and so cutlass) on the first compile, after
`require_cute_dsl()`; one executable serves a process, dtype, KV head count and variant.
"""

import functools

import torch

from ..backends import UnsupportedInputs
from ..cute_dsl import require_cute_dsl, sm_count
from ..cute_dsl.cute_io import aligned_operand, launcher
from ..stages.delta import compute_delta
from ..stages.dq import ungroup_dq
from .common import (
    BLOCK_SIZE,
    DQ_DIM_GROUP,
    HEAD_DIM,
    HEADS_PER_KV,
    blocks_operands,
    check_served,
    compile_blocks,
    launch,
    step_schedule,
)

# Q, dO and the lse/delta rows are addressed with 32-bit row indices (query x head).
MAX_QUERY_ROWS = 2**31 - 1
# The KL teacher's storage: probabilities lie in [0, 1], where fp16 keeps 3 more bits than bf16.
TEACHER_DTYPE = torch.float16


def new_teacher(num_queries: int, num_kv_heads: int, topk: int, device) -> torch.Tensor:
    """The zeros `[Tq, Hkv, topk, 128]` (fp16) the kernel writes the KL teacher into."""
    return torch.zeros((num_queries, num_kv_heads, topk, BLOCK_SIZE), dtype=TEACHER_DTYPE, device=device)


def check_query_rows(num_queries: int, num_heads: int) -> None:
    """Raise `UnsupportedInputs` when the `Tq * Hq` query rows would not fit 32-bit indices."""
    if num_queries * num_heads > MAX_QUERY_ROWS:
        raise UnsupportedInputs(
            f"the SM90 backward indexes query rows with 32-bit integers: {num_queries} queries x {num_heads} heads "
            f"are more than {MAX_QUERY_ROWS} rows"
        )


def check_inputs(grad_out, q, k, v, block_size) -> None:
    """Raise `UnsupportedInputs` for inputs the kernel does not serve; nothing launched."""
    check_served(q, k, v, block_size)
    if grad_out.dtype != q.dtype:
        raise UnsupportedInputs(f"the SM90 backward takes grad_out of q's dtype {q.dtype}, got {grad_out.dtype}")
    check_query_rows(q.shape[0], q.shape[1])


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None, teacher=None):
    """Same contract as `torch_msa.reference.backward`: `(dq, dk, dv)` in the inputs' dtype.

    `teacher`: None, or fp16 `[Tq, Hkv, topk, 128]` zeros that the kernel fills with the index
    branch's KL teacher (`new_teacher`; layout: `torch_msa.reference_kl.teacher_probabilities`).

    Shapes: `grad_out`, `q`, `out` `[Tq, Hq, D]`; `k`, `v` `[Tk, Hkv, D]`; `lse`, `grad_lse`
    `[Tq, Hq]` fp32; `block_indices` int32 `[Hkv, Tq, topk]`. Walks `plan`'s items (any item
    size) or those of a new plan with the public API's item size; query fragments are read from
    the plan, as in the forward.

    Raises:
        UnsupportedInputs: outside the served configuration (`check_inputs`).
    """
    check_inputs(grad_out, q, k, v, block_size)
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    require_cute_dsl()

    topk = block_indices.shape[-1]
    device = q.device
    # One zero fill for the three accumulators (each view starts 16-byte aligned: D = 128 fp32).
    query_elements, key_elements = num_queries * num_heads * dim, num_keys * num_kv_heads * dim
    accumulators = torch.zeros(query_elements + 2 * key_elements, dtype=torch.float32, device=device)
    dq_acc, dk_acc, dv_acc = (
        part.view(shape) for part, shape in zip(
            accumulators.split((query_elements, key_elements, key_elements)),
            ((num_queries, num_heads, dim), (num_keys, num_kv_heads, dim), (num_keys, num_kv_heads, dim)),
        )
    )
    if num_queries > 0 and num_keys > 0 and topk > 0:
        # TMA reads whole 16-byte aligned rows.
        q, k, v, grad_out = (aligned_operand(x) for x in (q, k, v, grad_out))
        out = out if out.stride(-1) == 1 else out.contiguous()
        lse = lse.contiguous()
        delta = torch.empty((num_queries, num_heads), dtype=torch.float32, device=device)
        compute_delta(grad_out, out, grad_lse, delta, (device, q.dtype, dim, block_size, HEADS_PER_KV, topk))
        schedule, key_count = step_schedule(block_indices, documents, num_keys, num_heads, plan)
        launch_blocks(q, k, v, grad_out, lse, delta, dq_acc, dk_acc, dv_acc, schedule, key_count, topk, softmax_scale,
                      teacher=teacher)
    dq = torch.empty(q.shape, dtype=q.dtype, device=device)
    ungroup_dq(dq_acc, dq, HEADS_PER_KV, DQ_DIM_GROUP, (device, q.dtype, dim))
    return dq, dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def operands(num_kv_heads: int, deterministic: bool = False):
    """The kernel's tensor operands (`common.blocks_operands`). The deterministic variant stores dK/dV
    into per-item workspace rows `[items * 128, D]` instead of adding to `[Tk, Hkv, D]`, and its
    dq_acc is not read. The teacher `[Tq * Hkv * topk, 128]` is written only by the variants that
    emit it; the others are passed one unread row."""
    num_heads = HEADS_PER_KV * num_kv_heads
    key_rows = (HEAD_DIM,) if deterministic else (num_kv_heads, HEAD_DIM)
    return blocks_operands(num_kv_heads, (
        ("grad_out", (num_heads, HEAD_DIM), None),
        ("lse", (num_heads,), torch.float32),
        ("delta", (num_heads,), torch.float32),
        ("dq_acc", (num_heads, HEAD_DIM), torch.float32),
        ("dk_acc", key_rows, torch.float32),
        ("dv_acc", key_rows, torch.float32),
        ("teacher", (BLOCK_SIZE,), TEACHER_DTYPE),
    ))


def launch_blocks(q, k, v, grad_out, lse, delta, dq_acc, dk_acc, dv_acc, schedule, key_count, topk,
                  softmax_scale, deterministic: bool = False, teacher: torch.Tensor | None = None) -> None:
    """Launch the blocks kernel: adds every scheduled entry's dQ, dK and dV to the fp32 accumulators,
    or, `deterministic`, stores each item's dK/dV into its workspace rows (see `operands`); with
    `teacher` (`new_teacher`), the variant that also writes the KL teacher into it."""
    emit_teacher = teacher is not None
    if teacher is None:
        teacher = torch.empty((1, BLOCK_SIZE), dtype=TEACHER_DTYPE, device=q.device)
    tensors = {
        "q": q, "k": k, "v": v, "grad_out": grad_out, "lse": lse, "delta": delta,
        "dq_acc": dq_acc, "dk_acc": dk_acc, "dv_acc": dv_acc, "teacher": teacher.view(-1, BLOCK_SIZE),
    }
    num_kv_heads = k.shape[1]
    # Its own scalar: softmax_scale, which scales dQ and dK.
    launch(_compiled(q.dtype, num_kv_heads, deterministic, emit_teacher), operands(num_kv_heads, deterministic), tensors,
           schedule, key_count, topk, softmax_scale, (softmax_scale,), sm_count(q.device))


@functools.cache
def _compiled(dtype: torch.dtype, num_kv_heads: int, deterministic: bool, emit_teacher: bool):
    """One executable per process and (dtype, Hkv, variant); token, key and item counts are dynamic."""

    return launcher(compile_blocks_kernel(dtype, num_kv_heads, deterministic=deterministic, emit_teacher=emit_teacher))


def compile_blocks_kernel(
    dtype: torch.dtype = torch.bfloat16,
    num_kv_heads: int = 4,
    arch: str | None = None,
    dump_dir: str | None = None,
    listings: bool = False,
    deterministic: bool = False,
    emit_teacher: bool = False,
):
    """`cute.compile` the blocks kernel (`arch=None`: this host's GPU; `deterministic`: the variant
    without dQ that stores dK/dV per item; `emit_teacher`: the variant that writes the KL teacher)
    on fake tensors with dynamic leading extents.
    `dump_dir` keeps the cubin there, and with `listings` the PTX and SASS too."""
    require_cute_dsl()
    import cutlass

    from .backward_kernel import Sm90BackwardKernel

    return compile_blocks(
        Sm90BackwardKernel(num_kv_heads, deterministic, emit_teacher), operands(num_kv_heads, deterministic), dtype,
        (cutlass.Float32(1.0),), arch, dump_dir, listings,  # its own scalar: softmax_scale
    )
