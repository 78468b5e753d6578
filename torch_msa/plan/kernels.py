"""`msa::plan` in Triton: the tables of `torch_msa.plan.schedule.build_schedule` in a dozen host
calls instead of about a hundred (steps: `torch_msa/plan/README.md`), and `bucket_key_count` in
one kernel.
"""

import torch
import triton
import triton.language as tl

from ..documents import Documents
from ..triton_utils.common import binary_search_steps, find_segments, locate_tokens
from .groups import Q_OUTER_COST, QueryGroups, build_query_groups, group_ids, max_group_blocks
from .schedule import Schedule, build_schedule, entries_per_item, max_buckets, max_items, pack, section_sizes, unpack

_ENTRIES = 1024  # entries per program of the 1-D kernels
_SLOT_TILE = 1024  # (token, slot) pairs per program of the key kernel


@triton.jit
def msa_plan_entry_keys_kernel(
    block_indices, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts, bucket_key, position,
    num_queries, num_keys, num_segments, num_docs, search_steps, block_size, key_stride, past_all,
    stride_head, stride_token, stride_slot,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, TOKENS: tl.constexpr, FRAGMENTS: tl.constexpr,
):
    head = tl.program_id(1)
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    token_ok = tokens < num_queries
    token = tokens.to(tl.int64)

    pos, key_start = locate_tokens(token, token_ok, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
                                   num_keys, num_segments, num_docs, search_steps, FRAGMENTS)
    tl.store(position + tokens, pos.to(tl.int32), mask=token_ok & (head == 0))

    slots = tl.arange(0, TOPK_P2)
    slot_ok = token_ok[:, None] & (slots < TOPK)[None, :]
    row = block_indices + head.to(tl.int64) * stride_head + token * stride_token
    ids = tl.load(row[:, None] + slots[None, :] * stride_slot, mask=slot_ok, other=-1)
    last_block = tl.where(pos >= 0, pos // block_size, -1)
    valid = slot_ok & (ids >= 0) & (ids.to(tl.int64) <= last_block[:, None])
    for earlier in range(TOPK):
        other = tl.load(row + earlier * stride_slot, mask=token_ok, other=-1)
        valid &= ~((ids == other[:, None]) & (slots[None, :] > earlier))
    key = key_start[:, None] + head.to(tl.int64) * key_stride + ids.to(tl.int64) * block_size
    key = tl.where(valid, key, past_all)
    entry = (head * num_queries + token)[:, None] * TOPK + slots[None, :]
    tl.store(bucket_key + entry, key, mask=slot_ok)


@triton.jit
def msa_plan_bucket_starts_kernel(sorted_key, order, entry_query, starts, num_entries, entries_per_head, past_all,
                                  BLOCK: tl.constexpr):
    entry = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = entry < num_entries
    key = tl.load(sorted_key + entry, mask=ok, other=past_all)
    previous = tl.load(sorted_key + entry - 1, mask=ok & (entry > 0), other=-1)
    tl.store(starts + entry, ((key != previous) & (key < past_all)).to(tl.int32), mask=ok)
    tl.store(entry_query + entry, (tl.load(order + entry, mask=ok, other=0) % entries_per_head).to(tl.int32), mask=ok)


@triton.jit
def _lower_bound(sorted_key, low, high, value, search_steps):
    """Per lane, the first index in `[low, high)` of `sorted_key` whose key is `>= value`
    (`high` if none); lanes with `low == high` load nothing."""
    for _ in range(search_steps):
        active = low < high
        middle = low + ((high - low) >> 1)
        below = tl.load(sorted_key + middle, mask=active, other=0) < value
        high = tl.where(active & ~below, middle, high)
        low = tl.where(active & below, middle + 1, low)
    return low


@triton.jit
def msa_plan_bucket_tables_kernel(
    sorted_key, order, entry_bucket, block_indices,
    bucket_ptr, bucket_head, bucket_key_row, bucket_block, items_per_bucket, num_buckets,
    num_entries, bucket_bound, search_steps, key_stride, past_all, entries_per_item,
    num_queries, stride_head, stride_token, stride_slot,
    TOPK: tl.constexpr, BLOCK: tl.constexpr,
):
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    total = tl.load(entry_bucket + num_entries - 1)  # buckets, the bound not applied
    # One lane searches; the others start with an empty range.
    lanes = tl.arange(0, BLOCK)
    num_valid = tl.max(_lower_bound(sorted_key, tl.zeros((BLOCK,), tl.int32), tl.where(lanes == 0, num_entries, 0),
                                    past_all, search_steps), axis=0)

    # Lanes as entries: the first entry of bucket b writes its row (b <= bound: the offset of
    # bucket `bound` ends the last real one when the bound overflows).
    entry_ok = lane < num_entries
    key = tl.load(sorted_key + lane, mask=entry_ok, other=past_all)
    previous = tl.load(sorted_key + lane - 1, mask=entry_ok & (lane > 0), other=-1)
    first = entry_ok & (key != previous) & (key < past_all)
    bucket = tl.load(entry_bucket + lane, mask=first, other=1) - 1
    tl.store(bucket_ptr + bucket, lane, mask=first & (bucket <= bucket_bound))
    real = first & (bucket < bucket_bound)
    flat = tl.load(order + lane, mask=real, other=0)
    head = flat // (num_queries * TOPK)
    token = (flat // TOPK) % num_queries
    block = tl.load(block_indices + head * stride_head + token * stride_token + (flat % TOPK) * stride_slot,
                    mask=real, other=0)
    end = _lower_bound(sorted_key, tl.where(first, lane + 1, num_entries), num_entries + tl.zeros((BLOCK,), tl.int32),
                       key + 1, search_steps)
    tl.store(bucket_head + bucket, (key // key_stride).to(tl.int32), mask=real)
    tl.store(bucket_key_row + bucket, (key % key_stride).to(tl.int32), mask=real)
    tl.store(bucket_block + bucket, block, mask=real)
    tl.store(items_per_bucket + bucket, (end - lane + entries_per_item - 1) // entries_per_item, mask=real)

    # Lanes as bucket rows: the rows past the real buckets are empty.
    unused = (lane >= total) & (lane <= bucket_bound)
    tl.store(bucket_ptr + lane, num_valid + tl.zeros((BLOCK,), tl.int32), mask=unused)
    unused &= lane < bucket_bound
    zero = tl.zeros((BLOCK,), tl.int32)
    tl.store(bucket_head + lane, zero, mask=unused)
    tl.store(bucket_key_row + lane, zero, mask=unused)
    tl.store(bucket_block + lane, zero, mask=unused)
    tl.store(items_per_bucket + lane, zero, mask=unused)
    tl.store(num_buckets + lane, tl.minimum(total, bucket_bound) + zero, mask=lane == 0)


@triton.jit
def msa_plan_item_tables_kernel(
    item_ptr, items_per_bucket, bucket_ptr, item_bucket, item_start, item_end, num_items,
    item_bound, bucket_bound, search_steps, entries_per_item,
    BLOCK: tl.constexpr,
):
    item = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = item < item_bound
    # torch.searchsorted(item_ptr, item, right=True), clamped to the last bucket: item rows past
    # the real ones land on it, past its end, and come out empty.
    low = tl.zeros((BLOCK,), tl.int32)
    high = tl.zeros((BLOCK,), tl.int32) + bucket_bound
    for _ in range(search_steps):
        active = low < high
        middle = low + ((high - low) >> 1)
        right = tl.load(item_ptr + middle, mask=active & ok, other=0) > item
        high = tl.where(active & right, middle, high)
        low = tl.where(active & ~right, middle + 1, low)
    bucket = tl.minimum(low, bucket_bound - 1)
    rank = item - (tl.load(item_ptr + bucket, mask=ok, other=0) - tl.load(items_per_bucket + bucket, mask=ok, other=0))
    start = tl.load(bucket_ptr + bucket, mask=ok, other=0) + rank * entries_per_item
    end = tl.load(bucket_ptr + bucket + 1, mask=ok, other=0)
    tl.store(item_bucket + item, bucket, mask=ok)
    tl.store(item_start + item, tl.minimum(start, end), mask=ok)
    tl.store(item_end + item, tl.minimum(start + entries_per_item, end), mask=ok)
    tl.store(num_items + item, tl.load(item_ptr + bucket_bound - 1) + tl.zeros((BLOCK,), tl.int32), mask=item == 0)


def plan(block_indices, documents, num_keys, block_size, entries_per_item) -> torch.Tensor:
    """`msa::plan`: the plan of `block_indices`, the tables of `build_schedule` packed.

    Args:
        block_indices: int32 `[Hkv, Tq, topk]`.
        documents: the documents (`torch_msa/documents.py`), on the same device.
        num_keys: `Tk`; block_size: keys per block; entries_per_item: the most entries per item.

    Returns:
        int32 `[plan_numel(...)]` on the device of `block_indices`.
    """
    num_kv_heads, num_queries, topk = block_indices.shape
    num_segments = documents.cu_seqlens_q.numel() - 1
    num_docs = documents.num_documents
    num_entries = block_indices.numel()
    if num_entries == 0:
        return pack(build_schedule(block_indices, documents, num_keys, block_size, entries_per_item))
    # The kernels read the boundaries as dense arrays (block_indices through its strides).
    documents = documents.map_tensors(torch.Tensor.contiguous)
    cu_seqlens_q, cu_seqlens_k = documents.cu_seqlens_q, documents.cu_seqlens_k
    fragments = documents.has_fragments
    device = block_indices.device
    bucket_bound = max_buckets(num_kv_heads, num_keys, num_docs, block_size)
    item_bound = max_items(num_entries, bucket_bound, entries_per_item)
    sizes = section_sizes(block_indices.shape, num_keys, num_docs, block_size, item_bound)
    packed = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    (entry_query, bucket_ptr, bucket_head, bucket_key_row, bucket_block,
     item_bucket, item_start, item_end, position, num_buckets, num_items) = packed.split_with_sizes(sizes)
    # Scratch: bucket starts per entry, then items per bucket.
    scratch = torch.empty(num_entries + bucket_bound, dtype=torch.int32, device=device)
    starts, items_per_bucket = scratch.split_with_sizes((num_entries, bucket_bound))

    key_stride = max(1, num_keys)
    past_all = num_kv_heads * key_stride
    strides = block_indices.stride()
    # 32-bit keys sort faster, in the same stable order.
    key_dtype = torch.int32 if past_all < 2**31 - 1 else torch.int64
    bucket_key = torch.empty(num_entries, dtype=key_dtype, device=device)
    topk_p2 = triton.next_power_of_2(topk)
    tokens = max(1, _SLOT_TILE // topk_p2)
    msa_plan_entry_keys_kernel[(triton.cdiv(num_queries, tokens), num_kv_heads)](
        block_indices, cu_seqlens_q, cu_seqlens_k,
        documents.fragment_documents if fragments else cu_seqlens_q, documents.fragment_starts if fragments else cu_seqlens_q,
        bucket_key, position,
        num_queries, num_keys, num_segments, num_docs, binary_search_steps(num_segments), block_size, key_stride, past_all,
        *strides,
        TOPK=topk, TOPK_P2=topk_p2, TOKENS=tokens, FRAGMENTS=fragments,
    )
    sorted_key, order = torch.sort(bucket_key, stable=True)
    entry_grid = (triton.cdiv(num_entries, _ENTRIES),)
    msa_plan_bucket_starts_kernel[entry_grid](
        sorted_key, order, entry_query, starts, num_entries, num_queries * topk, past_all, BLOCK=_ENTRIES,
    )
    entry_bucket = torch.cumsum(starts, 0, dtype=torch.int32)
    msa_plan_bucket_tables_kernel[(triton.cdiv(max(num_entries, bucket_bound + 1), _ENTRIES),)](
        sorted_key, order, entry_bucket, block_indices,
        bucket_ptr, bucket_head, bucket_key_row, bucket_block, items_per_bucket, num_buckets,
        num_entries, bucket_bound, binary_search_steps(num_entries), key_stride, past_all, entries_per_item,
        num_queries, *strides,
        TOPK=topk, BLOCK=_ENTRIES,
    )
    item_ptr = torch.cumsum(items_per_bucket, 0, dtype=torch.int32)
    msa_plan_item_tables_kernel[(triton.cdiv(item_bound, _ENTRIES),)](
        item_ptr, items_per_bucket, bucket_ptr, item_bucket, item_start, item_end, num_items,
        item_bound, bucket_bound, binary_search_steps(bucket_bound), entries_per_item,
        BLOCK=_ENTRIES,
    )
    return packed


def plan_schedule(block_indices, documents: Documents, num_keys, block_size, entries_per_item) -> Schedule:
    """The schedule of a new plan with items of `entries_per_item` entries, built on the device by
    `plan`; the arguments as `build_schedule`'s."""
    built = plan(block_indices, documents, num_keys, block_size, entries_per_item)
    return unpack(built, block_indices, num_keys, documents.num_documents, block_size)


def schedule_for(block_indices, documents: Documents, num_keys, block_size, num_heads, plan=None) -> Schedule:
    """The KV-outer schedule a kernel walks: `plan`'s, or (`None`) a new plan's with the public
    API's items (`entries_per_item(num_heads, Hkv)`).

    Args:
        block_indices: int32 `[Hkv, Tq, topk]`; documents, num_keys, block_size: as for `build_schedule`.
        num_heads: the query heads `Hq` that size the items of a new plan.
        plan: from `msa::plan` for these arguments (any item size), a `Schedule` (unpacked, or a
            query window's, `torch_msa.plan.schedule.query_windows`), or None.

    Raises:
        ValueError: a plan tensor whose length does not fit these arguments (`unpack`).
    """
    if isinstance(plan, Schedule):
        return plan
    if plan is None:
        return plan_schedule(block_indices, documents, num_keys, block_size,
                             entries_per_item(num_heads, block_indices.shape[0]))
    return unpack(plan, block_indices, num_keys, documents.num_documents, block_size)


@triton.jit
def msa_plan_query_groups_kernel(
    block_indices, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
    token_group, group_start, group_end, group_union, group_blocks,
    num_queries, num_keys, num_segments, num_docs, search_steps, block_size, num_ids,
    stride_head, stride_token, stride_slot,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, GROUP: tl.constexpr, MOST: tl.constexpr,
    COST_NUMERATOR: tl.constexpr, COST_DENOMINATOR: tl.constexpr, FRAGMENTS: tl.constexpr,
):
    group = tl.program_id(0)
    head = tl.program_id(1)
    # The group's segment: the probes of torch.searchsorted(keys, group, right=True) - 1 over the
    # segments' first ids `max(c_s, 0) // GROUP + s`.
    low = tl.zeros((), tl.int32)
    high = low + num_segments
    for _ in range(search_steps):
        active = low < high
        middle = low + ((high - low) >> 1)
        first_id = tl.maximum(tl.load(cu_seqlens_q + middle, mask=active, other=0), 0) // GROUP + middle
        right = first_id > group
        high = tl.where(active & right, middle, high)
        low = tl.where(active & ~right, middle + 1, low)
    has_segment = low > 0
    segment = tl.maximum(low - 1, 0)
    first = tl.load(cu_seqlens_q + segment, mask=has_segment, other=0).to(tl.int64)
    last = tl.load(cu_seqlens_q + segment + 1, mask=has_segment, other=0).to(tl.int64)
    start = first + (group - (tl.maximum(first, 0) // GROUP + segment)) * GROUP
    end = tl.minimum(tl.minimum(start + GROUP, last), num_queries)

    # Lanes (query of the group, slot); the group is kept when each of its queries lies in its
    # segment and sees a key.
    lanes = tl.arange(0, GROUP * TOPK_P2)
    member_index = lanes // TOPK_P2
    slot = lanes % TOPK_P2
    token = start + member_index
    in_group = (token < end) & (token >= 0)
    pos, _ = locate_tokens(token, in_group, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
                           num_keys, num_segments, num_docs, search_steps, FRAGMENTS)
    token_segment, _ = find_segments(token, in_group, cu_seqlens_q, num_segments, search_steps)
    strangers = tl.sum((in_group & ((token_segment != segment) | (pos < 0))).to(tl.int32), axis=0)
    kept = has_segment & (start >= 0) & (start < end) & (strangers == 0)

    slot_ok = in_group & kept & (slot < TOPK)
    row = block_indices + head.to(tl.int64) * stride_head + token * stride_token
    ids = tl.load(row + slot * stride_slot, mask=slot_ok, other=-1)
    last_block = tl.where(pos >= 0, pos // block_size, -1)
    valid = slot_ok & (ids >= 0) & (ids.to(tl.int64) <= last_block)
    for earlier in range(TOPK):
        other = tl.load(row + earlier * stride_slot, mask=slot_ok, other=-1)
        valid &= ~((ids == other) & (slot > earlier))

    # Per lane: the group's queries that select its block, and whether an earlier one does.
    slots = tl.arange(0, TOPK_P2)
    count = tl.zeros((GROUP * TOPK_P2,), tl.int32)
    earlier_query = tl.zeros((GROUP * TOPK_P2,), tl.int1)
    for member in range(GROUP):
        member_token = start + member
        member_ok = kept & (member_token < end)
        member_last = tl.max(tl.where(member_index == member, last_block, -1), axis=0)
        chosen = tl.load(block_indices + head.to(tl.int64) * stride_head + member_token * stride_token
                         + slots * stride_slot, mask=member_ok & (slots < TOPK), other=-1)
        chosen_ok = (chosen >= 0) & (chosen.to(tl.int64) <= member_last)
        hit = tl.max(((ids[:, None] == chosen[None, :]) & chosen_ok[None, :]).to(tl.int32), axis=1)
        count += hit
        earlier_query |= (hit > 0) & (member_index > member)
    first_choice = valid & ~earlier_query
    union = tl.sum(first_choice.to(tl.int32), axis=0)
    entries = tl.sum(valid.to(tl.int32), axis=0)
    whole = union * GROUP * COST_NUMERATOR <= entries * COST_DENOMINATOR
    q_outer = first_choice & (whole | (count * COST_DENOMINATOR >= GROUP * COST_NUMERATOR))
    blocks = tl.sort(tl.where(q_outer, ids, 2147483647))

    pair = head.to(tl.int64) * num_ids + group
    tl.store(group_blocks + pair * MOST + lanes, tl.where(blocks == 2147483647, -1, blocks), mask=lanes < MOST)
    tl.store(group_union + pair, tl.where(kept, union, 0))
    if head == 0:
        tl.store(group_start + group, tl.where(kept, start, 0).to(tl.int32))
        tl.store(group_end + group, tl.where(kept, end, 0).to(tl.int32))
        tl.store(token_group + token, group + tl.zeros_like(slot), mask=in_group & kept & (slot == 0))


def query_groups(block_indices, documents: Documents, num_keys, block_size, tokens_per_group) -> QueryGroups:
    """`torch_msa.plan.groups.build_query_groups` (same arguments, same tables) in two launches."""
    num_kv_heads, num_queries, topk = block_indices.shape
    if block_indices.numel() == 0:
        return build_query_groups(block_indices, documents, num_keys, block_size, tokens_per_group)
    documents = documents.map_tensors(torch.Tensor.contiguous)
    cu_seqlens_q, cu_seqlens_k = documents.cu_seqlens_q, documents.cu_seqlens_k
    fragments = documents.has_fragments
    device = block_indices.device
    num_segments = cu_seqlens_q.numel() - 1
    num_ids = group_ids(num_queries, num_segments, tokens_per_group)
    most = max_group_blocks(topk, tokens_per_group)
    token_group = torch.full((num_queries,), -1, dtype=torch.int32, device=device)
    bounds = torch.empty(2 * num_ids, dtype=torch.int32, device=device)
    group_union = torch.empty((num_kv_heads, num_ids), dtype=torch.int32, device=device)
    group_blocks = torch.empty((num_kv_heads, num_ids, most), dtype=torch.int32, device=device)
    group_start, group_end = bounds.split_with_sizes((num_ids, num_ids))
    msa_plan_query_groups_kernel[(num_ids, num_kv_heads)](
        block_indices, cu_seqlens_q, cu_seqlens_k,
        documents.fragment_documents if fragments else cu_seqlens_q, documents.fragment_starts if fragments else cu_seqlens_q,
        token_group, group_start, group_end, group_union, group_blocks,
        num_queries, num_keys, num_segments, documents.num_documents, binary_search_steps(num_segments), block_size,
        num_ids, *block_indices.stride(),
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), GROUP=tokens_per_group, MOST=most,
        COST_NUMERATOR=Q_OUTER_COST[0], COST_DENOMINATOR=Q_OUTER_COST[1], FRAGMENTS=fragments,
    )
    return QueryGroups(token_group, group_start, group_end, group_union, group_blocks)


@triton.jit
def msa_bucket_key_count_kernel(bucket_key_row, cu_seqlens_k, key_count, num_buckets, num_bounds, search_steps,
                                block_size, BLOCK: tl.constexpr):
    bucket = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = bucket < num_buckets
    row = tl.load(bucket_key_row + bucket, mask=ok, other=0).to(tl.int64)
    # torch.searchsorted(cu_seqlens_k, row, right=True), clamped to the last boundary.
    low = tl.zeros((BLOCK,), tl.int32)
    high = tl.zeros((BLOCK,), tl.int32) + num_bounds
    for _ in range(search_steps):
        active = low < high
        middle = low + ((high - low) >> 1)
        right = tl.load(cu_seqlens_k + middle, mask=active & ok, other=0).to(tl.int64) > row
        high = tl.where(active & right, middle, high)
        low = tl.where(active & ~right, middle + 1, low)
    doc_end = tl.load(cu_seqlens_k + tl.minimum(low, num_bounds - 1), mask=ok, other=0).to(tl.int64)
    tl.store(key_count + bucket, tl.minimum(tl.maximum(doc_end - row, 0), block_size).to(tl.int32), mask=ok)


def bucket_key_count(bucket_key_row: torch.Tensor, cu_seqlens_k: torch.Tensor, block_size: int) -> torch.Tensor:
    """`torch_msa.plan.schedule.bucket_key_count` (same arguments and result) in one launch."""
    key_count = torch.empty_like(bucket_key_row)
    num_buckets, num_bounds = bucket_key_row.numel(), cu_seqlens_k.numel()
    if num_buckets == 0:
        return key_count
    cu_seqlens_k = cu_seqlens_k if cu_seqlens_k.is_contiguous() else cu_seqlens_k.contiguous()
    msa_bucket_key_count_kernel[(triton.cdiv(num_buckets, _ENTRIES),)](
        bucket_key_row, cu_seqlens_k, key_count, num_buckets, num_bounds, binary_search_steps(num_bounds), block_size,
        BLOCK=_ENTRIES,
    )
    return key_count
