"""The key-to-query schedule shared by the KV-outer kernels (Hopper Triton, SM100 CuTe).

MSA kernels run KV-outer: a program owns one KV head's key block and walks the queries that
chose it, so K/V of the block are loaded once and dK/dV stay on chip. This module turns the
query-major `block_indices [Hkv, Tq, topk]` into that key-major view:

* an *entry* is one valid `(kv head, query t, slot s)` of `block_indices`;
* a *bucket* is one `(kv head, key block)`: its entries, sorted by query, form one CSR row (the
  official library calls this the k2q CSR);
* an *item* is a run of at most `entries_per_item` consecutive entries of one bucket: the unit of
  work of one program. Splitting buckets bounds the work of any program, so a block every token
  chose (block 0 under a skewed selection) is spread over many programs.

Everything is built on the device with sorting and scans, with no host synchronisation: the
tables are sized by host-known upper bounds (`max_buckets`, `max_items`) and unused rows are
empty (`item_start == item_end`), so the builder is CUDA-graph safe and its sizes depend only on
shapes. An entry is valid when its id is `>= 0`, its block starts at or before the query's
position (`id < nvb`), and it is the first occurrence of that id in the row; invalid entries are
dropped, which is how out-of-contract ids can never reach a kernel.
"""

import math
from typing import NamedTuple

import torch

from .documents import locate_queries


class Schedule(NamedTuple):
    """Device tables of the KV-outer schedule (all int32).

    Attributes:
        entry_query: `[Hkv * Tq * topk]`, the valid entries as `t * topk + s`, sorted by
            (kv head, key block, t); rows past `bucket_ptr[-1]` are unused.
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


def max_buckets(num_kv_heads: int, num_keys: int, num_docs: int, block_size: int) -> int:
    """Upper bound of the distinct (kv head, key block) pairs: every document's blocks, per head."""
    return max(1, num_kv_heads * min(num_keys, math.ceil(num_keys / block_size) + num_docs))


def max_items(num_entries: int, num_buckets: int, entries_per_item: int) -> int:
    """Upper bound of the items: each bucket adds at most one partial item."""
    return math.ceil(num_entries / entries_per_item) + num_buckets


def valid_entries(block_indices: torch.Tensor, position: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[Hkv, Tq, topk]` bool: the slots a kernel must process (set semantics of the contract).

    A slot counts when its id is `>= 0`, its block is visible (`id * block_size <= p(t)`), and no
    earlier slot of the row holds the same id.
    """
    ids = block_indices.to(torch.int64)
    visible = (ids >= 0) & (ids * block_size <= position.view(1, -1, 1))
    topk = ids.shape[-1]
    earlier = torch.ones(topk, topk, dtype=torch.bool, device=ids.device).tril(-1)
    repeat = ((ids[..., :, None] == ids[..., None, :]) & earlier).any(-1)
    return visible & ~repeat


def build_schedule(
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_keys: int,
    block_size: int,
    entries_per_item: int,
) -> Schedule:
    """Build the KV-outer schedule of `block_indices` on its device, without a host sync.

    Args:
        block_indices: int32 `[Hkv, Tq, topk]`.
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]`.
        num_keys: `Tk`, rows of the packed keys.
        block_size: keys per block.
        entries_per_item: the most entries one item holds (a multiple of the kernels' query
            tile keeps their tiles full).
    """
    num_kv_heads, num_queries, topk = block_indices.shape
    device = block_indices.device
    num_docs = max(0, cu_seqlens_q.numel() - 1)
    bucket_bound = max_buckets(num_kv_heads, num_keys, num_docs, block_size)
    item_bound = max_items(block_indices.numel(), bucket_bound, entries_per_item)
    docs = locate_queries(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys)

    ids = block_indices.to(torch.int64)
    valid = valid_entries(block_indices, docs.position, block_size)
    key_row = docs.key_start.view(1, -1, 1) + ids * block_size
    head = torch.arange(num_kv_heads, device=device, dtype=torch.int64).view(-1, 1, 1)
    # One integer per bucket; invalid entries get a key past every real one and sort last. The
    # stable sort keeps each bucket's entries in query order.
    past_all = num_kv_heads * max(1, num_keys)
    bucket_key = torch.where(valid, head * max(1, num_keys) + key_row, past_all).view(-1)
    sorted_key, order = torch.sort(bucket_key, stable=True)
    per_head = num_queries * topk
    entry_query = (order % max(1, per_head)).to(torch.int32)

    sorted_valid = sorted_key < past_all
    starts_bucket = sorted_valid.clone()
    starts_bucket[1:] &= sorted_key[1:] != sorted_key[:-1]
    entry_bucket = torch.cumsum(starts_bucket, 0) - 1
    # Entries of buckets beyond the bound (impossible for well-formed documents) go to an
    # overflow row that no item reads, so no table is ever written out of range.
    entry_bucket = torch.where(sorted_valid, entry_bucket.clamp(max=bucket_bound), bucket_bound)

    counts = torch.zeros(bucket_bound + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, entry_bucket, torch.ones_like(entry_bucket))
    counts = counts[:bucket_bound]
    bucket_ptr = torch.zeros(bucket_bound + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts, 0, out=bucket_ptr[1:])

    first_of_bucket = torch.where(starts_bucket & (entry_bucket < bucket_bound), entry_bucket, bucket_bound)
    bucket_head = _scatter_rows(first_of_bucket, sorted_key // max(1, num_keys), bucket_bound)
    bucket_key_row = _scatter_rows(first_of_bucket, sorted_key % max(1, num_keys), bucket_bound)
    bucket_block = _scatter_rows(first_of_bucket, ids.view(-1)[order], bucket_bound)

    items_per_bucket = (counts + entries_per_item - 1) // entries_per_item
    item_ptr = torch.cumsum(items_per_bucket, 0)  # inclusive
    item = torch.arange(item_bound, device=device, dtype=torch.int64)
    item_bucket = torch.searchsorted(item_ptr, item, right=True)
    real = item_bucket < bucket_bound
    item_bucket = item_bucket.clamp(max=bucket_bound - 1)
    first_item = item_ptr[item_bucket] - items_per_bucket[item_bucket]
    item_start = bucket_ptr[item_bucket] + (item - first_item) * entries_per_item
    item_end = torch.minimum(item_start + entries_per_item, bucket_ptr[item_bucket + 1])
    item_start = torch.where(real, item_start, 0)
    item_end = torch.where(real, item_end, 0)

    num_buckets = (counts > 0).sum().view(1)
    num_items = item_ptr[-1:]
    as_int32 = lambda x: x.to(torch.int32)  # noqa: E731
    return Schedule(
        entry_query=entry_query,
        bucket_ptr=as_int32(bucket_ptr),
        bucket_head=as_int32(bucket_head),
        bucket_key_row=as_int32(bucket_key_row),
        bucket_block=as_int32(bucket_block),
        item_bucket=as_int32(item_bucket),
        item_start=as_int32(item_start),
        item_end=as_int32(item_end),
        position=as_int32(docs.position),
        num_buckets=as_int32(num_buckets),
        num_items=as_int32(num_items),
    )


def _scatter_rows(rows: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """`out[rows[i]] = values[i]` into `[size]`, with row `size` as a discard slot."""
    out = torch.zeros(size + 1, dtype=values.dtype, device=values.device)
    out.scatter_(0, rows, values)
    return out[:size]


def build_schedule_python(
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_keys: int,
    block_size: int,
    entries_per_item: int,
) -> dict:
    """The same schedule built with plain Python loops, for tests.

    Returns `{"buckets": [(head, key_row, block, [t * topk + s, ...]), ...] in bucket order,
    "items": [(bucket, start, end), ...]}`.
    """
    num_kv_heads, num_queries, topk = block_indices.shape
    ids = block_indices.tolist()
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    position, key_start = [-1] * num_queries, [0] * num_queries
    for doc in range(len(cu_q) - 1):
        length_q, length_k = cu_q[doc + 1] - cu_q[doc], cu_k[doc + 1] - cu_k[doc]
        for t in range(cu_q[doc], cu_q[doc + 1]):
            position[t] = length_k - length_q + (t - cu_q[doc])
            key_start[t] = cu_k[doc]
    buckets: dict[tuple[int, int], list[int]] = {}
    blocks: dict[tuple[int, int], int] = {}
    for head in range(num_kv_heads):
        for t in range(num_queries):
            seen = set()
            for s, block in enumerate(ids[head][t]):
                if block < 0 or block * block_size > position[t] or block in seen:
                    continue
                seen.add(block)
                key = (head, key_start[t] + block * block_size)
                buckets.setdefault(key, []).append(t * topk + s)
                blocks[key] = block
    ordered = [(head, row, blocks[(head, row)], buckets[(head, row)]) for head, row in sorted(buckets)]
    items, offset = [], 0
    for index, (_, _, _, entries) in enumerate(ordered):
        for first in range(0, len(entries), entries_per_item):
            items.append((index, offset + first, offset + min(len(entries), first + entries_per_item)))
        offset += len(entries)
    return {"buckets": ordered, "items": items}
