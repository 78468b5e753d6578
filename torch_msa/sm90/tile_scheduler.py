"""The persistent walk over a plan's items in the SM90 kernels: CTA `c` of `n` takes items
`c, c + n, ...`, the item count read on the device (no host sync).
"""

import dataclasses
from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32

from .common import BLOCK_SIZE, TOKENS_PER_TILE, ScheduleOperands


class Item(NamedTuple):
    """One item: entries `start .. end - 1` in `num_tiles` tiles; its bucket's KV head, packed row and
    document position of key 0, and keys inside the document (`key_count <= 128`)."""

    start: Int32
    end: Int32
    num_tiles: Int32
    kv_head: Int32
    key_row: Int32
    first_key: Int32
    key_count: Int32


@dataclasses.dataclass(frozen=True)
class ItemScheduler:
    """This CTA's items: `for index in cutlass.range(items.first, items.count, items.stride)`, then
    `items.item(index)`. Frozen, so the CuTe DSL does not carry it through run-time loops."""

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
        """Entry `first + slot`, or `first` for a slot past the item's end."""
        entry = first + slot
        if entry >= end:
            entry = first
        return entry

    def token_and_slot(self, entry: Int32) -> tuple[Int32, Int32]:
        """`(token, slot)` of `entry`: its query token and selection slot."""
        query = self.schedule.entry_query[entry]
        token = query // self.topk
        return token, query - token * self.topk

    def token(self, entry: Int32) -> Int32:
        return self.schedule.entry_query[entry] // self.topk

    def last_visible_key(self, token: Int32, item: Item) -> Int32:
        """The last block-local key of `item` that `token` sees."""
        return self.schedule.position[token] - item.first_key
