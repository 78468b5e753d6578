"""`msa::forward` in Triton: KV-outer sparse attention, with the blocks a query group shares
optionally query-outer, then the combine (design: `torch_msa/triton/README.md`).
"""

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ..contract import compute_dtype
from ..documents import Documents
from ..plan.groups import QueryGroups, group_tokens
from ..plan.kernels import query_groups, schedule_for
from ..stages.combine import combine
from ..triton_utils.common import (
    LOG2_E,
    TILE_ROWS,
    binary_search_steps,
    dot_precision,
    item_horizon,
    locate_tokens,
    program_item,
    tile_shape,
)
from ..triton_utils.launch import LaunchConfig, cached_launches, launch

BLOCKS_CONFIGS = (LaunchConfig(rows=TILE_ROWS, num_stages=3), LaunchConfig(rows=64, num_stages=1))
GROUPS_CONFIGS = (LaunchConfig(num_stages=1),)


@triton.jit
def _tile_partials(q, partial_out, partial_lse, keys, values, key_position, key_ok, position, query, row_ok,
                   kv_head, group_head, query_head, qk_scale, stride_q_token, stride_q_head,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, TOPK: tl.constexpr, DIM: tl.constexpr,
                   PRECISION: tl.constexpr):
    """One tile of a KV-outer item: each row's (`query = t * TOPK + slot`, where `row_ok`) output
    over the item's key block, normalised, and its log2-sum-exp, into the row's partial."""
    dims = tl.arange(0, DIM)
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


@cached_launches
@triton.jit
def msa_fwd_blocks_kernel(
    q, k, v, partial_out, partial_lse,
    entry_query, item_bucket, item_start, item_end, bucket_head, bucket_key_row, bucket_block, position,
    query_outer, query_outer_offset, stride_query_outer_head,
    num_keys, qk_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr, PRECISION: tl.constexpr,
    QUERY_OUTER: tl.constexpr,
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
        if QUERY_OUTER:
            # `msa_fwd_groups_kernel` writes the partials of these entries; a tile left with none
            # is skipped.
            flags = query_outer + kv_head.to(tl.int64) * stride_query_outer_head + query_outer_offset
            row_ok &= tl.load(flags + query, mask=row_ok, other=1) == 0
            if tl.max(row_ok.to(tl.int32), axis=0) > 0:
                _tile_partials(q, partial_out, partial_lse, keys, values, key_position, key_ok, position, query,
                               row_ok, kv_head, group_head, query_head, qk_scale, stride_q_token, stride_q_head,
                               NUM_KV_HEADS, GROUP, TOPK, DIM, PRECISION)
        else:
            _tile_partials(q, partial_out, partial_lse, keys, values, key_position, key_ok, position, query, row_ok,
                           kv_head, group_head, query_head, qk_scale, stride_q_token, stride_q_head,
                           NUM_KV_HEADS, GROUP, TOPK, DIM, PRECISION)


@cached_launches
@triton.jit
def msa_fwd_groups_kernel(
    q, k, v, partial_out, partial_lse,
    block_indices, query_outer, group_start, group_end, group_blocks,
    cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
    window_start, window_stop, num_ids, num_keys, num_segments, num_docs, search_steps, qk_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_bi_head, stride_bi_token, stride_bi_slot, stride_query_outer_head,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, MOST: tl.constexpr, MOST_P2: tl.constexpr, BLOCK: tl.constexpr,
    DIM: tl.constexpr, PRECISION: tl.constexpr, FRAGMENTS: tl.constexpr,
):
    group = tl.program_id(0)
    kv_head = tl.program_id(1)
    start = tl.maximum(tl.load(group_start + group), window_start)
    end = tl.minimum(tl.load(group_end + group), window_stop)
    if start >= end:
        return
    rows = tl.arange(0, TOKENS * GROUP_P2)
    group_head = rows % GROUP_P2
    token = (start + rows // GROUP_P2).to(tl.int64)
    row_ok = (token < end) & (group_head < GROUP)
    # A group's queries share a document: its key rows start at one `key_start`.
    pos, key_start, _ = locate_tokens(token, row_ok, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
                                      num_keys, num_segments, num_docs, search_steps, FRAGMENTS)
    first_key = tl.max(tl.where(row_ok, key_start, 0), axis=0)
    horizon = tl.max(tl.where(row_ok, pos, -1), axis=0)

    # Each row's query-outer entries: their blocks (-1 elsewhere) and the first one's slot, which
    # receives the row's merged partial; the partials of its other query-outer slots stay empty.
    slots = tl.arange(0, TOPK_P2)
    slot_ok = row_ok[:, None] & (slots[None, :] < TOPK)
    ids = tl.load(block_indices + kv_head.to(tl.int64) * stride_bi_head + token[:, None] * stride_bi_token
                  + slots[None, :] * stride_bi_slot, mask=slot_ok, other=-1)
    flagged = tl.load(query_outer + kv_head.to(tl.int64) * stride_query_outer_head + token[:, None] * TOPK
                      + slots[None, :], mask=slot_ok, other=0) != 0
    chosen = tl.where(flagged, ids, -1)
    first_slot = tl.min(tl.where(flagged, slots[None, :], TOPK_P2), axis=1)

    dims = tl.arange(0, DIM)
    offsets = tl.arange(0, BLOCK)
    local = token - window_start
    query_head = kv_head * GROUP + group_head
    q_rows = tl.load(q + local[:, None] * stride_q_token + query_head[:, None] * stride_q_head + dims[None, :],
                     mask=row_ok[:, None], other=0.0)
    listed = tl.arange(0, MOST_P2)
    blocks = tl.load(group_blocks + (kv_head.to(tl.int64) * num_ids + group) * MOST + listed,
                     mask=listed < MOST, other=-1)
    row_max = tl.full((TOKENS * GROUP_P2,), float("-inf"), tl.float32)
    total = tl.zeros((TOKENS * GROUP_P2,), tl.float32)
    acc = tl.zeros((TOKENS * GROUP_P2, DIM), tl.float32)
    # The listed blocks come first, ascending, then -1.
    for index in range(tl.sum((blocks >= 0).to(tl.int32), axis=0)):
        block = tl.load(group_blocks + (kv_head.to(tl.int64) * num_ids + group) * MOST + index)
        key_position = block * BLOCK + offsets
        key_row = first_key + key_position
        key_ok = (key_position <= horizon) & (key_row < num_keys)
        keys = tl.load(k + key_row[:, None] * stride_k_token + kv_head * stride_k_head + dims[None, :],
                       mask=key_ok[:, None], other=0.0)
        values = tl.load(v + key_row[:, None] * stride_v_token + kv_head * stride_v_head + dims[None, :],
                         mask=key_ok[:, None], other=0.0)
        selects = tl.max((chosen == block).to(tl.int32), axis=1) > 0
        scores = tl.dot(q_rows, tl.trans(keys), input_precision=PRECISION) * qk_scale
        visible = selects[:, None] & (key_position[None, :] <= pos[:, None]) & key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - shift)
        probs = tl.exp2(scores - shift[:, None])
        total = total * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=PRECISION)
        row_max = new_max

    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    lse = tl.where(total > 0, row_max + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
    written = row_ok & (first_slot < TOPK)
    partial = ((local * NUM_KV_HEADS + kv_head) * TOPK + first_slot) * GROUP + group_head
    tl.store(partial_out + partial[:, None] * DIM + dims[None, :], out.to(partial_out.dtype.element_ty),
             mask=written[:, None])
    tl.store(partial_lse + partial, lse, mask=written)


@dataclasses.dataclass(frozen=True)
class QueryOuter:
    """The query-outer work of one forward call, seen from one window of its queries.

    Attributes:
        groups: the call's query groups (`torch_msa.plan.groups.QueryGroups`).
        block_indices: the call's int32 `[Hkv, Tq, topk]` selection; documents: the call's documents.
        start, stop: the window's queries `[start, stop)` of the call's.
    """

    groups: QueryGroups
    block_indices: torch.Tensor
    documents: Documents
    start: int
    stop: int

    def window(self, start: int, stop: int) -> "QueryOuter":
        return dataclasses.replace(self, start=start, stop=stop)


def query_outer_work(block_indices, documents: Documents, num_keys: int, block_size: int,
                     num_heads: int) -> QueryOuter:
    """The query groups of a forward call (`torch_msa.plan.kernels.query_groups`, three launches)
    as the forward walks them, over all its queries."""
    block_indices = block_indices if block_indices.dtype == torch.int32 else block_indices.to(torch.int32)
    groups = query_groups(block_indices, documents, num_keys, block_size,
                          group_tokens(num_heads, block_indices.shape[0]))
    return QueryOuter(groups, block_indices, documents, 0, block_indices.shape[1])


def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan=None, query_outer=None):
    """Same contract as `torch_msa.reference.forward`: `out [Tq, Hq, D]`, `lse [Tq, Hq]` fp32.

    `plan` (from `msa::plan`, any item size) spares building the schedule. `query_outer` (a
    `QueryOuter` whose window is these queries) runs the entries it marks query-outer, one program
    per (query group, KV head), and the rest KV-outer; None runs every entry KV-outer.
    """
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    topk = block_indices.shape[-1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((num_queries, num_heads), dtype=compute_dtype(q.dtype), device=q.device)
    if num_queries == 0:
        return out, lse
    if num_keys == 0:
        return out.zero_(), lse.fill_(-math.inf)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    schedule = schedule_for(block_indices, documents, num_keys, block_size, num_heads, plan)
    partial_out = torch.empty((num_queries * num_kv_heads * topk * group, dim), dtype=q.dtype, device=q.device)
    partial_lse = torch.full((num_queries * num_kv_heads * topk * group,), -math.inf, dtype=torch.float32,
                             device=q.device)
    shape_key = (q.device, q.dtype, dim, block_size, group, topk)
    flags = query_outer.groups.query_outer if query_outer is not None else schedule.entry_query

    def launch_blocks(config):
        tokens, group_p2 = tile_shape(num_heads, num_kv_heads, config.rows)
        msa_fwd_blocks_kernel[(schedule.item_start.numel(),)](
            q, k, v, partial_out, partial_lse,
            schedule.entry_query, schedule.item_bucket, schedule.item_start, schedule.item_end,
            schedule.bucket_head, schedule.bucket_key_row, schedule.bucket_block, schedule.position,
            flags, query_outer.start * topk if query_outer is not None else 0, flags.stride(0),
            num_keys, softmax_scale * LOG2_E.value,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P2=group_p2, TOKENS=tokens,
            TOPK=topk, BLOCK=block_size, DIM=dim, PRECISION=dot_precision(q.dtype),
            QUERY_OUTER=query_outer is not None,
            **config.options,
        )

    launch("msa_fwd_blocks_kernel", shape_key, BLOCKS_CONFIGS, launch_blocks)
    if query_outer is not None:
        _launch_groups(q, k, v, partial_out, partial_lse, query_outer, block_size, softmax_scale, shape_key)
    combine(partial_out, partial_lse, out, lse, num_kv_heads, topk)
    return out, lse


def _launch_groups(q, k, v, partial_out, partial_lse, work: QueryOuter, block_size, softmax_scale, shape_key):
    """Launch `msa_fwd_groups_kernel` over the groups of `work`'s window."""
    num_heads, dim = q.shape[1:]
    num_keys, num_kv_heads, _ = k.shape
    groups, documents = work.groups, work.documents.map_tensors(torch.Tensor.contiguous)
    num_ids, most = groups.group_blocks.shape[1:]
    topk = work.block_indices.shape[-1]
    cu_seqlens_q, fragments = documents.cu_seqlens_q, documents.has_fragments
    num_segments = cu_seqlens_q.numel() - 1
    tokens = group_tokens(num_heads, num_kv_heads)

    def launch_groups(config):
        msa_fwd_groups_kernel[(num_ids, num_kv_heads)](
            q, k, v, partial_out, partial_lse,
            work.block_indices, groups.query_outer, groups.group_start, groups.group_end, groups.group_blocks,
            cu_seqlens_q, documents.cu_seqlens_k,
            documents.fragment_documents if fragments else cu_seqlens_q,
            documents.fragment_starts if fragments else cu_seqlens_q,
            work.start, work.stop, num_ids, num_keys, num_segments, documents.num_documents,
            binary_search_steps(num_segments), softmax_scale * LOG2_E.value,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *work.block_indices.stride(), groups.query_outer.stride(0),
            NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads,
            GROUP_P2=triton.next_power_of_2(num_heads // num_kv_heads), TOKENS=tokens, TOPK=topk,
            TOPK_P2=triton.next_power_of_2(topk), MOST=most, MOST_P2=triton.next_power_of_2(most), BLOCK=block_size,
            DIM=dim, PRECISION=dot_precision(q.dtype), FRAGMENTS=fragments,
            **config.options,
        )

    launch("msa_fwd_groups_kernel", shape_key, GROUPS_CONFIGS, launch_groups)
