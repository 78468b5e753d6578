"""`msa::plan` in Triton: the tables of `torch_msa.plan.schedule.build_schedule` in five launches
(steps: `torch_msa/plan/README.md`), `restrict` in four, the query groups of `torch_msa.plan.groups`
in four, and `bucket_key_count` in one.
"""

import torch
import triton
import triton.language as tl

from ..documents import Documents
from ..triton_utils.common import binary_search_steps, find_segments, locate_tokens, search_right
from ..triton_utils.launch import cached_launches
from ..uninitialized import uninitialized
from .groups import Q_OUTER_COST, QueryGroups, build_query_groups, group_ids, max_group_blocks
from .schedule import (
    Schedule,
    build_schedule,
    entries_per_item,
    max_buckets,
    max_items,
    max_key_blocks,
    pack,
    section_sizes,
    unpack,
)

_ENTRIES = 1024  # entries per program of the 1-D kernels
_CHUNKS = 1024  # most query chunks per KV head of the counting and placing kernels
_CHUNK_QUERIES = 32  # fewest queries per chunk: the scratch is chunks x key blocks
_ROW_LANES = 128  # (query, slot) lanes of their tiles
_COLUMN_SLOTS = 32  # slots per program of the column scan
_COLUMN_CHUNKS = 128  # chunks per step of the column scan
_SORTED_LANES_PER_WARP = 128  # (query, slot) lanes a warp of the groups kernel sorts: 8 x 16 at M3
_UNIT_CHUNK = 4096  # unit ids per step of the one-program unit list


@triton.jit
def _repeats_an_earlier_slot(ids, TOPK: tl.constexpr, TOPK_P2: tl.constexpr):
    """Whether each id of `ids` `[rows, TOPK_P2]` (one row per query) repeats the id of an earlier
    slot of its row: a repeated id counts at its first slot only. Compared in registers."""
    slots = tl.arange(0, TOPK_P2)[None, :]
    repeated = tl.zeros(ids.shape, tl.int1)
    for earlier in tl.static_range(TOPK):
        other = tl.sum(tl.where(slots == earlier, ids, 0), axis=1)
        repeated |= (ids == other[:, None]) & (slots > earlier)
    return repeated


@triton.jit
def _valid_selections(block_indices, head, token, slot_index, loaded, pos, block_size, stride_head, stride_token,
                      stride_slot, TOPK: tl.constexpr, TOPK_P2: tl.constexpr):
    """Per lane of `[queries * TOPK_P2]` lanes, query-major (lane `q * TOPK_P2 + slot_index` is
    slot `slot_index` of query `q`): `(ids, last_block, valid)`, int32 the selected block (-1
    where not `loaded`), int64 the last block the query's position `pos` sees (-1 for an unplaced
    query) and whether the entry is valid (in range, not a repeat of an earlier slot). `loaded`
    marks the lanes to read, none with `slot_index >= TOPK`."""
    row = block_indices + head.to(tl.int64) * stride_head + token * stride_token
    ids = tl.load(row + slot_index * stride_slot, mask=loaded, other=-1)
    last_block = tl.where(pos >= 0, pos // block_size, -1)
    valid = loaded & (ids >= 0) & (ids.to(tl.int64) <= last_block)
    repeated = _repeats_an_earlier_slot(tl.reshape(ids, (ids.shape[0] // TOPK_P2, TOPK_P2)), TOPK, TOPK_P2)
    return ids, last_block, valid & ~tl.reshape(repeated, ids.shape)


@triton.jit
def _tile_entries(block_indices, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts, first_token,
                  end_token, slot_index, num_keys, num_segments, num_docs, search_steps, block_size, slots_per_head,
                  head, stride_head, stride_token, stride_slot,
                  TOPK: tl.constexpr, TOPK_P2: tl.constexpr, TOKENS: tl.constexpr, FRAGMENTS: tl.constexpr):
    """The entries of queries `[first_token, min(first_token + TOKENS, end_token))` of KV head
    `head`, as lanes `[TOKENS * TOPK_P2]`, query-major (`slot_index`: `lane % TOPK_P2`), so that
    lane order is the plan's order of a query's entries.

    Returns per lane `(token, position, key_start)` int64, `ids` int32, `(entry, valid)` and
    `slot` int32: `entry` marks the lanes that are entries, `valid` the valid ones; `slot` is the
    bucket slot of a valid entry (`torch_msa.plan.schedule.Schedule`) and `slots_per_head` for an
    invalid one.
    """
    token = first_token + (tl.arange(0, TOKENS * TOPK_P2) // TOPK_P2).to(tl.int64)
    token_ok = token < end_token
    pos, key_start, doc = locate_tokens(token, token_ok, cu_seqlens_q, cu_seqlens_k, fragment_documents,
                                        fragment_starts, num_keys, num_segments, num_docs, search_steps, FRAGMENTS)
    entry = token_ok & (slot_index < TOPK)
    ids, _, valid = _valid_selections(block_indices, head, token, slot_index, entry, pos, block_size, stride_head,
                                      stride_token, stride_slot, TOPK, TOPK_P2)
    slot = tl.where(valid, key_start // block_size + doc + ids, slots_per_head).to(tl.int32)
    return token, pos, key_start, ids, entry, valid, slot


@triton.jit
def _tile_ranks(slot, valid, entry, TOKENS: tl.constexpr, TOPK_P2: tl.constexpr):
    """Per entry lane of `_tile_entries` (other lanes get no meaning): how many earlier entries of
    the tile share its slot (`rank`, int32), and whether none later does (`last`). A query chooses
    a valid slot at most once, so a valid entry's rank counts the earlier queries that chose its
    block, one query at a time (in registers: a lane-by-lane comparison would hold the tile
    squared); the invalid entries, which share one slot, rank in lane order."""
    invalid = (entry & ~valid).to(tl.int32)
    rank = tl.cumsum(invalid, 0) - invalid
    last = (invalid > 0) & (rank == tl.sum(invalid, axis=0) - 1)
    chosen = tl.reshape(tl.where(valid, slot, -1), (TOKENS, TOPK_P2))
    query = tl.arange(0, TOKENS)[:, None]
    earlier_queries = tl.zeros((TOKENS, TOPK_P2), tl.int32)
    later_queries = tl.zeros((TOKENS, TOPK_P2), tl.int32)
    for other_query in range(TOKENS):
        other_slots = tl.max(tl.where(query == other_query, chosen, -1), axis=0)
        hit = tl.max((chosen[:, :, None] == other_slots[None, None, :]).to(tl.int32), axis=2)
        earlier_queries += tl.where(query > other_query, hit, 0)
        later_queries += tl.where(query < other_query, hit, 0)
    rank = tl.where(valid, tl.reshape(earlier_queries, slot.shape), rank)
    last = tl.where(valid, tl.reshape(later_queries, slot.shape) == 0, last)
    return rank, last


@cached_launches
@triton.jit
def msa_plan_place_kernel(
    block_indices, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts, offsets, slot_start,
    entry_query, slot_bucket, bucket_ptr, bucket_key_row, bucket_block, position,
    num_queries, num_keys, num_segments, num_docs, search_steps, block_size, slots_per_head, tokens_per_chunk,
    num_chunks, bucket_bound, stride_head, stride_token, stride_slot,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, TOKENS: tl.constexpr, FRAGMENTS: tl.constexpr,
    PLACE: tl.constexpr, ZERO_LANES: tl.constexpr,
):
    """One (query chunk, KV head) program. Counting (`PLACE` false): its row of `offsets` [slots
    + 1] ends up holding the entries of each slot in the chunk (the last column the invalid ones),
    and head 0 writes `position`. Placing: the row holds how many entries of each slot the earlier
    chunks have (`msa_plan_column_scan_kernel`) and `slot_start` where the slot's entries start
    (`msa_plan_scan_kernel`); each entry is written at its place, the first entry of each bucket
    writing its key row and block."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    row = offsets + (head * num_chunks + chunk).to(tl.int64) * (slots_per_head + 1)
    if not PLACE:
        for first in range(0, slots_per_head + 1, ZERO_LANES):
            lanes = first + tl.arange(0, ZERO_LANES)
            tl.store(row + lanes, tl.zeros((ZERO_LANES,), tl.int32), mask=lanes <= slots_per_head)
        tl.debug_barrier()
    slot_index = tl.arange(0, TOKENS * TOPK_P2) % TOPK_P2
    first_query = chunk.to(tl.int64) * tokens_per_chunk
    end_query = tl.minimum(first_query + tokens_per_chunk, num_queries)
    for first_token in range(first_query, end_query, TOKENS):
        token, pos, key_start, ids, entry, valid, slot = _tile_entries(
            block_indices, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts, first_token, end_query,
            slot_index, num_keys, num_segments, num_docs, search_steps, block_size, slots_per_head, head,
            stride_head, stride_token, stride_slot, TOPK, TOPK_P2, TOKENS, FRAGMENTS)
        if PLACE:
            # The row's running counts are read and moved on per tile: the tiles go in order.
            rank, last = _tile_ranks(slot, valid, entry, TOKENS, TOPK_P2)
            start = tl.load(row + slot, mask=entry, other=0)
            destination = tl.load(slot_start + head * (slots_per_head + 1) + slot, mask=entry, other=0) + start + rank
            tl.store(entry_query + destination, (token * TOPK + slot_index).to(tl.int32), mask=entry)
            bucket = tl.load(slot_bucket + head * slots_per_head + slot, mask=valid, other=0)
            real = valid & (bucket < bucket_bound)
            first = real & (destination == tl.load(bucket_ptr + bucket, mask=real, other=-1))
            tl.store(bucket_block + bucket, ids, mask=first)
            tl.store(bucket_key_row + bucket, (key_start + ids.to(tl.int64) * block_size).to(tl.int32), mask=first)
            tl.debug_barrier()  # every lane has read its slot's start before any moves it on
            tl.store(row + slot, start + rank + 1, mask=entry & last)
            tl.debug_barrier()
        else:
            # Counts commute, so the tiles' atomic adds need no order.
            tl.atomic_add(row + slot, tl.full(slot.shape, 1, tl.int32), mask=entry, sem="relaxed")
            tl.store(position + token, pos.to(tl.int32), mask=entry & (slot_index == 0) & (head == 0))


@cached_launches
@triton.jit
def msa_plan_column_scan_kernel(offsets, slot_start, num_chunks, width, SLOTS: tl.constexpr, CHUNKS: tl.constexpr):
    """One (slot range, KV head) program: turns each of its columns of `offsets` (counts per
    chunk) into how many entries of the slot the earlier chunks have, and writes the column's
    total to `slot_start`."""
    head = tl.program_id(1)
    slots = tl.program_id(0) * SLOTS + tl.arange(0, SLOTS)
    slot_ok = slots < width
    totals = tl.zeros((SLOTS,), tl.int32)
    for first in range(0, num_chunks, CHUNKS):
        chunks = first + tl.arange(0, CHUNKS)
        cells = (offsets + (head * num_chunks + chunks).to(tl.int64)[:, None] * width + slots[None, :])
        ok = (chunks < num_chunks)[:, None] & slot_ok[None, :]
        counts = tl.load(cells, mask=ok, other=0)
        tl.store(cells, totals[None, :] + tl.cumsum(counts, 0) - counts, mask=ok)
        totals += tl.sum(counts, axis=0)
    tl.store(slot_start + head * width + slots, totals, mask=slot_ok)


@cached_launches
@triton.jit
def msa_plan_scan_kernel(
    slot_start, slot_bucket, bucket_ptr, bucket_head, bucket_key_row, bucket_block, items_per_bucket, item_ptr,
    num_buckets, num_kv_heads, slots_per_head, bucket_bound, entries_per_item, ROWS: tl.constexpr,
):
    """One program: turns each slot's entry count in `slot_start` [Hkv, slots + 1] into where its
    entries start (slots in order, the invalid entries after every valid one, KV head after KV
    head), numbers the used slots as buckets and writes `bucket_ptr`, `bucket_head`, the items per
    bucket and their running sum; fills the unused bucket rows and `num_buckets`."""
    width = slots_per_head + 1
    entries = tl.zeros((), tl.int32)
    buckets = tl.zeros((), tl.int32)
    items = tl.zeros((), tl.int32)
    for head in range(num_kv_heads):
        for first in range(0, slots_per_head, ROWS):
            slots = first + tl.arange(0, ROWS)
            ok = slots < slots_per_head
            totals = tl.load(slot_start + head * width + slots, mask=ok, other=0)
            starts = entries + tl.cumsum(totals, 0) - totals
            tl.store(slot_start + head * width + slots, starts, mask=ok)
            used = totals > 0
            bucket = buckets + tl.cumsum(used.to(tl.int32), 0) - 1
            tl.store(slot_bucket + head * slots_per_head + slots, bucket, mask=ok)
            tl.store(bucket_ptr + bucket, starts, mask=used & (bucket <= bucket_bound))
            real = used & (bucket < bucket_bound)
            bucket_items = tl.where(real, (totals + entries_per_item - 1) // entries_per_item, 0)
            tl.store(bucket_head + bucket, head + tl.zeros_like(bucket), mask=real)
            tl.store(items_per_bucket + bucket, bucket_items, mask=real)
            tl.store(item_ptr + bucket, items + tl.cumsum(bucket_items, 0), mask=real)
            entries += tl.sum(totals, axis=0)
            buckets += tl.sum(used.to(tl.int32), axis=0)
            items += tl.sum(bucket_items, axis=0)
    # The invalid entries, after every valid one, KV head after KV head.
    invalid_start = entries
    for first in range(0, num_kv_heads, ROWS):
        heads = first + tl.arange(0, ROWS)
        heads_ok = heads < num_kv_heads
        invalid = tl.load(slot_start + heads * width + slots_per_head, mask=heads_ok, other=0)
        tl.store(slot_start + heads * width + slots_per_head, invalid_start + tl.cumsum(invalid, 0) - invalid,
                 mask=heads_ok)
        invalid_start += tl.sum(invalid, axis=0)
    # Rows past the real buckets are empty; bucket `bound` ends the last real one.
    for first in range(0, bucket_bound + 1, ROWS):
        lanes = first + tl.arange(0, ROWS)
        tl.store(bucket_ptr + lanes, entries + tl.zeros_like(lanes), mask=(lanes >= buckets) & (lanes <= bucket_bound))
        unused = (lanes >= buckets) & (lanes < bucket_bound)
        zero = tl.zeros_like(lanes)
        tl.store(bucket_head + lanes, zero, mask=unused)
        tl.store(bucket_key_row + lanes, zero, mask=unused)
        tl.store(bucket_block + lanes, zero, mask=unused)
        tl.store(items_per_bucket + lanes, zero, mask=unused)
        tl.store(item_ptr + lanes, items + zero, mask=unused)
    tl.store(num_buckets, tl.minimum(buckets, bucket_bound))


@triton.jit
def _bucket_items(bucket_start, bucket_end, items_per_bucket, item_ptr, buckets, ok, items, entries_per_item):
    """Stores the items of buckets `buckets` (entries `[bucket_start, bucket_end)` each) and their
    running sum from `items`; returns the sum past them."""
    bucket_items = (bucket_end - bucket_start + entries_per_item - 1) // entries_per_item
    tl.store(items_per_bucket + buckets, bucket_items, mask=ok)
    tl.store(item_ptr + buckets, items + tl.cumsum(bucket_items, 0), mask=ok)
    return items + tl.sum(tl.where(ok, bucket_items, 0), axis=0)


@cached_launches
@triton.jit
def msa_plan_item_counts_kernel(bucket_start, bucket_end, items_per_bucket, item_ptr, num_buckets, entries_per_item,
                                ROWS: tl.constexpr):
    """One program: the items of each bucket whose entries are `[bucket_start[b], bucket_end[b])`,
    and their running sum."""
    items = tl.zeros((), tl.int32)
    for first in range(0, num_buckets, ROWS):
        buckets = first + tl.arange(0, ROWS)
        ok = buckets < num_buckets
        items = _bucket_items(tl.load(bucket_start + buckets, mask=ok, other=0),
                              tl.load(bucket_end + buckets, mask=ok, other=0),
                              items_per_bucket, item_ptr, buckets, ok, items, entries_per_item)


@cached_launches
@triton.jit
def msa_plan_item_tables_kernel(
    item_ptr, items_per_bucket, bucket_start, bucket_end, item_bucket, item_start, item_end, num_items,
    item_bound, bucket_bound, search_steps, entries_per_item,
    BLOCK: tl.constexpr,
):
    item = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = item < item_bound
    # The item's bucket, clamped to the last: item rows past the real ones land on it, past its
    # end, and come out empty.
    bucket = tl.minimum(search_right(item_ptr, bucket_bound, item, ok, search_steps), bucket_bound - 1)
    rank = item - (tl.load(item_ptr + bucket, mask=ok, other=0) - tl.load(items_per_bucket + bucket, mask=ok, other=0))
    start = tl.load(bucket_start + bucket, mask=ok, other=0) + rank * entries_per_item
    end = tl.load(bucket_end + bucket, mask=ok, other=0)
    tl.store(item_bucket + item, bucket, mask=ok)
    tl.store(item_start + item, tl.minimum(start, end), mask=ok)
    tl.store(item_end + item, tl.minimum(start + entries_per_item, end), mask=ok)
    tl.store(num_items + item, tl.load(item_ptr + bucket_bound - 1) + tl.zeros((BLOCK,), tl.int32), mask=item == 0)


def tile_shape(topk: int) -> tuple[int, int]:
    """`(TOKENS, TOPK_P2)` of the counting and placing passes at `topk`: the queries of a tile and
    the slots padded to a power of two, `TOKENS * TOPK_P2 = _ROW_LANES` lanes; past `_ROW_LANES`
    slots a tile is one query of `TOPK_P2` lanes."""
    topk_p2 = triton.next_power_of_2(topk)
    return max(1, _ROW_LANES // topk_p2), topk_p2


def plan(block_indices, documents, num_keys, block_size, entries_per_item) -> torch.Tensor:
    """`msa::plan`: the plan of `block_indices`, the tables of `build_schedule` packed, in five
    launches (steps: `torch_msa/plan/README.md`).

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

    tokens, topk_p2 = tile_shape(topk)
    tokens_per_chunk = tokens * triton.cdiv(max(triton.cdiv(num_queries, _CHUNKS), _CHUNK_QUERIES), tokens)
    num_chunks = triton.cdiv(num_queries, tokens_per_chunk)
    slots_per_head = max(1, max_key_blocks(num_keys, num_docs, block_size))
    width = slots_per_head + 1
    # Scratch: each chunk's counts per slot (then the earlier chunks' counts), each slot's count
    # (then start), each slot's bucket, the items per bucket and their running sum.
    scratch_sizes = (num_kv_heads * num_chunks * width, num_kv_heads * width, num_kv_heads * slots_per_head,
                     bucket_bound, bucket_bound)
    offsets, slot_start, slot_bucket, items_per_bucket, item_ptr = uninitialized(
        sum(scratch_sizes), dtype=torch.int32, device=device).split_with_sizes(scratch_sizes)

    chunk_grid = (num_chunks, num_kv_heads)
    located = (block_indices, cu_seqlens_q, cu_seqlens_k,
               documents.fragment_documents if fragments else cu_seqlens_q,
               documents.fragment_starts if fragments else cu_seqlens_q)
    shapes = (num_queries, num_keys, num_segments, num_docs, binary_search_steps(num_segments), block_size,
              slots_per_head, tokens_per_chunk, num_chunks, bucket_bound, *block_indices.stride())
    constants = {"TOPK": topk, "TOPK_P2": topk_p2, "TOKENS": tokens, "FRAGMENTS": fragments, "ZERO_LANES": 1024}
    tables = (offsets, slot_start, entry_query, slot_bucket, bucket_ptr, bucket_key_row, bucket_block, position)
    msa_plan_place_kernel[chunk_grid](*located, *tables, *shapes, PLACE=False, **constants)
    msa_plan_column_scan_kernel[(triton.cdiv(width, _COLUMN_SLOTS), num_kv_heads)](
        offsets, slot_start, num_chunks, width, SLOTS=_COLUMN_SLOTS, CHUNKS=_COLUMN_CHUNKS)
    msa_plan_scan_kernel[(1,)](
        slot_start, slot_bucket, bucket_ptr, bucket_head, bucket_key_row, bucket_block, items_per_bucket, item_ptr,
        num_buckets, num_kv_heads, slots_per_head, bucket_bound, entries_per_item, ROWS=1024,
    )
    msa_plan_place_kernel[chunk_grid](*located, *tables, *shapes, PLACE=True, **constants)
    msa_plan_item_tables_kernel[(triton.cdiv(item_bound, _ENTRIES),)](
        item_ptr, items_per_bucket, bucket_ptr, bucket_ptr[1:], item_bucket, item_start, item_end, num_items,
        item_bound, bucket_bound, binary_search_steps(bucket_bound), entries_per_item,
        BLOCK=_ENTRIES,
    )
    return packed


def _item_tables(item_ptr, items_per_bucket, bucket_start, bucket_end, item_bucket, item_start, item_end, num_items,
                 item_bound, num_buckets, entries_per_item) -> None:
    """Launches `msa_plan_item_tables_kernel` over `item_bound` item rows of `num_buckets` buckets."""
    msa_plan_item_tables_kernel[(triton.cdiv(item_bound, _ENTRIES),)](
        item_ptr, items_per_bucket, bucket_start, bucket_end, item_bucket, item_start, item_end, num_items,
        item_bound, num_buckets, binary_search_steps(num_buckets), entries_per_item,
        BLOCK=_ENTRIES,
    )


def with_items(schedule: Schedule, entries_per_item: int) -> Schedule:
    """`torch_msa.plan.schedule.with_items` (same arguments, same tables) in two launches."""
    num_buckets = schedule.bucket_head.numel()
    item_bound = max_items(schedule.entry_query.numel(), num_buckets, entries_per_item)
    sizes = (num_buckets, num_buckets, item_bound, item_bound, item_bound, 1)
    items_per_bucket, item_ptr, item_bucket, item_start, item_end, num_items = uninitialized(
        int(sum(sizes)), dtype=torch.int32, device=schedule.bucket_ptr.device).split_with_sizes(sizes)
    bucket_start, bucket_end = schedule.bucket_ptr[:-1], schedule.bucket_ptr[1:]
    msa_plan_item_counts_kernel[(1,)](bucket_start, bucket_end, items_per_bucket, item_ptr, num_buckets,
                                      entries_per_item, ROWS=1024)
    _item_tables(item_ptr, items_per_bucket, bucket_start, bucket_end, item_bucket, item_start, item_end, num_items,
                 item_bound, num_buckets, entries_per_item)
    return schedule._replace(item_bucket=item_bucket, item_start=item_start, item_end=item_end, num_items=num_items)


@cached_launches
@triton.jit
def msa_plan_restrict_count_kernel(entry_query, bucket_ptr, bucket_head, kept_indices, kept, kept_before, block_kept,
                                   num_entries, num_buckets, search_steps, slots_per_head, BLOCK: tl.constexpr):
    """Per entry `e` whether its slot is kept (`kept`, int8) and how many entries of its program
    before `e` are kept (`kept_before`); per program of `BLOCK` entries how many it keeps
    (`block_kept`)."""
    entry = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # A plan's own entries end within its table; a stale plan's bounds read nothing past it.
    valid = (entry < tl.load(bucket_ptr + num_buckets)) & (entry < num_entries)
    bucket = tl.minimum(search_right(bucket_ptr + 1, num_buckets, entry, valid, search_steps), num_buckets - 1)
    head = tl.load(bucket_head + bucket, mask=valid, other=0)
    slot = head.to(tl.int64) * slots_per_head + tl.load(entry_query + entry, mask=valid, other=0)
    keep = (valid & (tl.load(kept_indices + slot, mask=valid, other=-1) >= 0)).to(tl.int32)
    tl.store(kept + entry, keep.to(tl.int8), mask=entry < num_entries)
    tl.store(kept_before + entry, tl.cumsum(keep, 0) - keep, mask=entry < num_entries)
    tl.store(block_kept + tl.program_id(0), tl.sum(keep, axis=0))


@triton.jit
def _kept_before(bound, ok, kept_before, block_kept, valid_entries, total, BLOCK: tl.constexpr):
    """The kept entries before entry `*bound`: the prefix of its program (`block_kept`) and its count
    within it (`kept_before`); `total` from the valid entries' end on (`valid_entries`, at most the
    table's entries)."""
    entry = tl.load(bound, mask=ok, other=0)
    inside = ok & (entry >= 0) & (entry < valid_entries)
    prefix = tl.load(block_kept + entry // BLOCK, mask=inside, other=0)
    return tl.where(inside, prefix + tl.load(kept_before + entry, mask=inside, other=0), total)


@cached_launches
@triton.jit
def msa_plan_restrict_buckets_kernel(bucket_ptr, kept_before, block_kept, restricted_ptr, items_per_bucket, item_ptr,
                                     num_entries, num_blocks, num_buckets, entries_per_item, BLOCK: tl.constexpr,
                                     ROWS: tl.constexpr):
    """One program: each program's count of kept entries (`block_kept`) becomes how many the
    programs before it keep, `block_kept[num_blocks]` the total; then each bucket's bounds among
    the kept entries (`restricted_ptr`), and its items with their running sum."""
    before = tl.zeros((), tl.int32)
    for first in range(0, num_blocks, ROWS):
        blocks = first + tl.arange(0, ROWS)
        ok = blocks < num_blocks
        counts = tl.load(block_kept + blocks, mask=ok, other=0)
        tl.store(block_kept + blocks, before + tl.cumsum(counts, 0) - counts, mask=ok)
        before += tl.sum(counts, axis=0)
    tl.store(block_kept + num_blocks, before)
    # The bounds below read the prefixes this program's other threads stored.
    tl.debug_barrier()
    valid_entries = tl.minimum(tl.load(bucket_ptr + num_buckets), num_entries)
    items = tl.zeros((), tl.int32)
    for first in range(0, num_buckets, ROWS):
        buckets = first + tl.arange(0, ROWS)
        ok = buckets < num_buckets
        start = _kept_before(bucket_ptr + buckets, ok, kept_before, block_kept, valid_entries, before, BLOCK)
        end = _kept_before(bucket_ptr + buckets + 1, ok, kept_before, block_kept, valid_entries, before, BLOCK)
        tl.store(restricted_ptr + buckets, start, mask=ok)
        tl.store(restricted_ptr + buckets + 1, end, mask=ok & (buckets == num_buckets - 1))
        items = _bucket_items(start, end, items_per_bucket, item_ptr, buckets, ok, items, entries_per_item)


@cached_launches
@triton.jit
def msa_plan_restrict_place_kernel(entry_query, kept, block_kept, restricted_query, num_entries, num_blocks,
                                   BLOCK: tl.constexpr):
    """Each entry's query slot to its row of the restricted schedule: the kept entries first, in
    order, then the dropped ones, in order."""
    entry = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = entry < num_entries
    keep = tl.load(kept + entry, mask=ok, other=0).to(tl.int32)
    before = tl.load(block_kept + tl.program_id(0)) + tl.cumsum(keep, 0) - keep
    total = tl.load(block_kept + num_blocks)
    row = tl.where(keep > 0, before, total + entry - before)
    tl.store(restricted_query + row, tl.load(entry_query + entry, mask=ok, other=0), mask=ok)


def restrict(schedule: Schedule, kept_indices: torch.Tensor, entries_per_item: int) -> Schedule:
    """`torch_msa.plan.schedule.restrict` (same arguments, same tables) in four launches;
    `kept_indices` contiguous."""
    if not kept_indices.is_contiguous():
        raise ValueError(f"kept_indices: expected a contiguous tensor, got strides {kept_indices.stride()}")
    num_entries, num_buckets = schedule.entry_query.numel(), schedule.bucket_head.numel()
    if num_entries == 0 or num_buckets == 0:
        return with_items(schedule, entries_per_item)
    num_blocks = triton.cdiv(num_entries, _ENTRIES)
    device = schedule.entry_query.device
    item_bound = max_items(num_entries, num_buckets, entries_per_item)
    # The scratch apart from the tables the schedule keeps, so that it is freed on return.
    block_kept, kept_before = uninitialized(num_blocks + 1 + num_entries, dtype=torch.int32,
                                            device=device).split_with_sizes((num_blocks + 1, num_entries))
    kept = uninitialized(num_entries, dtype=torch.int8, device=device)
    sizes = (num_entries, num_buckets + 1, num_buckets, num_buckets, item_bound, item_bound, item_bound, 1)
    entry_query, bucket_ptr, items_per_bucket, item_ptr, item_bucket, item_start, item_end, num_items = uninitialized(
        int(sum(sizes)), dtype=torch.int32, device=device).split_with_sizes(sizes)
    msa_plan_restrict_count_kernel[(num_blocks,)](
        schedule.entry_query, schedule.bucket_ptr, schedule.bucket_head, kept_indices, kept, kept_before, block_kept,
        num_entries, num_buckets, binary_search_steps(num_buckets), kept_indices[0].numel(), BLOCK=_ENTRIES)
    msa_plan_restrict_buckets_kernel[(1,)](
        schedule.bucket_ptr, kept_before, block_kept, bucket_ptr, items_per_bucket, item_ptr, num_entries, num_blocks,
        num_buckets, entries_per_item, BLOCK=_ENTRIES, ROWS=_ENTRIES)
    msa_plan_restrict_place_kernel[(num_blocks,)](schedule.entry_query, kept, block_kept, entry_query, num_entries,
                                                  num_blocks, BLOCK=_ENTRIES)
    _item_tables(item_ptr, items_per_bucket, bucket_ptr[:-1], bucket_ptr[1:], item_bucket, item_start, item_end,
                 num_items, item_bound, num_buckets, entries_per_item)
    return schedule._replace(entry_query=entry_query, bucket_ptr=bucket_ptr, item_bucket=item_bucket,
                             item_start=item_start, item_end=item_end, num_items=num_items)


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
def _first_of_runs(block_a, block_first_a, query_a, query_first_a, block_b, block_first_b, query_b, query_first_b):
    """Carries the first key of each run of equal `block` and of equal `query` keys along ascending keys."""
    return (block_b, tl.where(block_a == block_b, block_first_a, block_first_b),
            query_b, tl.where(query_a == query_b, query_first_a, query_first_b))


@cached_launches
@triton.jit
def msa_plan_query_groups_kernel(
    block_indices, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
    group_start, group_end, group_key_start, group_position, group_union, group_blocks, kv_outer_indices,
    unit_listed, num_queries, num_keys, num_segments, num_docs, search_steps, block_size, num_ids,
    min_segment_queries, stride_head, stride_token, stride_slot,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, GROUP: tl.constexpr, MOST: tl.constexpr, MOST_P2: tl.constexpr,
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
    pos, key_start, _ = locate_tokens(token, in_group, cu_seqlens_q, cu_seqlens_k, fragment_documents,
                                      fragment_starts, num_keys, num_segments, num_docs, search_steps, FRAGMENTS)
    token_segment, _ = find_segments(token, in_group, cu_seqlens_q, num_segments, search_steps)
    strangers = tl.sum((in_group & ((token_segment != segment) | (pos < 0))).to(tl.int32), axis=0)
    kept = has_segment & (start >= 0) & (start < end) & (strangers == 0)

    slot_ok = in_group & kept & (slot < TOPK)
    ids = tl.load(block_indices + head.to(tl.int64) * stride_head + token * stride_token + slot * stride_slot,
                  mask=slot_ok, other=-1).to(tl.int64)
    last_block = tl.where(pos >= 0, pos // block_size, -1)
    # A lane counts when some query of the group may see its id; sorted by (id, unseen, lane), the
    # lanes of one id form a run that starts with its first valid choice when it has one, and a
    # query's repeats of one id sit together behind their first slot.
    counted = slot_ok & (ids >= 0) & (ids <= tl.max(tl.where(slot_ok, last_block, -1), axis=0))
    unseen = (ids > last_block).to(tl.int64)
    past_all: tl.constexpr = 9223372036854775807
    keys = tl.sort(tl.where(counted, (ids << 32) | (unseen << 31) | lanes.to(tl.int64), past_all))
    _, block_first, _, query_first = tl.associative_scan((keys >> 32, keys, keys // TOPK_P2, keys), 0,
                                                         _first_of_runs)
    counted = keys != past_all
    seen = ((keys >> 31) & 1) == 0
    new_block = counted & seen & (block_first == keys)
    union = tl.sum(new_block.to(tl.int32), axis=0)
    entries = tl.sum((counted & seen & (query_first == keys)).to(tl.int32), axis=0)
    whole = (union * GROUP * COST_NUMERATOR <= entries * COST_DENOMINATOR) & (last - first >= min_segment_queries)
    listed_blocks = tl.where(whole, union, 0)

    pair = head.to(tl.int64) * num_ids + group
    rank = tl.cumsum(new_block.to(tl.int32), axis=0) - new_block.to(tl.int32)
    tl.store(group_blocks + pair * MOST + rank, (keys >> 32).to(tl.int32), mask=new_block & whole & (rank < MOST))
    unfilled = tl.arange(0, MOST_P2)
    tl.store(group_blocks + pair * MOST + unfilled, -1, mask=(unfilled >= listed_blocks) & (unfilled < MOST))
    tl.store(group_union + pair, tl.where(kept, union, 0))
    tl.store(unit_listed + group * tl.num_programs(1) + head, (listed_blocks > 0).to(tl.int32))
    # Every occurrence of a listed block, seen or not, leaves the KV-outer part's selection.
    lane = keys & 0x7FFFFFFF
    listed = counted & whole & (((block_first >> 31) & 1) == 0)
    tl.store(kv_outer_indices + (head.to(tl.int64) * num_queries + start + lane // TOPK_P2) * TOPK + lane % TOPK_P2,
             -1, mask=listed)
    if head == 0:
        tl.store(group_start + group, tl.where(kept, start, 0).to(tl.int32))
        tl.store(group_end + group, tl.where(kept, end, 0).to(tl.int32))
        first_lane = lanes == 0
        tl.store(group_key_start + group,
                 tl.where(kept, tl.sum(tl.where(first_lane, key_start, 0), axis=0), 0).to(tl.int32))
        tl.store(group_position + group, tl.where(kept, tl.sum(tl.where(first_lane, pos, 0), axis=0), 0).to(tl.int32))


@cached_launches
@triton.jit
def msa_plan_query_units_kernel(unit_listed, units, units_before, num_units, num_ids, NUM_KV_HEADS: tl.constexpr,
                                CHUNK: tl.constexpr):
    # One program: a running count over chunks of unit ids, `group * Hkv + head`.
    listed_before = tl.zeros((), tl.int32)
    for first in range(0, num_units, CHUNK):
        unit = first + tl.arange(0, CHUNK)
        ok = unit < num_units
        listed = tl.load(unit_listed + unit, mask=ok, other=0)
        slot = listed_before + tl.cumsum(listed, axis=0) - listed
        tl.store(units + slot, unit, mask=listed > 0)
        tl.store(units_before + unit // NUM_KV_HEADS, slot, mask=ok & (unit % NUM_KV_HEADS == 0))
        listed_before += tl.sum(listed, axis=0)
    tl.store(units_before + num_ids, listed_before)
    for first in range(0, num_units, CHUNK):
        slot = first + tl.arange(0, CHUNK)
        tl.store(units + slot, -1, mask=(slot >= listed_before) & (slot < num_units))


def query_groups_warps(tokens_per_group: int, topk: int) -> int:
    """Warps of a program of `msa_plan_query_groups_kernel`: one per `_SORTED_LANES_PER_WARP` of its lanes, up to 8."""
    return min(8, max(1, tokens_per_group * triton.next_power_of_2(topk) // _SORTED_LANES_PER_WARP))


def query_groups(block_indices, documents: Documents, num_keys, block_size, tokens_per_group,
                 min_segment_queries: int = 0) -> QueryGroups:
    """`torch_msa.plan.groups.build_query_groups` (same arguments, same tables) in three launches."""
    num_kv_heads, num_queries, topk = block_indices.shape
    if tokens_per_group & (tokens_per_group - 1):
        raise ValueError(f"tokens_per_group: expected a power of two (group_tokens gives one), got {tokens_per_group}")
    if block_indices.numel() == 0:
        return build_query_groups(block_indices, documents, num_keys, block_size, tokens_per_group,
                                  min_segment_queries)
    documents = documents.map_tensors(torch.Tensor.contiguous)
    cu_seqlens_q, cu_seqlens_k = documents.cu_seqlens_q, documents.cu_seqlens_k
    fragments = documents.has_fragments
    device = block_indices.device
    num_segments = cu_seqlens_q.numel() - 1
    num_ids = group_ids(num_queries, num_segments, tokens_per_group)
    most = max_group_blocks(topk, tokens_per_group)
    num_units = num_kv_heads * num_ids
    # One allocation for every table; the KV-outer part's selection first, a copy of the call's
    # that the groups kernel then marks.
    sizes = (block_indices.numel(), num_ids, num_ids, num_ids, num_ids, num_units, num_ids + 1, num_units,
             num_units * most, num_units)
    (kv_outer_indices, group_start, group_end, group_key_start, group_position, group_union, units_before, units,
     group_blocks, unit_listed) = uninitialized(sum(sizes), dtype=torch.int32, device=device).split_with_sizes(sizes)
    kv_outer_indices = kv_outer_indices.view(num_kv_heads, num_queries, topk)
    kv_outer_indices.copy_(block_indices)
    group_union, group_blocks = group_union.view(num_kv_heads, num_ids), group_blocks.view(num_kv_heads, num_ids, most)
    msa_plan_query_groups_kernel[(num_ids, num_kv_heads)](
        block_indices, cu_seqlens_q, cu_seqlens_k,
        documents.fragment_documents if fragments else cu_seqlens_q, documents.fragment_starts if fragments else cu_seqlens_q,
        group_start, group_end, group_key_start, group_position, group_union, group_blocks, kv_outer_indices,
        unit_listed, num_queries, num_keys, num_segments, documents.num_documents,
        binary_search_steps(num_segments), block_size, num_ids, min_segment_queries, *block_indices.stride(),
        TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), GROUP=tokens_per_group, MOST=most,
        MOST_P2=triton.next_power_of_2(most), COST_NUMERATOR=Q_OUTER_COST[0], COST_DENOMINATOR=Q_OUTER_COST[1],
        FRAGMENTS=fragments, num_warps=query_groups_warps(tokens_per_group, topk),
    )
    msa_plan_query_units_kernel[(1,)](unit_listed, units, units_before, num_units, num_ids,
                                      NUM_KV_HEADS=num_kv_heads, CHUNK=_UNIT_CHUNK)
    return QueryGroups(group_start, group_end, group_key_start, group_position, group_union,
                       group_blocks, kv_outer_indices, units, units_before)


@cached_launches
@triton.jit
def msa_bucket_key_count_kernel(bucket_key_row, cu_seqlens_k, key_count, num_buckets, num_bounds, search_steps,
                                block_size, BLOCK: tl.constexpr):
    bucket = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = bucket < num_buckets
    row = tl.load(bucket_key_row + bucket, mask=ok, other=0).to(tl.int64)
    # The boundary past the bucket's first key row, clamped to the last.
    after = tl.minimum(search_right(cu_seqlens_k, num_bounds, row, ok, search_steps), num_bounds - 1)
    doc_end = tl.load(cu_seqlens_k + after, mask=ok, other=0).to(tl.int64)
    tl.store(key_count + bucket, tl.minimum(tl.maximum(doc_end - row, 0), block_size).to(tl.int32), mask=ok)


def bucket_key_count(bucket_key_row: torch.Tensor, cu_seqlens_k: torch.Tensor, block_size: int) -> torch.Tensor:
    """`torch_msa.plan.schedule.bucket_key_count` (same arguments and result) in one launch."""
    key_count = uninitialized(bucket_key_row.shape, dtype=bucket_key_row.dtype, device=bucket_key_row.device)
    num_buckets, num_bounds = bucket_key_row.numel(), cu_seqlens_k.numel()
    if num_buckets == 0:
        return key_count
    cu_seqlens_k = cu_seqlens_k if cu_seqlens_k.is_contiguous() else cu_seqlens_k.contiguous()
    msa_bucket_key_count_kernel[(triton.cdiv(num_buckets, _ENTRIES),)](
        bucket_key_row, cu_seqlens_k, key_count, num_buckets, num_bounds, binary_search_steps(num_bounds), block_size,
        BLOCK=_ENTRIES,
    )
    return key_count
