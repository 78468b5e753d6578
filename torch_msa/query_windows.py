"""A KV-outer forward run over windows of queries, so that its partial outputs take bounded memory.

The KV-outer forwards write `Hq * topk * (D * itemsize + 4)` bytes of partials per query, more than
the layer's inputs. `forward_in_windows` runs one window of queries at a time, each window's
queries passed as one-token fragments (`Documents.token_fragments`) placed exactly where the
unwindowed call places them, so outputs and lse are those of one call. The windows walk the call's
one plan (`torch_msa.plan.schedule.query_windows`).
"""

import dataclasses
from collections.abc import Callable

import torch

from . import backends
from .contract import compute_dtype
from .documents import Documents
from .plan.schedule import Schedule, entries_per_item, unpack
from .plan.schedule import query_windows as plan_windows
from .uninitialized import uninitialized

# Memory the partial outputs of one window may take: enough for common training lengths of
# MiniMax-M3 in one window, on the plan they are given.
PARTIAL_BYTES = 3 << 30


def partial_bytes_per_query(num_heads: int, topk: int, dim: int, dtype: torch.dtype) -> int:
    """Bytes of partials one query costs: a row of `dim` outputs and an fp32 lse per head and slot."""
    return num_heads * topk * (dim * dtype.itemsize + 4)


def window_queries(num_heads: int, topk: int, dim: int, dtype: torch.dtype, budget: int = PARTIAL_BYTES) -> int:
    """The most queries whose partials fit `budget` bytes (at least one)."""
    return max(1, budget // max(1, partial_bytes_per_query(num_heads, topk, dim, dtype)))


def window_size(q: torch.Tensor, topk: int, budget: int | None = None) -> int:
    """The queries of one window of a forward on `q [Tq, Hq, D]`: `window_queries` within `budget`
    bytes (`PARTIAL_BYTES` when None)."""
    return window_queries(q.shape[1], topk, q.shape[2], q.dtype, PARTIAL_BYTES if budget is None else budget)


def query_windows(documents: Documents, num_queries: int, num_keys: int, window: int):
    """`(start, stop, documents)` per window of at most `window` consecutive queries, from shapes
    alone (no host sync); a single window keeps the call's own documents."""
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


def windowed_plan(plan, block_indices, documents: Documents, num_keys: int, block_size: int,
                  num_heads: int) -> Callable[[int, int], Schedule]:
    """`window(start, stop)`: the schedule a forward over queries `[start, stop)` of the call walks
    (`torch_msa.plan.schedule.query_windows`), cut from `plan` (`msa::plan`'s or a `Schedule`, of
    `block_indices` int32 `[Hkv, Tq, topk]` and the call's `documents`), or from one plan built
    here by the backend of `msa::plan` when None."""
    num_kv_heads, _, topk = block_indices.shape
    if plan is None:
        plan = backends.call("plan", block_indices.device, block_indices, documents, num_keys, block_size,
                             entries_per_item(num_heads, num_kv_heads))
    schedule = plan if isinstance(plan, Schedule) else unpack(plan, block_indices, num_keys, documents.num_documents,
                                                              block_size)
    return plan_windows(schedule, topk, entries_per_item(num_heads, num_kv_heads))


def forward_in_windows(forward: Callable, q, k, v, block_indices, documents: Documents, block_size, softmax_scale,
                       plan=None, budget: int | None = None, window_arguments: Callable[[int, int], dict] | None = None):
    """`forward(...)` (`msa::forward` in the backends' form) with its partials bounded by `budget`
    bytes (`PARTIAL_BYTES` when None); returns `(out, lse)` as `forward` does.

    Over several windows, `forward` writes each window's output into the rows of the call's that it
    is given as `into=(out, lse)` (views, `[Tq_w, Hq, D]` and `[Tq_w, Hq]`, both contiguous), and
    walks its window of `plan` (`windowed_plan`, one plan for every window).
    `window_arguments(start, stop)`, when given, returns more keyword arguments of `forward` for
    the window of queries `[start, stop)` (`[0, Tq)` when one window holds them all); over several
    windows those arguments then carry the window's plan too (the query-outer part's
    `QueryOuter.kv_outer_plan`), so `plan` must be None and each window is given None.

    Raises:
        ValueError: `plan` given with `window_arguments` over several windows.
    """
    num_queries, num_heads, _ = q.shape
    window = window_size(q, block_indices.shape[-1], budget)

    def more(start: int, stop: int) -> dict:
        return {} if window_arguments is None else window_arguments(start, stop)

    if num_queries <= window:
        return forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan, **more(0, num_queries))
    if window_arguments is not None and plan is not None:
        raise ValueError("plan: expected None with window_arguments over several windows (the windows' "
                         f"arguments carry their plans), got a {type(plan).__name__}")
    out = uninitialized(q.shape, dtype=q.dtype, device=q.device)
    lse = uninitialized((num_queries, num_heads), dtype=compute_dtype(q.dtype), device=q.device)
    window_plan = (windowed_plan(plan, block_indices, documents, k.shape[0], block_size, num_heads)
                   if window_arguments is None else None)
    for start, stop, window_documents in query_windows(documents, num_queries, k.shape[0], window):
        forward(q[start:stop], k, v, block_indices[:, start:stop].contiguous(), window_documents, block_size,
                softmax_scale, None if window_plan is None else window_plan(start, stop),
                into=(out[start:stop], lse[start:stop]), **more(start, stop))
    return out, lse
