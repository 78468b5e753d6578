"""A Triton backward that walks the SM100 task tables: the tables proven on Hopper hardware.

The SM100 main kernel cannot run without Blackwell, but the tables it walks can be checked on
any GPU: this kernel consumes exactly what it would (`TaskTables`, the aligned K/V workspace,
`delta` from the preprocess) and must reproduce the reference gradients. One program per task:
it loads the task's eight query tokens x `G = Hq / Hkv` heads of its KV head (one 128-row tile
at M3 shapes), walks the task's 128-key block of the workspace in `KEY_SLICE`-key slices, masks
keys causally with `task_qpos`, and adds dQ, dK, dV into fp32 pools with atomics, like the main
kernel. Correctness first: no pipelining, dK/dV flushed per slice.

Products that Triton would round to the operand dtype keep fp32 accuracy: the fp32 factor (P or
dS) is split as `hi + lo`, both in the 16-bit operand dtype, so `P @ dO = hi @ dO + lo @ dO` runs
on tensor cores with an error near 2^-16 instead of 2^-8. With fp32 operands (the CPU interpreter
tests) the products are plain fp32 ("ieee").

Test support only; imports triton at module import.
"""

import torch
import triton
import triton.language as tl

KEY_SLICE = 32  # small slices keep the fp32 tiles of a 128-row task tile within registers and smem


@triton.jit
def _dot(left, right, IEEE: tl.constexpr):
    """`left @ right` in fp32: exact products of 16-bit operands, or plain fp32 ("ieee")."""
    if IEEE:
        return tl.dot(left, right, input_precision="ieee")
    return tl.dot(left, right)


@triton.jit
def _product(fp32_factor, operand, IEEE: tl.constexpr):
    """`fp32_factor @ operand` with an fp32-accurate result for a 16-bit `operand`."""
    if IEEE:
        return tl.dot(fp32_factor, operand.to(tl.float32), input_precision="ieee")
    high = fp32_factor.to(operand.dtype)
    low = (fp32_factor - high.to(tl.float32)).to(operand.dtype)
    return tl.dot(high, operand) + tl.dot(low, operand)


@triton.jit
def _task_backward_kernel(
    q, k_workspace, v_workspace, grad_out, lse, delta,
    task_meta, task_qrows, task_qpos,
    dq_accum, dk_accum, dv_accum,
    softmax_scale,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOKENS_PER_TASK: tl.constexpr, TILE: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr,
):
    task = tl.program_id(0)
    num_rows = tl.load(task_meta + task * 4 + 3)
    if num_rows == 0:
        return
    kv_head = tl.load(task_meta + task * 4)
    aligned_row = tl.load(task_meta + task * 4 + 1)
    block_id = tl.load(task_meta + task * 4 + 2)

    # Tile row m is query slot m // G of the task, with query head kv_head * G + m % G.
    tile_rows = tl.arange(0, TILE)
    slot = tile_rows // GROUP
    head = kv_head * GROUP + tile_rows % GROUP
    token = tl.load(task_qrows + task * TOKENS_PER_TASK + slot)
    key_limit = tl.load(task_qpos + task * TOKENS_PER_TASK + slot)
    row_ok = slot < num_rows
    row = tl.where(row_ok, token, 0).to(tl.int64) * NUM_HEADS + head
    dims = tl.arange(0, HEAD_DIM)
    row_offsets = row[:, None] * HEAD_DIM + dims[None, :]
    queries = tl.load(q + row_offsets, mask=row_ok[:, None], other=0.0)
    d_out = tl.load(grad_out + row_offsets, mask=row_ok[:, None], other=0.0)
    row_lse = tl.load(lse + row, mask=row_ok, other=0.0)
    row_delta = tl.load(delta + row, mask=row_ok, other=0.0)

    d_queries = tl.zeros((TILE, HEAD_DIM), dtype=tl.float32)
    for first_key in tl.static_range(0, BLOCK_SIZE, KEYS):
        offsets = first_key + tl.arange(0, KEYS)
        key_rows = (aligned_row + offsets).to(tl.int64) * NUM_KV_HEADS + kv_head
        key_offsets = key_rows[:, None] * HEAD_DIM + dims[None, :]
        keys = tl.load(k_workspace + key_offsets)
        values = tl.load(v_workspace + key_offsets)
        scores = _dot(queries, tl.trans(keys), IEEE) * softmax_scale
        visible = row_ok[:, None] & ((block_id * BLOCK_SIZE + offsets)[None, :] <= key_limit[:, None])
        probs = tl.where(visible, tl.exp(scores - row_lse[:, None]), 0.0)
        d_probs = _dot(d_out, tl.trans(values), IEEE)
        d_scores = probs * (d_probs - row_delta[:, None]) * softmax_scale
        tl.atomic_add(dv_accum + key_offsets, _product(tl.trans(probs), d_out, IEEE), sem="relaxed")
        tl.atomic_add(dk_accum + key_offsets, _product(tl.trans(d_scores), queries, IEEE), sem="relaxed")
        d_queries += _product(d_scores, keys, IEEE)
    tl.atomic_add(dq_accum + row_offsets, d_queries, mask=row_ok[:, None], sem="relaxed")


def consume_tasks(
    q: torch.Tensor,
    k_workspace: torch.Tensor,
    v_workspace: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    tables,
    softmax_scale: float,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fp32 pools `(dq_accum [Tq, Hq, D], dk_accum [W, Hkv, D], dv_accum [W, Hkv, D])` the
    SM100 main kernel would produce from the same tables (the `launch_main` contract).

    Args:
        q, grad_out: `[Tq, Hq, D]`; k_workspace, v_workspace: `[W, Hkv, D]` from `align_kv`
            (all one dtype); lse, delta: fp32 `[Tq, Hq]`; tables: `TaskTables`.
    """
    num_queries, num_heads, head_dim = q.shape
    rows, num_kv_heads, _ = k_workspace.shape
    operands = [x.contiguous() for x in (q, k_workspace, v_workspace, grad_out)]
    dq_accum = torch.zeros(num_queries, num_heads, head_dim, dtype=torch.float32, device=q.device)
    dk_accum = torch.zeros(rows, num_kv_heads, head_dim, dtype=torch.float32, device=q.device)
    dv_accum = torch.zeros_like(dk_accum)
    num_tasks, task_rows = tables.task_qrows.shape
    group = num_heads // num_kv_heads
    if num_tasks and num_queries:
        _task_backward_kernel[(num_tasks,)](
            *operands, lse.float().contiguous(), delta.float().contiguous(),
            tables.task_meta, tables.task_qrows, tables.task_qpos,
            dq_accum, dk_accum, dv_accum, softmax_scale,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size, TOKENS_PER_TASK=task_rows, TILE=task_rows * group, KEYS=min(KEY_SLICE, block_size),
            IEEE=q.dtype == torch.float32, num_warps=8,
        )
    return dq_accum, dk_accum, dv_accum
