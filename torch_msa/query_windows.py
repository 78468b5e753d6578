"""A KV-outer forward run over windows of queries, so that its partial outputs take bounded memory.

The Triton and SM90 forwards are KV-outer: a program owns one key block and writes one partial
output row per (query, KV head, slot, query head of the group), which a combine then merges per
query. Those partials take `Hq * topk * (D * itemsize + 4)` bytes per query (260 KiB for
MiniMax-M3 in bf16), more than the layer's inputs, so at long lengths they, not the inputs,
would set the memory of a step.

`forward_in_windows` runs such a forward on consecutive windows of at most `window_queries(...)`
queries, sized so that one window's partials fit `PARTIAL_BYTES` whatever the length. Every
window reads all keys; its queries are passed as one-token fragments
(`Documents.token_fragments`) that place each of them exactly where the unwindowed call does, so
each query's output and lse are those of one call over all queries. A problem that fits one
window is passed through unchanged, with its plan; the windows walk the call's plan
(`torch_msa.plan.schedule.query_windows`), built here once when none is given.
"""

import dataclasses
from collections.abc import Callable

import torch

from . import backends
from .contract import compute_dtype
from .documents import Documents
from .plan.schedule import Schedule, entries_per_item, unpack
from .plan.schedule import query_windows as plan_windows

PARTIAL_BYTES = 3 << 30
"""Memory the partial outputs of one window may take (3 GiB: 12098 queries of MiniMax-M3, so that
the common training lengths up to 12K tokens run in one window, on the plan they are given)."""


def partial_bytes_per_query(num_heads: int, topk: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes of partials one query costs: a row of `dim` outputs and an fp32 lse per head and slot."""
    return num_heads * topk * (dim * dtype.itemsize + 4)


def window_queries(num_heads: int, topk: int, dim: int, dtype: torch.dtype, budget: int = PARTIAL_BYTES) -> int:
    """The most queries whose partials fit `budget` bytes (at least one)."""
    return max(1, budget // max(1, partial_bytes_per_query(num_heads, topk, dim, dtype)))


def query_windows(documents: Documents, num_queries: int, num_keys: int, window: int):
    """The windows of at most `window` consecutive queries: `(start, stop, documents)` each, the
    window's documents placing its queries where the call's do. One window holding every query
    keeps the call's own documents; otherwise each window's queries are one-token fragments
    (`Documents.token_fragments`) over `arange(stop - start + 1)`. The windows follow from shapes
    alone (no host synchronisation)."""
    if num_queries <= window:
        yield 0, num_queries, documents
        return
    token_documents, token_starts = documents.token_fragments(num_queries, num_keys)
    boundaries = torch.arange(window + 1, dtype=torch.int32, device=documents.cu_seqlens_q.device)
    for start in range(0, num_queries, window):
        stop = min(num_queries, start + window)
        yield start, stop, dataclasses.replace(
            documents, cu_seqlens_q=boundaries[: stop - start + 1], max_seqlen_q=1,
            fragment_documents=token_documents[start:stop], fragment_starts=token_starts[start:stop],
        )


def forward_in_windows(forward: Callable, q, k, v, block_indices, documents: Documents, block_size, softmax_scale,
                       plan=None, budget: int | None = None):
    """`forward(...)` (the `msa::forward` contract, in the backends' form) with its partials bounded
    by `budget` bytes (`PARTIAL_BYTES` when None).

    Returns `out [Tq, Hq, D]` and `lse [Tq, Hq]` as `forward` does. No host synchronisation: the
    windows follow from shapes alone.
    """
    num_queries, num_heads, dim = q.shape
    window = window_queries(num_heads, block_indices.shape[-1], dim, q.dtype, PARTIAL_BYTES if budget is None else budget)
    if num_queries <= window:
        return forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((num_queries, num_heads), dtype=compute_dtype(q.dtype), device=q.device)
    num_kv_heads, _, topk = block_indices.shape
    if plan is None:  # built once for every window, by the backend of `msa::plan`
        plan = backends.call("plan", q.device, block_indices, documents, k.shape[0], block_size,
                             entries_per_item(num_heads, num_kv_heads))
    schedule = plan if isinstance(plan, Schedule) else unpack(plan, block_indices, k.shape[0],
                                                              documents.num_documents, block_size)
    window_schedule = plan_windows(schedule, topk, entries_per_item(num_heads, num_kv_heads))
    for start, stop, window_documents in query_windows(documents, num_queries, k.shape[0], window):
        part_out, part_lse = forward(q[start:stop], k, v, block_indices[:, start:stop].contiguous(), window_documents,
                                     block_size, softmax_scale, window_schedule(start, stop))
        out[start:stop] = part_out
        lse[start:stop] = part_lse
    return out, lse
