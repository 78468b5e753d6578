"""The persistent walk over a plan's items, shared by the SM90 forward and backward kernels.

A plan (`torch_msa/plan/schedule.py`) lists *items*: one KV head's key block (a *bucket*) and a run of
the (query, slot) *entries* that chose it. The grid is persistent: CTA `c` of a grid of `n` takes
items `c, c + n, ...` up to the item count, which it reads on the device (no host sync, so a
launch is CUDA-graph safe). Within an item both kernels take the entries `TOKENS_PER_TILE` at a
time, one token per 16-row slot of a 64-row tile; the slots of a last, partial tile repeat the
tile's first entry, whose rows the kernels then mask or do not write.

Device code: this module imports cutlass at the top, and only the kernel modules import it.
"""

import dataclasses
from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32

from .common import BLOCK_SIZE, TOKENS_PER_TILE, ScheduleOperands


class Item(NamedTuple):
    """What a kernel needs of one item: its entries `start .. end - 1`, in `num_tiles` tiles, and
    its bucket: the KV head, the packed row of the block's key 0, that key's document position,
    and how many of the block's keys lie inside its document (`key_count <= 128`)."""

    start: Int32
    end: Int32
    num_tiles: Int32
    kv_head: Int32
    key_row: Int32
    first_key: Int32
    key_count: Int32


@dataclasses.dataclass(frozen=True)
class ItemScheduler:
    """This CTA's share of the plan's items, and the facts of their entries.

    Made by `ItemScheduler.create`; walk it as
    `for index in cutlass.range(items.first, items.count, items.stride, unroll=1)` and read each
    item with `items.item(index)`. Frozen, so that the CuTe DSL reads it inside run-time loops
    instead of carrying it through them."""

    schedule: ScheduleOperands
    topk: Int32
    first: Int32
    stride: Int32
    count: Int32

    @staticmethod
    def create(schedule: ScheduleOperands, topk: Int32) -> "ItemScheduler":
        return ItemScheduler(
            schedule, topk, cute.arch.block_idx()[0], cute.arch.grid_dim()[0], schedule.num_items[0]
        )

    def item(self, index: Int32) -> Item:
        schedule = self.schedule
        start = schedule.item_start[index]
        end = schedule.item_end[index]
        bucket = schedule.item_bucket[index]
        return Item(
            start=start,
            end=end,
            num_tiles=(end - start + TOKENS_PER_TILE - 1) // TOKENS_PER_TILE,
            kv_head=schedule.bucket_head[bucket],
            key_row=schedule.bucket_key_row[bucket],
            first_key=schedule.bucket_block[bucket] * BLOCK_SIZE,
            key_count=schedule.bucket_key_count[bucket],
        )

    @cute.jit
    def tile_entry(self, first: Int32, slot: Int32, end: Int32) -> Int32:
        """The entry in slot `slot` of the tile that starts at entry `first`: the item's entry
        `first + slot`, or `first` for a slot past the item's end."""
        entry = first + slot
        if entry >= end:
            entry = first
        return entry

    def token_and_slot(self, entry: Int32) -> tuple[Int32, Int32]:
        """The query token of `entry` and the slot (0 .. topk - 1) of its selection it fills."""
        query = self.schedule.entry_query[entry]
        token = query // self.topk
        return token, query - token * self.topk

    def token(self, entry: Int32) -> Int32:
        return self.schedule.entry_query[entry] // self.topk

    def last_visible_key(self, token: Int32, item: Item) -> Int32:
        """The last key of `item`'s block that `token` sees (block-local; keys past it are
        hidden): its document position minus the block's first."""
        return self.schedule.position[token] - item.first_key
