"""The plan: one step's key-to-query schedule, built once and read by every op of the step.

`msa::plan` builds the KV-outer schedule (`torch_msa.schedule.Schedule`) of one layer's
`block_indices` and returns it as one flat int32 tensor; `msa::forward` and `msa::backward` take
it as their optional `plan` argument, so a training step builds the schedule once per layer
instead of once per op call (the public API does this, and autograd saves the plan for the
backward). Without a plan a backend builds the schedule itself.

Layout: the `Schedule` fields, in field order, back to back:

    entry_query [N] | bucket_ptr [MB + 1] | bucket_head, bucket_key_row, bucket_block [MB] each |
    item_bucket, item_start, item_end [MI] each | position [Tq] | num_buckets [1] | num_items [1]

with `N = Hkv * Tq * topk`, `MB = max_buckets(...)` and `MI = max_items(N, MB, entries_per_item)`.
Every size but `MI` follows from the shapes of the op's own arguments, and `MI` from the plan's
length, so a consumer splits the plan without being told `entries_per_item` and without a host
sync. The item size only bounds the work of one program; every kernel walks an item of any size.

A plan is opaque: pass what `msa::plan` returned for the same arguments. Its length is checked
against the shapes on every call and at trace time. Its values are trusted by the kernels: a
plan of the same shapes built for another selection or other documents (a stale plan) is
detected by `torch_msa.validation.check_plan_values`, which `TORCH_MSA_DEBUG=1` and `torch_msa.validate_inputs` run
(a host sync); without them the kernels compute the plan's own selection. A hand-made plan is
not a supported input.
"""

from collections.abc import Sequence

import torch

from .schedule import Schedule, max_buckets, max_items

ITEM_ROWS = 2048
"""Query rows (tokens x query heads of a KV head) per schedule item in the plans the public API
builds: 16 tiles of 128 rows, enough to amortise a program's K/V load, small enough that a block
every query chose is spread over many programs."""


def entries_per_item(num_heads: int, num_kv_heads: int) -> int:
    """Entries (query tokens) per item for `Hq` query heads over `Hkv` KV heads: `ITEM_ROWS` rows,
    counting the group of `Hq / Hkv` heads padded to a power of two as the kernels' tiles do."""
    group = max(1, num_heads // max(1, num_kv_heads))
    return max(1, ITEM_ROWS // (1 << (group - 1).bit_length()))


def section_sizes(block_shape: Sequence, num_keys, num_docs, block_size, num_items) -> list:
    """Lengths of the plan's sections (the `Schedule` fields in order); ints or SymInts.

    Args:
        block_shape: `[Hkv, Tq, topk]`, the shape of `block_indices`.
        num_keys: `Tk`; num_docs: `B`; block_size: keys per block.
        num_items: `MI`, the item rows of the plan.
    """
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
    """The `Schedule` views of `plan`, which must have been built for these arguments.

    Raises:
        ValueError: the plan's length does not fit `block_indices`, `num_keys`, `num_docs` and
            `block_size` (a plan of another layer shape or another batch).
    """
    rows = item_rows(plan.numel(), block_indices.shape, num_keys, num_docs, block_size)
    if rows is None:
        raise ValueError(length_error(plan.numel(), list(block_indices.shape), num_keys, num_docs, block_size))
    plan = plan if plan.is_contiguous() else plan.contiguous()  # the kernels index the tables densely
    return Schedule(*plan.split_with_sizes(section_sizes(block_indices.shape, num_keys, num_docs, block_size, rows)))
