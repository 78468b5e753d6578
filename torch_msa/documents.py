"""Where each packed query token sits inside its document.

Packed (THD) tensors hold documents back to back, delimited by int32 `cu_seqlens_q` and
`cu_seqlens_k`. Inside a document with `Lq <= Lk` tokens the queries are the causal suffix of
the keys: local query `t` sits at key position `p(t) = Lk - Lq + t`. Everything here is computed
on the tensors' device with no host synchronisation, so it is safe inside CUDA-graph capture.
"""

from typing import NamedTuple

import torch


class QueryDocuments(NamedTuple):
    """Per-query document facts, each `[Tq]` int64.

    `key_start`: packed row of the first key of the query's document.
    `position`: `p(t)`, the query's key position inside its document; `-1` for a token that no
    well-formed document covers (malformed `cu_seqlens`), which then sees no key at all.
    """

    key_start: torch.Tensor
    position: torch.Tensor


def locate_queries(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_queries: int, num_keys: int
) -> QueryDocuments:
    """Map every packed query row to its document's key offset and causal position.

    Args:
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]` document boundaries.
        num_queries: `Tq`, rows of the packed queries.
        num_keys: `Tk`, rows of the packed keys; positions that would fall outside them are
            marked `-1`, so malformed boundaries can never produce an out-of-range key row.
    """
    device = cu_seqlens_q.device
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_k = cu_seqlens_k.to(torch.int64)
    num_docs = cu_q.numel() - 1
    tokens = torch.arange(num_queries, device=device, dtype=torch.int64)
    if num_docs < 1:
        minus_one = torch.full_like(tokens, -1)
        return QueryDocuments(torch.zeros_like(tokens), minus_one)
    # right=True skips empty documents (repeated boundaries).
    doc = torch.searchsorted(cu_q[1:].contiguous(), tokens, right=True)
    in_range = doc < num_docs
    doc = doc.clamp(max=num_docs - 1)
    q_start, q_end = cu_q[doc], cu_q[doc + 1]
    k_start, k_end = cu_k[doc], cu_k[doc + 1]
    position = (k_end - k_start) - (q_end - q_start) + (tokens - q_start)
    valid = (
        in_range
        & (tokens >= q_start)
        & (position >= 0)
        & (k_start >= 0)
        & (k_start + position < k_end)
        & (k_start + position < num_keys)
    )
    return QueryDocuments(torch.where(valid, k_start, 0), torch.where(valid, position, -1))
