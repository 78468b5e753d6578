"""`msa::backward` in Triton: KV-outer, dK/dV on chip, dQ through fp32 atomics (design:
`torch_msa/triton/README.md`); also the key pass of the deterministic backward (`launch_blocks`).
"""

import torch
import triton
import triton.language as tl

from ..backends import UnsupportedInputs
from ..plan.kernels import schedule_for
from ..stages.delta import compute_delta
from ..triton_utils.common import LOG2_E, dot_precision, item_horizon, program_item, tile_shape
from ..triton_utils.launch import LaunchConfig, cached_launches, launch
from ..uninitialized import uninitialized

# After SM90's: sm_100 (pipelined tiles twice as large), the 99 KB parts, then fp32 tiles.
BLOCKS_CONFIGS = (
    LaunchConfig(rows=128, block_n=64, num_stages=3),
    LaunchConfig(rows=128, block_n=64, num_stages=1),
    LaunchConfig(rows=64, block_n=64, num_stages=1),
    LaunchConfig(rows=64, block_n=32, num_stages=1),
)
# The deterministic variant: the same kernel without dQ, so the same tiles.
DETERMINISTIC_BLOCKS_CONFIGS = (
    LaunchConfig(rows=128, block_n=64, num_stages=3),
    LaunchConfig(rows=128, block_n=64, num_stages=1),
    LaunchConfig(rows=64, block_n=64, num_stages=1),
    LaunchConfig(rows=64, block_n=32, num_stages=1),
)


@cached_launches
@triton.jit
def msa_bwd_blocks_kernel(
    q, k, v, grad_out, lse, delta, dq_acc, dk_acc, dv_acc,
    entry_query, item_bucket, item_start, item_end, bucket_head, bucket_key_row, bucket_block, position,
    num_keys, softmax_scale, qk_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_do_token, stride_do_head,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, DIM: tl.constexpr,
    PRECISION: tl.constexpr, DETERMINISTIC: tl.constexpr = False,
):
    """dK/dV of one item's key slice (and, unless `DETERMINISTIC`, dQ of its queries).

    Default: added to the fp32 accumulators `dq_acc`, `dk_acc`, `dv_acc` (`[T * H, D]` rows) with
    atomics. `DETERMINISTIC`: `dq_acc` is not touched and dK/dV are stored in the item's rows
    `item * BLOCK + c` of the workspaces `dk_acc`, `dv_acc`
    (`torch_msa.stages.deterministic.reduce_key_workspace` reduces them).
    """
    item, start, end = program_item(item_start, item_end)
    if start >= end:
        return
    bucket = tl.load(item_bucket + item)
    kv_head = tl.load(bucket_head + bucket)
    slice_start = tl.program_id(1) * BLOCK_N
    first_key = tl.load(bucket_key_row + bucket) + slice_start
    block = tl.load(bucket_block + bucket)

    dims = tl.arange(0, DIM)
    offsets = tl.arange(0, BLOCK_N)
    key_row = (first_key + offsets).to(tl.int64)
    key_position = block * BLOCK + slice_start + offsets
    # As in the forward: the block's tail (the next document's keys) is neither read nor written.
    key_ok = (key_position <= item_horizon(entry_query, position, start, end, TOPK)) & (key_row < num_keys)
    keys = tl.load(k + key_row[:, None] * stride_k_token + kv_head * stride_k_head + dims[None, :],
                   mask=key_ok[:, None], other=0.0)
    values = tl.load(v + key_row[:, None] * stride_v_token + kv_head * stride_v_head + dims[None, :],
                     mask=key_ok[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, DIM), tl.float32)

    rows = tl.arange(0, TOKENS * GROUP_P2)
    row_token = rows // GROUP_P2
    group_head = rows % GROUP_P2
    query_head = kv_head * GROUP + group_head
    num_heads = NUM_KV_HEADS * GROUP
    for first in range(start, end, TOKENS):
        entry = first + row_token
        row_ok = (entry < end) & (group_head < GROUP)
        token = (tl.load(entry_query + entry, mask=row_ok, other=0) // TOPK).to(tl.int64)
        pos = tl.load(position + token, mask=row_ok, other=-1)
        q_rows = tl.load(q + token[:, None] * stride_q_token + query_head[:, None] * stride_q_head + dims[None, :],
                         mask=row_ok[:, None], other=0.0)
        d_out = tl.load(grad_out + token[:, None] * stride_do_token + query_head[:, None] * stride_do_head + dims[None, :],
                        mask=row_ok[:, None], other=0.0)
        head_row = token * num_heads + query_head
        row_lse = tl.load(lse + head_row, mask=row_ok, other=0.0) * LOG2_E
        # Like the reference, a query with an empty key set (lse = -inf) shifts by 0, not inf.
        row_lse = tl.where((row_lse == float("inf")) | (row_lse == float("-inf")), 0.0, row_lse)
        row_delta = tl.load(delta + head_row, mask=row_ok, other=0.0)

        scores = tl.dot(q_rows, tl.trans(keys), input_precision=PRECISION) * qk_scale
        visible = (key_position[None, :] <= pos[:, None]) & key_ok[None, :] & row_ok[:, None]
        probs = tl.where(visible, tl.exp2(scores - row_lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(probs.to(d_out.dtype)), d_out, input_precision=PRECISION)
        d_probs = tl.dot(d_out, tl.trans(values), input_precision=PRECISION)
        # `where`, not `probs *`: a non-finite dP of a hidden key must not reach dQ/dK through 0 * NaN.
        d_scores = tl.where(visible, probs * (d_probs - row_delta[:, None]), 0.0).to(q_rows.dtype)
        dk += tl.dot(tl.trans(d_scores), q_rows, input_precision=PRECISION)
        if not DETERMINISTIC:
            dq = tl.dot(d_scores, keys, input_precision=PRECISION) * softmax_scale
            tl.atomic_add(dq_acc + head_row[:, None] * DIM + dims[None, :], dq, mask=row_ok[:, None], sem="relaxed")

    if DETERMINISTIC:
        part = (item.to(tl.int64) * BLOCK + slice_start + offsets)[:, None] * DIM + dims[None, :]
        tl.store(dk_acc + part, dk * softmax_scale, mask=key_ok[:, None])
        tl.store(dv_acc + part, dv, mask=key_ok[:, None])
    else:
        kv_rows = (key_row * NUM_KV_HEADS + kv_head)[:, None] * DIM + dims[None, :]
        tl.atomic_add(dk_acc + kv_rows, dk * softmax_scale, mask=key_ok[:, None], sem="relaxed")
        tl.atomic_add(dv_acc + kv_rows, dv, mask=key_ok[:, None], sem="relaxed")


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None):
    """Same contract as `torch_msa.reference.backward`: `(dq, dk, dv)` in the inputs' dtype.
    `plan` (from `msa::plan`, any item size) spares building the schedule.

    Raises:
        UnsupportedInputs: under deterministic algorithms (`backward_deterministic.py` serves them).
    """
    if torch.are_deterministic_algorithms_enabled():
        raise UnsupportedInputs("deterministic algorithms were requested and the Triton backward adds with atomics")
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    topk = block_indices.shape[-1]
    dq_acc = torch.zeros((num_queries, num_heads, dim), dtype=torch.float32, device=q.device)
    dk_acc = torch.zeros((num_keys, num_kv_heads, dim), dtype=torch.float32, device=q.device)
    dv_acc = torch.zeros((num_keys, num_kv_heads, dim), dtype=torch.float32, device=q.device)
    if num_queries > 0 and num_keys > 0:
        q, k, v, grad_out, out = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, grad_out, out))
        lse = lse.contiguous()
        delta = uninitialized((num_queries, num_heads), dtype=torch.float32, device=q.device)
        schedule = schedule_for(block_indices, documents, num_keys, block_size, num_heads, plan)
        shape_key = (q.device, q.dtype, dim, block_size, group, topk)
        compute_delta(grad_out, out, grad_lse, delta, shape_key)
        launch_blocks(q, k, v, grad_out, lse, delta, (dq_acc, dk_acc, dv_acc), schedule, topk, block_size,
                      softmax_scale, BLOCKS_CONFIGS, "msa_bwd_blocks_kernel", shape_key, deterministic=False)
    return dq_acc.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def launch_blocks(q, k, v, grad_out, lse, delta, outputs, schedule, topk, block_size, softmax_scale, configs, name,
                  shape_key, deterministic: bool) -> None:
    """`msa_bwd_blocks_kernel` over every item of `schedule` and key slice: `outputs` are
    `(dq_acc, dk_acc, dv_acc)`, the fp32 accumulators, or with `deterministic` the per-item dK/dV
    workspaces (`(ignored, dk_part, dv_part)`, rows `item * block_size + c`)."""
    num_heads, dim = q.shape[1], q.shape[2]
    num_keys, num_kv_heads = k.shape[0], k.shape[1]

    def launch_config(config):
        tokens, group_p2 = tile_shape(num_heads, num_kv_heads, config.rows)
        block_n = min(config.block_n, block_size)
        msa_bwd_blocks_kernel[(schedule.item_start.numel(), block_size // block_n)](
            q, k, v, grad_out, lse, delta, *outputs,
            schedule.entry_query, schedule.item_bucket, schedule.item_start, schedule.item_end,
            schedule.bucket_head, schedule.bucket_key_row, schedule.bucket_block, schedule.position,
            num_keys, softmax_scale, softmax_scale * LOG2_E.value,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1),
            NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, GROUP_P2=group_p2, TOKENS=tokens,
            TOPK=topk, BLOCK=block_size, BLOCK_N=block_n, DIM=dim, PRECISION=dot_precision(q.dtype),
            DETERMINISTIC=deterministic, **config.options,
        )

    launch(name, shape_key, configs, launch_config)
