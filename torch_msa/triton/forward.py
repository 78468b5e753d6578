"""`msa::forward` in Triton: KV-outer sparse attention, the query-outer part when asked for, then
the combine (design: `torch_msa/triton/README.md`).
"""

import math

import torch
import triton
import triton.language as tl

from ..contract import compute_dtype
from ..plan.kernels import schedule_for
from ..stages.combine import combine
from ..stages.query_outer import add_partials
from ..triton_utils.common import LOG2_E, TILE_ROWS, dot_precision, item_horizon, program_item, tile_shape
from ..triton_utils.launch import LaunchConfig, cached_launches, launch
from ..uninitialized import uninitialized

BLOCKS_CONFIGS = (LaunchConfig(rows=TILE_ROWS, num_stages=3), LaunchConfig(rows=64, num_stages=1))


@cached_launches
@triton.jit
def msa_fwd_blocks_kernel(
    q, k, v, partial_out, partial_lse,
    entry_query, item_bucket, item_start, item_end, bucket_head, bucket_key_row, bucket_block, position,
    num_keys, qk_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr, PRECISION: tl.constexpr,
):
    item, start, end = program_item(item_start, item_end)
    if start >= end:
        return
    bucket = tl.load(item_bucket + item)
    kv_head = tl.load(bucket_head + bucket)
    first_key = tl.load(bucket_key_row + bucket)
    block = tl.load(bucket_block + bucket)

    dims = tl.arange(0, DIM)
    offsets = tl.arange(0, BLOCK)
    key_row = (first_key + offsets).to(tl.int64)
    key_position = block * BLOCK + offsets
    # The block's tail belongs to the next document: a NaN there would survive `0 * NaN` in P @ V.
    key_ok = (key_position <= item_horizon(entry_query, position, start, end, TOPK)) & (key_row < num_keys)
    keys = tl.load(k + key_row[:, None] * stride_k_token + kv_head * stride_k_head + dims[None, :],
                   mask=key_ok[:, None], other=0.0)
    values = tl.load(v + key_row[:, None] * stride_v_token + kv_head * stride_v_head + dims[None, :],
                     mask=key_ok[:, None], other=0.0)

    rows = tl.arange(0, TOKENS * GROUP_P2)
    row_token = rows // GROUP_P2
    group_head = rows % GROUP_P2
    query_head = kv_head * GROUP + group_head
    for first in range(start, end, TOKENS):
        entry = first + row_token
        row_ok = (entry < end) & (group_head < GROUP)
        query = tl.load(entry_query + entry, mask=row_ok, other=0)
        token = (query // TOPK).to(tl.int64)
        pos = tl.load(position + token, mask=row_ok, other=-1)
        q_rows = tl.load(q + token[:, None] * stride_q_token + query_head[:, None] * stride_q_head + dims[None, :],
                         mask=row_ok[:, None], other=0.0)
        scores = tl.dot(q_rows, tl.trans(keys), input_precision=PRECISION) * qk_scale
        visible = (key_position[None, :] <= pos[:, None]) & key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        row_max = tl.max(scores, axis=1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        probs = tl.exp2(scores - row_max[:, None])
        total = tl.sum(probs, axis=1)
        out = tl.dot(probs.to(values.dtype), values, input_precision=PRECISION)
        out = out / tl.where(total > 0, total, 1.0)[:, None]
        lse = tl.where(total > 0, row_max + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
        # Partials are laid out [Tq, Hkv, topk, G]: one (query, KV head) reads a contiguous run.
        partial = ((token * NUM_KV_HEADS + kv_head) * TOPK + query % TOPK) * GROUP + group_head
        tl.store(partial_out + partial[:, None] * DIM + dims[None, :], out.to(partial_out.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(partial_lse + partial, lse, mask=row_ok)


def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan=None, query_outer=None, into=None):
    """Same contract as `torch_msa.reference.forward`: `out [Tq, Hq, D]`, `lse [Tq, Hq]` fp32.

    `plan` (from `msa::plan`, any item size) spares building the schedule. With `query_outer`
    (`torch_msa.stages.query_outer.QueryOuter`, windowed to these queries), `block_indices` is its
    KV-outer part's selection and its query-outer part runs too. With `into`, `(out, lse)`
    contiguous of those shapes and dtypes, writes them and returns them."""
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    topk = block_indices.shape[-1]
    out, lse = into if into is not None else (
        uninitialized(q.shape, dtype=q.dtype, device=q.device),
        uninitialized((num_queries, num_heads), dtype=compute_dtype(q.dtype), device=q.device))
    if num_queries == 0:
        return out, lse
    if num_keys == 0:
        return out.zero_(), lse.fill_(-math.inf)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    partial_out = uninitialized((num_queries * num_kv_heads * topk * group, dim), dtype=q.dtype, device=q.device)
    partial_lse = torch.full((num_queries * num_kv_heads * topk * group,), -math.inf, dtype=torch.float32,
                             device=q.device)
    if query_outer is not None:
        # The two parts write disjoint partials: queued first, the query-outer part runs while
        # the host prepares the KV-outer part's schedule.
        add_partials(q, k, v, partial_out, partial_lse, query_outer, block_size, softmax_scale)
        plan = query_outer.kv_outer_plan(plan, num_keys, block_size, num_heads)
    schedule = schedule_for(block_indices, documents, num_keys, block_size, num_heads, plan)
    shape_key = (q.device, q.dtype, dim, block_size, group, topk)

    def launch_blocks(config):
        tokens, group_p2 = tile_shape(num_heads, num_kv_heads, config.rows)
        msa_fwd_blocks_kernel[(schedule.item_start.numel(),)](
            q, k, v, partial_out, partial_lse,
            schedule.entry_query, schedule.item_bucket, schedule.item_start, schedule.item_end,
            schedule.bucket_head, schedule.bucket_key_row, schedule.bucket_block, schedule.position,
            num_keys, softmax_scale * LOG2_E.value,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P2=group_p2, TOKENS=tokens,
            TOPK=topk, BLOCK=block_size, DIM=dim, PRECISION=dot_precision(q.dtype),
            **config.options,
        )

    launch("msa_fwd_blocks_kernel", shape_key, BLOCKS_CONFIGS, launch_blocks)
    combine(partial_out, partial_lse, out, lse, num_kv_heads, topk)
    return out, lse
