"""A plain-Python build of the KV-outer schedule (`torch_msa.plan.schedule`): the oracle its device
builders are tested against.

Written with loops over Python lists, nothing shared with `torch_msa.plan.schedule.build_schedule` or
the Triton plan kernels but the contract, so that the builders and the oracle cannot share a
mistake. Only for small inputs.
"""

import torch


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
    """The schedule of `torch_msa.plan.schedule.build_schedule`, built with plain Python loops.

    Returns `{"buckets": [(head, key_row, block, [t * topk + s, ...]), ...] in bucket order,
    "items": [(bucket, start, end), ...]}`.
    """
    num_kv_heads, num_queries, topk = block_indices.shape
    ids = block_indices.tolist()
    position, key_start = query_locations_python(cu_seqlens_q, cu_seqlens_k, num_queries, fragment_documents,
                                                 fragment_starts)
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


def query_locations_python(cu_seqlens_q, cu_seqlens_k, num_queries: int, fragment_documents=None,
                           fragment_starts=None) -> tuple[list[int], list[int]]:
    """`(position, key_start)` of every query, plain Python lists: the causal suffix of its
    document, or its fragment's place; position -1 for a query outside its document's keys or in
    no document. Well-formed boundaries only."""
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
            local = first + (t - cu_q[segment])
            position[t] = local if 0 <= local < cu_k[doc + 1] - cu_k[doc] else -1
            key_start[t] = cu_k[doc]
    return position, key_start
