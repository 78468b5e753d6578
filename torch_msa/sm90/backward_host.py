"""`msa::backward` on Hopper: the host side of `backward_kernel.py`: delta, zeroed fp32 accumulators,
one launch that adds dQ, dK, dV into them, the casts. One executable per dtype, Hkv and variant.
"""

import functools

import torch

from ..backends import UnsupportedInputs
from ..cute_dsl import require_cute_dsl, sm_count
from ..cute_dsl.cute_io import aligned_operand, launcher
from ..stages.delta import compute_delta
from ..stages.dq import ungroup_dq
from ..stages.fixed_point_dq import share_cap
from ..uninitialized import uninitialized
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

MAX_QUERY_ROWS = 2**31 - 1  # the kernel indexes (query, head) rows with int32
# The teacher's probabilities lie in [0, 1], where fp16 keeps 3 more bits than bf16.
TEACHER_DTYPE = torch.float16


def new_teacher(num_queries: int, num_kv_heads: int, topk: int, device) -> torch.Tensor:
    """fp16 zeros `[Tq, Hkv, topk, 128]` for the kernel to write the index loss's teacher into."""
    return torch.zeros((num_queries, num_kv_heads, topk, BLOCK_SIZE), dtype=TEACHER_DTYPE, device=device)


def check_query_rows(num_queries: int, num_heads: int) -> None:
    """Raises `UnsupportedInputs` when the `Tq * Hq` query rows exceed int32."""
    if num_queries * num_heads > MAX_QUERY_ROWS:
        raise UnsupportedInputs(
            f"the SM90 backward indexes query rows with 32-bit integers: {num_queries} queries x {num_heads} heads "
            f"are more than {MAX_QUERY_ROWS} rows"
        )


def check_inputs(grad_out, q, k, v, block_size) -> None:
    """Raises `UnsupportedInputs` for inputs the kernel does not serve."""
    check_served(q, k, v, block_size)
    if grad_out.dtype != q.dtype:
        raise UnsupportedInputs(f"the SM90 backward takes grad_out of q's dtype {q.dtype}, got {grad_out.dtype}")
    check_query_rows(q.shape[0], q.shape[1])


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None, teacher=None):
    """Same contract as `torch_msa.reference.backward`: `(dq, dk, dv)` in the inputs' dtype.

    `teacher`: None, or `new_teacher()` for the kernel to fill with the index loss's teacher
    (layout: `torch_msa.reference_index_loss.teacher_probabilities`). Walks `plan`'s items (any item
    size), or those of a new plan.

    Raises:
        UnsupportedInputs: outside the served configuration (`check_inputs`).
    """
    check_inputs(grad_out, q, k, v, block_size)
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    require_cute_dsl()

    topk = block_indices.shape[-1]
    device = q.device
    # One zero fill for all three (each view stays 16-byte aligned: D = 128 fp32).
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
        delta = uninitialized((num_queries, num_heads), dtype=torch.float32, device=device)
        compute_delta(grad_out, out, grad_lse, delta, (device, q.dtype, dim, block_size, HEADS_PER_KV, topk))
        schedule, key_count = step_schedule(block_indices, documents, num_keys, num_heads, plan)
        launch_blocks(q, k, v, grad_out, lse, delta, dq_acc, dk_acc, dv_acc, schedule, key_count, topk, softmax_scale,
                      teacher=teacher)
    dq = uninitialized(q.shape, dtype=q.dtype, device=device)
    ungroup_dq(dq_acc, dq, HEADS_PER_KV, DQ_DIM_GROUP, (device, q.dtype, dim))
    return dq, dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def operands(num_kv_heads: int, deterministic: bool = False):
    """The kernel's tensor operands (`common.blocks_operands`). `deterministic`: dK/dV are
    workspace rows `[items * 128, D]`, dq_acc holds int32 fixed-point sums and dq_scale their row
    scales (otherwise unread). The teacher is one unread row unless the variant emits it."""
    num_heads = HEADS_PER_KV * num_kv_heads
    key_rows = (HEAD_DIM,) if deterministic else (num_kv_heads, HEAD_DIM)
    return blocks_operands(num_kv_heads, (
        ("grad_out", (num_heads, HEAD_DIM), None),
        ("lse", (num_heads,), torch.float32),
        ("delta", (num_heads,), torch.float32),
        ("dq_acc", (num_heads, HEAD_DIM), torch.int32 if deterministic else torch.float32),
        ("dk_acc", key_rows, torch.float32),
        ("dv_acc", key_rows, torch.float32),
        ("teacher", (BLOCK_SIZE,), TEACHER_DTYPE),
        ("dq_scale", (num_heads,), torch.float32),
    ))


def launch_blocks(q, k, v, grad_out, lse, delta, dq_acc, dk_acc, dv_acc, schedule, key_count, topk,
                  softmax_scale, teacher: torch.Tensor | None = None, dq_scale: torch.Tensor | None = None) -> None:
    """Launch the blocks kernel: add every entry's dQ, dK, dV to the fp32 accumulators, or, with
    `dq_scale` (the deterministic variant), add dQ in fixed point to the int32 `dq_acc`
    (`torch_msa.stages.fixed_point_dq`; a marked row's scale becomes NaN) and store each item's
    dK/dV in its workspace rows; with `teacher`, also write it."""
    deterministic = dq_scale is not None
    emit_teacher = teacher is not None
    if teacher is None:
        teacher = uninitialized((1, BLOCK_SIZE), dtype=TEACHER_DTYPE, device=q.device)
    tensors = {
        "q": q, "k": k, "v": v, "grad_out": grad_out, "lse": lse, "delta": delta,
        "dq_acc": dq_acc, "dk_acc": dk_acc, "dv_acc": dv_acc, "teacher": teacher.view(-1, BLOCK_SIZE),
        "dq_scale": lse if dq_scale is None else dq_scale,  # unread without it
    }
    num_kv_heads = k.shape[1]
    launch(_compiled(q.dtype, num_kv_heads, deterministic, emit_teacher), operands(num_kv_heads, deterministic), tensors,
           schedule, key_count, topk, softmax_scale, (softmax_scale, share_cap(topk)), sm_count(q.device))


@functools.cache
def _compiled(dtype: torch.dtype, num_kv_heads: int, deterministic: bool, emit_teacher: bool):
    """One executable per (dtype, Hkv, variant); token, key and item counts are dynamic."""
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
    """`cute.compile` the blocks kernel variant (`common.compile_blocks`; `arch=None`: this GPU)."""
    require_cute_dsl()
    import cutlass

    from .backward_kernel import Sm90BackwardKernel

    return compile_blocks(
        Sm90BackwardKernel(num_kv_heads, deterministic, emit_teacher), operands(num_kv_heads, deterministic), dtype,
        (cutlass.Float32(1.0), cutlass.Float32(1.0)), arch, dump_dir, listings,  # its own: softmax_scale, dq_share_cap
    )
