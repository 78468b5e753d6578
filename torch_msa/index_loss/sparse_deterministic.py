"""`msa::indexer_kl` and `msa::indexer_kl_backward` on the sparse support in Triton with fixed-order
reductions, bitwise reproducible: served under `torch.use_deterministic_algorithms(True)` (design:
`torch_msa/index_loss/README.md`).
"""

import torch

from .. import query_windows
from ..plan.kernels import plan_schedule, schedule_for, with_items
from ..plan.schedule import entries_per_item
from ..reference_index_loss import loss_dtype
from ..stages.deterministic import bucket_first_items, reduce_item_rows
from ..uninitialized import uninitialized
from . import sparse
from .sparse import (
    ForwardPartials,
    check_inputs,
    coefficient_scale,
    finish_forward,
    forward_partials,
    launch_backward,
    launch_forward,
    launch_forward_from_teacher,
)

FORWARD_ITEM_FACTOR = 4
"""The forward's entries per item, in multiples of those of the public API's plans."""


def forward_entries_per_item(num_heads: int, num_kv_heads: int) -> int:
    """Entries per item of the forward's schedule."""
    return FORWARD_ITEM_FACTOR * entries_per_item(num_heads, num_kv_heads)


def backward_entries_per_item(num_index_heads: int) -> int:
    """Entries per item of the backward's schedule, as the default backward's."""
    return entries_per_item(num_index_heads, num_index_heads)


def partial_bytes_per_query(num_index_heads: int, topk: int, index_dim: int, block_size: int, items_of: int) -> int:
    """Bytes of entry rows and item rows one query adds to a window with items of `items_of` entries."""
    entries = num_index_heads * topk
    return 4 * index_dim * (entries + -(-entries * block_size // items_of))


def _windows(documents, num_queries: int, num_keys: int, per_query: int):
    """`query_windows.query_windows` with windows whose rows (`per_query` bytes a query) fit
    `query_windows.PARTIAL_BYTES`."""
    window = max(1, query_windows.PARTIAL_BYTES // max(1, per_query))
    return query_windows.query_windows(documents, num_queries, num_keys, window)


def _window_schedule(window_indices, window, num_keys, block_size, items_of: int, plan):
    """The schedule of one window of queries in items of `items_of` entries: `plan`'s (a window
    holding every query; as `torch_msa.plan.kernels.schedule_for` takes it) re-cut, or a new one."""
    if plan is None:
        return plan_schedule(window_indices, window, num_keys, block_size, items_of)
    return with_items(schedule_for(window_indices, window, num_keys, block_size, window_indices.shape[0], plan),
                      items_of)


def _windowed(partials: ForwardPartials, block_indices, documents, num_keys, block_size, items_of, index_dim, plan):
    """Per window of queries (`_windows`, sized for `items_of` entries per item), yields
    `(start, stop, window_partials, *_workspaces(...))`; the window's partials are copied into
    `partials` once the caller is done with it. A single window walks `plan` (as
    `torch_msa.plan.kernels.schedule_for` takes it) in items of `items_of`; several windows build
    a schedule each."""
    num_index_heads, num_queries, topk = block_indices.shape
    per_query = partial_bytes_per_query(num_index_heads, topk, index_dim, block_size, items_of)
    for start, stop, window in _windows(documents, num_queries, num_keys, per_query):
        whole = stop - start == num_queries
        window_partials = partials if whole else forward_partials(num_index_heads, stop - start, topk,
                                                                  block_indices.device)
        window_indices = block_indices[:, start:stop].contiguous()
        schedule = _window_schedule(window_indices, window, num_keys, block_size, items_of, plan if whole else None)
        yield (start, stop, window_partials, *_workspaces(schedule, num_index_heads, stop - start, topk, block_size,
                                                          index_dim))
        if not whole:
            for full, part in zip(partials, window_partials, strict=True):
                full[:, start:stop] = part


def _workspaces(schedule, num_index_heads, num_queries, topk, block_size, index_dim):
    """`(schedule, bucket_first_item, entry_rows [Tq, Hi, topk, Di] zeroed, item_rows
    [max_items * block_size, Di])`, fp32 rows."""
    device = schedule.entry_query.device
    entry_rows = torch.zeros((num_queries, num_index_heads, topk, index_dim), dtype=torch.float32, device=device)
    item_rows = uninitialized((schedule.item_start.numel() * block_size, index_dim), dtype=torch.float32, device=device)
    return schedule, bucket_first_items(schedule), entry_rows, item_rows


def _key_sums(item_rows, schedule, bucket_first_item, items_of, num_keys, num_index_heads, topk, block_size):
    """`[Tk, 1, Di]` fp32: the item rows summed per key in item order, then over the heads."""
    per_head = torch.zeros((num_keys, num_index_heads, item_rows.shape[-1]), dtype=torch.float32,
                           device=item_rows.device)
    shape_key = (item_rows.device, item_rows.shape[-1], block_size, topk)
    reduce_item_rows(schedule, items_of, bucket_first_item, (item_rows,), (per_head,), topk, block_size, shape_key)
    return per_head.sum(1, keepdim=True)


def indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale, index_softmax_scale,
               plan=None):
    """Same contract as `torch_msa.reference_index_loss.indexer_kl` (sparse support, `lse` given), bitwise
    reproducible. `plan`: the step's plan, walked when one window holds every query."""
    check_inputs(lse is not None, index_q)
    num_queries, num_heads, _ = q.shape
    num_keys, num_kv_heads, _ = k.shape
    num_index_heads, index_dim = index_q.shape[1:]
    topk = block_indices.shape[-1]
    device = q.device
    lse = lse.contiguous()
    partials = forward_partials(num_index_heads, num_queries, topk, device)
    teacher_index_keys = torch.zeros((num_queries, num_index_heads, index_dim), dtype=torch.float32, device=device)
    teacher_index_queries = torch.zeros((num_keys, 1, index_dim), dtype=torch.float32, device=device)
    if num_queries > 0 and num_keys > 0 and topk > 0:
        q, k, index_q, index_k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, index_q, index_k))
        items_of = forward_entries_per_item(num_heads, num_kv_heads)
        for start, stop, window_partials, schedule, bucket_first_item, entry_rows, item_rows in _windowed(
                partials, block_indices, documents, num_keys, block_size, items_of, index_dim, plan):
            launch_forward(q[start:stop], k, lse[start:stop], index_q[start:stop], index_k, window_partials,
                           (entry_rows, item_rows), schedule, topk, block_size, softmax_scale, index_softmax_scale,
                           deterministic=True)
            teacher_index_keys[start:stop] = entry_rows.sum(2)
            # Windows in turn: a fixed order.
            teacher_index_queries += _key_sums(item_rows, schedule, bucket_first_item, items_of, num_keys,
                                               num_index_heads, topk, block_size)
    loss, index_lse, mass = finish_forward(partials, loss_dtype(index_q.dtype))
    return loss, lse.clone(), index_lse, mass, teacher_index_keys, teacher_index_queries


def indexer_kl_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                        teacher_index_queries, block_indices, documents, block_size, index_softmax_scale, plan=None):
    """Same contract as `torch_msa.reference_index_loss.indexer_kl_backward` (sparse support), bitwise
    reproducible. `plan`: the step's plan, walked when one window holds every query."""
    check_inputs(True, index_q)
    num_queries, num_index_heads, index_dim = index_q.shape
    num_keys = index_k.shape[0]
    topk = block_indices.shape[-1]
    scale = coefficient_scale(index_softmax_scale, num_queries, num_index_heads)
    coefficient = grad_loss.float() * scale
    # d = c * (student - teacher); the kernel stores the student's half.
    d_index_q = teacher_index_keys.float() * -coefficient
    d_index_k = teacher_index_queries.float() * -coefficient
    if num_queries > 0 and num_keys > 0 and topk > 0:
        index_q, index_k = (x if x.stride(-1) == 1 else x.contiguous() for x in (index_q, index_k))
        student_lse, mass = index_lse.float().contiguous(), teacher_mass.float().contiguous()
        items_of = backward_entries_per_item(num_index_heads)
        per_query = partial_bytes_per_query(num_index_heads, topk, index_dim, block_size, items_of)
        for start, stop, window in _windows(documents, num_queries, num_keys, per_query):
            window_indices = block_indices[:, start:stop].contiguous()
            schedule = _window_schedule(window_indices, window, num_keys, block_size, items_of,
                                        plan if stop - start == num_queries else None)
            schedule, bucket_first_item, entry_rows, item_rows = _workspaces(
                schedule, num_index_heads, stop - start, topk, block_size, index_dim)
            launch_backward(index_q[start:stop], index_k, student_lse[start:stop], mass[start:stop], (grad_loss, scale),
                            (entry_rows, item_rows), schedule, topk, block_size, index_softmax_scale,
                            deterministic=True)
            d_index_q[start:stop] += entry_rows.sum(2)
            # Windows in turn: a fixed order.
            d_index_k += _key_sums(item_rows, schedule, bucket_first_item, items_of, num_keys, num_index_heads, topk,
                                   block_size)
    return d_index_q.to(index_q.dtype), d_index_k.to(index_k.dtype)


def index_loss_from_teacher(teacher, grad_loss, index_q, index_k, block_indices, documents, block_size,
                            index_softmax_scale, plan=None):
    """Same contract as `torch_msa.reference_index_loss.index_loss_from_teacher`, bitwise reproducible."""
    if grad_loss is None:
        return sparse.index_loss_from_teacher(teacher, None, index_q, index_k, block_indices, documents, block_size,
                                                 index_softmax_scale, plan)
    check_inputs(True, index_q)
    num_queries, num_index_heads, index_dim = index_q.shape
    num_keys = index_k.shape[0]
    topk = block_indices.shape[-1]
    device = index_q.device
    partials = forward_partials(num_index_heads, num_queries, topk, device)
    scale = coefficient_scale(index_softmax_scale, num_queries, num_index_heads)
    d_index_q = torch.zeros((num_queries, num_index_heads, index_dim), dtype=torch.float32, device=device)
    d_index_k = torch.zeros((num_keys, 1, index_dim), dtype=torch.float32, device=device)
    if num_queries > 0 and num_keys > 0 and topk > 0:
        index_q, index_k = (x if x.stride(-1) == 1 else x.contiguous() for x in (index_q, index_k))
        teacher = teacher.contiguous()
        items_of = backward_entries_per_item(num_index_heads)
        for start, stop, window_partials, schedule, bucket_first_item, entry_rows, item_rows in _windowed(
                partials, block_indices, documents, num_keys, block_size, items_of, index_dim, plan):
            window_teacher, window_index_q = teacher[start:stop], index_q[start:stop]
            launch_forward_from_teacher(window_teacher, window_index_q, index_k, window_partials, schedule, topk,
                                        block_size, index_softmax_scale)
            _, student_lse, mass = finish_forward(window_partials, torch.float32)
            launch_backward(window_index_q, index_k, student_lse, mass, (grad_loss, scale), (entry_rows, item_rows), schedule,
                            topk, block_size, index_softmax_scale, deterministic=True, teacher=window_teacher)
            d_index_q[start:stop] = entry_rows.sum(2)
            # Windows in turn: a fixed order.
            d_index_k += _key_sums(item_rows, schedule, bucket_first_item, items_of, num_keys, num_index_heads, topk,
                                   block_size)
    loss, _, _ = finish_forward(partials, loss_dtype(index_q.dtype))
    return loss, d_index_q.to(index_q.dtype), d_index_k.to(index_k.dtype)
