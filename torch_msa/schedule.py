"""The key-to-query schedule shared by the KV-outer kernels (Triton, SM100 CuTe).

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

from typing import NamedTuple

import torch
import torch.nn.functional as F

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
    """Upper bound of the distinct (kv head, key block) pairs: every document's blocks, per head.

    Integer arithmetic only, so it also takes SymInts (the fake kernel of `msa::plan`)."""
    blocks = (num_keys + block_size - 1) // block_size + num_docs
    return torch.sym_max(1, num_kv_heads * torch.sym_min(num_keys, blocks))


def max_items(num_entries: int, num_buckets: int, entries_per_item: int) -> int:
    """Upper bound of the items: each bucket adds at most one partial item."""
    return (num_entries + entries_per_item - 1) // entries_per_item + num_buckets


def valid_entries(block_indices: torch.Tensor, position: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[Hkv, Tq, topk]` bool: the slots a kernel must process (set semantics of the contract).

    A slot counts when its id is `>= 0`, its block is visible (`id * block_size <= p(t)`), and no
    earlier slot of the row holds the same id.
    """
    # `id <= p(t) // block_size` is the visibility test without multiplying (possibly huge) ids.
    last_block = torch.div(position, block_size, rounding_mode="floor").view(1, -1, 1)
    visible = (block_indices >= 0) & (block_indices <= last_block)
    repeat = (block_indices.unsqueeze(-1) == block_indices.unsqueeze(-2)).tril(-1).any(-1)
    return visible & ~repeat


def build_schedule(
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_keys: int,
    block_size: int,
    entries_per_item: int,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> Schedule:
    """Build the KV-outer schedule of `block_indices` on its device, without a host sync.

    This is the reference build (`msa::plan` of the reference backend, packed by
    `torch_msa.plan.pack`); the Triton backend writes the same tables with a few kernels
    (`torch_msa/triton/plan_kernel.py`), because in eager mode each ATen call here costs a
    host-side launch (about 20 us each on an H200 host). It is still written with few calls:
    scans and `searchsorted` instead of scatters, int32 tables computed directly.
    `tests/core/test_schedule.py` bounds the count.

    Args:
        block_indices: int32 `[Hkv, Tq, topk]`.
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]` (`cu_seqlens_q` `[F + 1]` with fragments).
        num_keys: `Tk`, rows of the packed keys.
        block_size: keys per block.
        entries_per_item: the most entries one item holds (a multiple of the kernels' query
            tile keeps their tiles full).
        fragment_documents, fragment_starts: int32 `[F]` each, or None (`torch_msa/documents.py`).
            Fragments of one document share its buckets, so each key block is still one bucket.
    """
    num_kv_heads, num_queries, topk = block_indices.shape
    device = block_indices.device
    num_docs = max(0, cu_seqlens_k.numel() - 1)
    num_entries = block_indices.numel()
    bucket_bound = max_buckets(num_kv_heads, num_keys, num_docs, block_size)
    item_bound = max_items(num_entries, bucket_bound, entries_per_item)
    docs = locate_queries(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys, fragment_documents, fragment_starts)
    valid = valid_entries(block_indices, docs.position, block_size)

    # One integer per bucket, `head * Tk + packed key row of the block`; invalid entries get a
    # key past every real one and sort last. The stable sort keeps each bucket in query order.
    key_stride = max(1, num_keys)
    past_all = num_kv_heads * key_stride
    head_offsets = torch.arange(0, past_all, key_stride, device=device, dtype=torch.int64).view(-1, 1)
    row_of_query = (docs.key_start + head_offsets).unsqueeze(-1)
    bucket_key = torch.add(row_of_query, block_indices, alpha=block_size).masked_fill_(~valid, past_all)
    sorted_key, order = torch.sort(bucket_key.reshape(-1), stable=True)
    entry_query = (order % max(1, num_queries * topk)).to(torch.int32)

    # 1-based bucket of each sorted entry. Invalid entries, and entries of buckets beyond the
    # bound (impossible for well-formed documents), go to the overflow bucket `bound + 1`, which
    # no item reads, so no table is ever written or read out of range.
    # (`masked_fill_` rather than `where` with a scalar: on the H200 host it was the dearest call.)
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

    # Each bucket's fields come from its first entry; a sentinel row keeps the gather in range
    # for empty buckets (which point one past the last valid entry) and for empty inputs.
    first_entry = bucket_ptr[:-1]
    first_key = F.pad(sorted_key, (0, 1), value=0).index_select(0, first_entry) * real_bucket
    first_order = F.pad(order, (0, 1), value=num_entries).index_select(0, first_entry)
    flat_ids = F.pad(block_indices.reshape(-1), (0, 1), value=0)
    bucket_block = flat_ids.index_select(0, first_order) * real_bucket

    # Items: bucket b holds ceil(count / entries_per_item) of them. Item i >= num_items lands in the last bucket
    # at or past its end, so the `minimum`s leave it empty (start == end).
    items_per_bucket = (counts + (entries_per_item - 1)) // entries_per_item
    item_ptr = torch.cumsum(items_per_bucket, 0, dtype=torch.int32)
    item = torch.arange(item_bound, device=device, dtype=torch.int32)
    item_bucket = torch.searchsorted(item_ptr, item, right=True, out_int32=True).clamp_(max=bucket_bound - 1)
    first_item_of_bucket = item_ptr - items_per_bucket
    item_rank = item - first_item_of_bucket.index_select(0, item_bucket)
    item_start = bucket_ptr.index_select(0, item_bucket) + item_rank * entries_per_item
    end_of_bucket = bucket_end.index_select(0, item_bucket)
    return Schedule(
        entry_query=entry_query,
        bucket_ptr=bucket_ptr,
        bucket_head=(first_key // key_stride).to(torch.int32),
        bucket_key_row=(first_key % key_stride).to(torch.int32),
        bucket_block=bucket_block,
        item_bucket=item_bucket,
        item_start=torch.minimum(item_start, end_of_bucket),
        item_end=torch.minimum(item_start + entries_per_item, end_of_bucket),
        position=docs.position.to(torch.int32),
        num_buckets=real_bucket.sum(dtype=torch.int32).view(1),
        num_items=item_ptr[-1:],
    )


def build_schedule_python(
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_keys: int,
    block_size: int,
    entries_per_item: int,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> dict:
    """The same schedule built with plain Python loops, for tests.

    Returns `{"buckets": [(head, key_row, block, [t * topk + s, ...]), ...] in bucket order,
    "items": [(bucket, start, end), ...]}`.
    """
    num_kv_heads, num_queries, topk = block_indices.shape
    ids = block_indices.tolist()
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    position, key_start = [-1] * num_queries, [0] * num_queries
    for segment in range(len(cu_q) - 1):
        length_q = cu_q[segment + 1] - cu_q[segment]
        if fragment_documents is None:
            doc = segment
            first = cu_k[doc + 1] - cu_k[doc] - length_q
        else:
            doc, first = int(fragment_documents[segment]), int(fragment_starts[segment])
        for t in range(cu_q[segment], cu_q[segment + 1]):
            position[t] = first + (t - cu_q[segment])
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
