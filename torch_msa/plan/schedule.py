"""The KV-outer schedule of a selection: its tables, their sizes, the plan that packs them, and the
reference build. Design and plan layout: `torch_msa/plan/README.md`.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..documents import Documents


class Schedule(NamedTuple):
    """Device tables of the KV-outer schedule (all int32).

    Attributes:
        entry_query: `[Hkv * Tq * topk]`, the valid entries as `t * topk + s`, sorted by
            (kv head, bucket slot, t), the invalid ones after them; rows past `bucket_ptr[-1]`
            are unused. Block `b` of the document `d` whose keys start at row `c` has the slot
            `c // block_size + d + b`, below `max_key_blocks`; over non-decreasing `cu_seqlens_k`
            it is increasing in (d, b), one slot per block. (Decreasing boundaries, outside the
            contract and refused by `validate_inputs`, may give two blocks one slot: their
            queries then read the first block's keys, in bounds.)
        bucket_ptr: `[max_buckets + 1]` CSR offsets of each bucket's entries in `entry_query`;
            buckets past the real count are empty.
        bucket_head: `[max_buckets]` KV head of each bucket.
        bucket_key_row: `[max_buckets]` packed row in `k`/`v` of the block's first key.
        bucket_block: `[max_buckets]` document-local block id (key positions
            `block * block_size + c`).
        item_bucket, item_start, item_end: `[max_items]` each; item `i` covers entries
            `[item_start[i], item_end[i])` of bucket `item_bucket[i]`; empty for unused items.
        position: `[Tq]` key position `p(t)` of each query in its document, `-1` for a query no
            well-formed document covers.
        num_buckets, num_items: `[1]` the real counts, on the device.
    """

    entry_query: torch.Tensor
    bucket_ptr: torch.Tensor
    bucket_head: torch.Tensor
    bucket_key_row: torch.Tensor
    bucket_block: torch.Tensor
    item_bucket: torch.Tensor
    item_start: torch.Tensor
    item_end: torch.Tensor
    position: torch.Tensor
    num_buckets: torch.Tensor
    num_items: torch.Tensor


def max_key_blocks(num_keys: int, num_docs: int, block_size: int) -> int:
    """Upper bound of the key blocks of all documents, `ceil(Tk / block_size) + B`; takes SymInts."""
    return (num_keys + block_size - 1) // block_size + num_docs


def max_buckets(num_kv_heads: int, num_keys: int, num_docs: int, block_size: int) -> int | torch.SymInt:
    """Upper bound of the distinct (kv head, key block) pairs; takes SymInts."""
    blocks = max_key_blocks(num_keys, num_docs, block_size)
    if type(num_kv_heads) is int and type(num_keys) is int and type(blocks) is int:
        # Every eager call asks several times: skip torch's symbolic dispatch.
        return max(1, num_kv_heads * min(num_keys, blocks))
    return torch.sym_max(1, num_kv_heads * torch.sym_min(num_keys, blocks))


def max_items(num_entries: int, num_buckets: int | torch.SymInt, entries_per_item: int) -> int | torch.SymInt:
    """Upper bound of the items: each bucket adds at most one partial item."""
    return (num_entries + entries_per_item - 1) // entries_per_item + num_buckets


ITEM_ROWS = 2048
"""Query rows (tokens x query heads of a KV head) per item of the public API's plans."""


def entries_per_item(num_heads: int, num_kv_heads: int) -> int:
    """Entries per item of `ITEM_ROWS` rows, the head group `Hq / Hkv` padded to a power of two."""
    group = max(1, num_heads // max(1, num_kv_heads))
    return max(1, ITEM_ROWS // (1 << (group - 1).bit_length()))


def valid_entries(block_indices: torch.Tensor, position: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[Hkv, Tq, topk]` bool: slots whose id is `>= 0`, visible (`id * block_size <= p(t)`) and
    not repeated by an earlier slot of the row."""
    # `id <= p(t) // block_size` is the visibility test without multiplying (possibly huge) ids.
    last_block = torch.div(position, block_size, rounding_mode="floor").view(1, -1, 1)
    visible = (block_indices >= 0) & (block_indices <= last_block)
    repeat = (block_indices.unsqueeze(-1) == block_indices.unsqueeze(-2)).tril(-1).any(-1)
    return visible & ~repeat


def build_schedule(
    block_indices: torch.Tensor,
    documents: Documents,
    num_keys: int,
    block_size: int,
    entries_per_item: int,
) -> Schedule:
    """The KV-outer schedule of `block_indices` on its device, without a host sync (the reference
    build: the reference backend's `msa::plan`, packed by `pack`).

    Args:
        block_indices: int32 `[Hkv, Tq, topk]`.
        documents: the documents; fragments of one document share its buckets.
        num_keys: `Tk`, rows of the packed keys.
        block_size: keys per block.
        entries_per_item: the most entries one item holds.
    """
    num_kv_heads, num_queries, topk = block_indices.shape
    device = block_indices.device
    num_docs = max(0, documents.num_documents)
    num_entries = block_indices.numel()
    bucket_bound = max_buckets(num_kv_heads, num_keys, num_docs, block_size)
    item_bound = max_items(num_entries, bucket_bound, entries_per_item)
    document, docs = documents.locate_with_documents(num_queries, num_keys)
    valid = valid_entries(block_indices, docs.position, block_size)

    # A bucket's key is its slot `key_start // block_size + document + block` after the slots of the
    # heads before it (`bucket_slot`); invalid entries get a key past every real one and sort last.
    # Stable: buckets stay in query order.
    slots_per_head = max(1, max_key_blocks(num_keys, num_docs, block_size))
    past_all = num_kv_heads * slots_per_head
    head_offsets = torch.arange(0, past_all, slots_per_head, device=device, dtype=torch.int64).view(-1, 1)
    first_slot = torch.div(docs.key_start, block_size, rounding_mode="floor") + document
    bucket_key = ((first_slot + head_offsets).unsqueeze(-1) + block_indices).masked_fill_(~valid, past_all)
    sorted_key, order = torch.sort(bucket_key.reshape(-1), stable=True)
    entry_query = (order % max(1, num_queries * topk)).to(torch.int32)

    # 1-based buckets. Invalid entries and buckets past the bound go to the overflow bucket
    # `bound + 1`, which no item reads, so no table is indexed out of range.
    starts_bucket = sorted_key != F.pad(sorted_key[:-1], (1, 0), value=-1)
    overflow = bucket_bound + 1
    entry_bucket = torch.cumsum(starts_bucket, 0).clamp_(max=overflow)
    entry_bucket.masked_fill_(sorted_key >= past_all, overflow)
    bucket_ptr = torch.searchsorted(
        entry_bucket, torch.arange(1, bucket_bound + 2, device=device, dtype=torch.int64), out_int32=True
    )
    bucket_end = bucket_ptr[1:]
    counts = bucket_end - bucket_ptr[:-1]
    real_bucket = counts > 0

    # A sentinel row keeps the gather in range for empty buckets and empty inputs.
    first_entry = bucket_ptr[:-1]
    first_key = F.pad(sorted_key, (0, 1), value=0).index_select(0, first_entry) * real_bucket
    first_order = F.pad(order, (0, 1), value=num_entries).index_select(0, first_entry)
    flat_ids = F.pad(block_indices.reshape(-1), (0, 1), value=0)
    bucket_block = flat_ids.index_select(0, first_order) * real_bucket
    entry_row = torch.add(docs.key_start.view(1, -1, 1), block_indices, alpha=block_size).reshape(-1)
    bucket_key_row = F.pad(entry_row, (0, 1), value=0).index_select(0, first_order) * real_bucket

    item_bucket, item_start, item_end, num_items = _items(bucket_ptr[:-1], bucket_end, entries_per_item, item_bound)
    return Schedule(
        entry_query=entry_query,
        bucket_ptr=bucket_ptr,
        bucket_head=(first_key // slots_per_head).to(torch.int32),
        bucket_key_row=bucket_key_row.to(torch.int32),
        bucket_block=bucket_block,
        item_bucket=item_bucket,
        item_start=item_start,
        item_end=item_end,
        position=docs.position.to(torch.int32),
        num_buckets=real_bucket.sum(dtype=torch.int32).view(1),
        num_items=num_items,
    )


def _items(bucket_start: torch.Tensor, bucket_end: torch.Tensor, entries_per_item: int, item_bound):
    """`(item_bucket, item_start, item_end, num_items)` of buckets whose entries are
    `[bucket_start[b], bucket_end[b])` (int32 `[MB]` each); item rows past `num_items` are empty."""
    counts = bucket_end - bucket_start
    items_per_bucket = (counts + (entries_per_item - 1)) // entries_per_item
    item_ptr = torch.cumsum(items_per_bucket, 0, dtype=torch.int32)
    item = torch.arange(item_bound, device=bucket_start.device, dtype=torch.int32)
    item_bucket = torch.searchsorted(item_ptr, item, right=True, out_int32=True).clamp_(max=bucket_start.numel() - 1)
    first_item_of_bucket = item_ptr - items_per_bucket
    item_rank = item - first_item_of_bucket.index_select(0, item_bucket)
    item_start = bucket_start.index_select(0, item_bucket) + item_rank * entries_per_item
    end_of_bucket = bucket_end.index_select(0, item_bucket)
    return (item_bucket, torch.minimum(item_start, end_of_bucket),
            torch.minimum(item_start + entries_per_item, end_of_bucket), item_ptr[-1:])


def with_items(schedule: Schedule, entries_per_item: int) -> Schedule:
    """`schedule` with items of `entries_per_item` entries: the same entries and buckets, new item
    tables (no sort, no host sync)."""
    num_buckets = schedule.bucket_head.numel()
    item_bound = max_items(schedule.entry_query.numel(), num_buckets, entries_per_item)
    items = _items(schedule.bucket_ptr[:-1], schedule.bucket_ptr[1:], entries_per_item, item_bound)
    return schedule._replace(**dict(zip(("item_bucket", "item_start", "item_end", "num_items"), items)))


def kept_entries(schedule: Schedule, kept_indices: torch.Tensor) -> torch.Tensor:
    """bool `[Hkv * Tq * topk]`: the entry rows of `schedule` whose slot `kept_indices` still holds
    (`>= 0`); rows past the valid entries are not kept."""
    num_queries_slots = kept_indices[0].numel()
    num_buckets = schedule.bucket_head.numel()
    entry = torch.arange(schedule.entry_query.numel(), device=kept_indices.device, dtype=torch.int32)
    entry_bucket = torch.searchsorted(schedule.bucket_ptr[1:], entry, right=True).clamp_(max=num_buckets - 1)
    valid = entry < schedule.bucket_ptr[-1]
    slot = schedule.bucket_head.index_select(0, entry_bucket).to(torch.int64) * num_queries_slots
    slot += schedule.entry_query.to(torch.int64).clamp(0, max(0, num_queries_slots - 1))
    return valid & (kept_indices.reshape(-1).index_select(0, torch.where(valid, slot, 0)) >= 0)


def restrict(schedule: Schedule, kept_indices: torch.Tensor, entries_per_item: int) -> Schedule:
    """`schedule` restricted to the entries whose slot `kept_indices` still holds, in items of
    `entries_per_item` (no sort, no host sync).

    `kept_indices` is int32 `[Hkv, Tq, topk]`: the selection `schedule` was built from with `-1`
    in the slots to drop (`QueryGroups.kv_outer_indices`). Each bucket keeps its kept entries in
    their order (so by query, and `query_windows` cuts the result as it cuts a plan's schedule);
    the dropped entries follow every kept one, in order, as unused rows. Buckets and their tables
    stay, some of them now empty; `position` and `num_buckets` are `schedule`'s.
    """
    kept = kept_entries(schedule, kept_indices)
    kept_before = F.pad(torch.cumsum(kept, 0, dtype=torch.int32), (1, 0))
    entry = torch.arange(kept.numel(), device=kept.device, dtype=torch.int32)
    row = torch.where(kept, kept_before[:-1], kept_before[-1] + entry - kept_before[:-1])
    entry_query = torch.empty_like(schedule.entry_query).index_put_((row.to(torch.int64),), schedule.entry_query)
    bucket_ptr = kept_before.index_select(0, schedule.bucket_ptr)
    item_bound = max_items(kept.numel(), schedule.bucket_head.numel(), entries_per_item)
    items = _items(bucket_ptr[:-1], bucket_ptr[1:], entries_per_item, item_bound)
    return schedule._replace(entry_query=entry_query, bucket_ptr=bucket_ptr,
                             **dict(zip(("item_bucket", "item_start", "item_end", "num_items"), items)))


def query_windows(schedule: Schedule, topk: int, entries_per_item: int) -> Callable[[int, int], Schedule]:
    """`window(start, stop)`: the schedule of queries `[start, stop)` of `schedule`'s, as a forward
    over `q[start:stop]` walks it: items of `entries_per_item` over each bucket's entries of those
    queries; `entry_query` and `position` count from `start`; `bucket_ptr` stays the whole call's.
    No sort, no host sync; the search keys are computed once for every window."""
    num_buckets = schedule.bucket_head.numel()
    num_entries = schedule.entry_query.numel()
    device = schedule.entry_query.device
    stride = schedule.position.numel() * topk
    num_kv_heads = num_entries // max(1, stride)
    # Keyed (bucket, query slot), a bucket's window is one searchsorted per end.
    entry = torch.arange(num_entries, device=device, dtype=torch.int32)
    entry_bucket = torch.searchsorted(schedule.bucket_ptr[1:], entry, right=True, out_int32=True)
    keys = entry_bucket.to(torch.int64) * stride + schedule.entry_query
    bucket_keys = torch.arange(num_buckets, device=device, dtype=torch.int64) * stride

    def window(start: int, stop: int) -> Schedule:
        window_start = torch.searchsorted(keys, bucket_keys + start * topk, out_int32=True)
        window_end = torch.searchsorted(keys, bucket_keys + stop * topk, out_int32=True)
        item_bound = max_items(num_kv_heads * (stop - start) * topk, num_buckets, entries_per_item)
        items = _items(window_start, window_end, entries_per_item, item_bound)
        return schedule._replace(
            entry_query=schedule.entry_query - start * topk, position=schedule.position[start:stop],
            **dict(zip(("item_bucket", "item_start", "item_end", "num_items"), items)))

    return window


def section_sizes(block_shape: Sequence, num_keys, num_docs, block_size, num_items) -> list:
    """Lengths of the plan's sections (the `Schedule` fields in order), ints or SymInts, for
    `block_indices` of shape `block_shape`, `Tk`, `B`, the block size and `MI` item rows."""
    num_kv_heads, num_queries, topk = block_shape
    buckets = max_buckets(num_kv_heads, num_keys, num_docs, block_size)
    return [num_kv_heads * num_queries * topk, buckets + 1, buckets, buckets, buckets,
            num_items, num_items, num_items, num_queries, 1, 1]


def plan_numel(block_shape: Sequence, num_keys, num_docs, block_size, entries_per_item: int):
    """Length of the plan `msa::plan` returns (from shapes only)."""
    num_kv_heads, num_queries, topk = block_shape
    item_rows = max_items(num_kv_heads * num_queries * topk, max_buckets(num_kv_heads, num_keys, num_docs, block_size),
                          entries_per_item)
    return sum(section_sizes(block_shape, num_keys, num_docs, block_size, item_rows))


def pack(schedule: Schedule) -> torch.Tensor:
    """The plan tensor of `schedule` (one copy of every table)."""
    return torch.cat(schedule)


def item_rows(numel, block_shape: Sequence, num_keys, num_docs, block_size):
    """The item rows `MI` of a plan of `numel` entries for these shapes, or None when no plan of
    them has that length (fixed sections plus `3 * MI`, `MI >= 1`)."""
    fixed = sum(section_sizes(block_shape, num_keys, num_docs, block_size, 0))
    rows, remainder = divmod(numel - fixed, 3)
    return rows if rows >= 1 and remainder == 0 else None


def length_error(numel, block_shape: Sequence, num_keys, num_docs, block_size) -> str:
    """The message of a plan whose length does not fit these shapes."""
    fixed = sum(section_sizes(block_shape, num_keys, num_docs, block_size, 0))
    return (f"plan: expected {fixed} + 3 * num_items int32 entries with num_items >= 1 (a plan from msa::plan for "
            f"block_indices of shape {list(block_shape)}, Tk = {num_keys}, B = {num_docs}, block_size = {block_size}), "
            f"got {numel}")


def unpack(plan: torch.Tensor, block_indices: torch.Tensor, num_keys: int, num_docs: int, block_size: int) -> Schedule:
    """The `Schedule` views of `plan`, built by `msa::plan` for these arguments.

    Raises:
        ValueError: the plan's length does not fit `block_indices`, `num_keys`, `num_docs` and
            `block_size` (a plan of another layer shape or another batch).
    """
    rows = item_rows(plan.numel(), block_indices.shape, num_keys, num_docs, block_size)
    if rows is None:
        raise ValueError(length_error(plan.numel(), list(block_indices.shape), num_keys, num_docs, block_size))
    plan = plan if plan.is_contiguous() else plan.contiguous()  # the kernels index the tables densely
    return Schedule(*plan.split_with_sizes(section_sizes(block_indices.shape, num_keys, num_docs, block_size, rows)))


def bucket_key_count(bucket_key_row: torch.Tensor, cu_seqlens_k: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 `[max_buckets]`: keys of each bucket's block inside its document (1..block_size;
    any value for unused buckets), from a `Schedule`'s `bucket_key_row` and int32 `cu_seqlens_k [B + 1]`."""
    cu = cu_seqlens_k.to(torch.int64)
    document_after = torch.searchsorted(cu, bucket_key_row.to(torch.int64), right=True).clamp_(max=cu.numel() - 1)
    doc_end = cu.index_select(0, document_after)
    return (doc_end - bucket_key_row).clamp_(0, block_size).to(torch.int32)
