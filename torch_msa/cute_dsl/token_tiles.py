"""Token boxes: the SM90 and SM100 kernels fill a query-side operand tile one token (16 consecutive
rows of the `[T * Hq, 128]` view) per 16-row slot.
"""

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

BOX_ROWS = 16  # query heads per KV head: the rows of one token box
BOX_COLS = 128  # head dim


def token_slots(tile: cute.Tensor, rows: int, stages: int) -> cute.Tensor:
    """A staged `rows x 128` operand tile as its token slots `(16, 128, rows / 16, 1, stage)`; the
    swizzle is inside the layout's atoms, so the plain (row, col, stage) composition is exact."""
    plain = cute.composition(tile, cute.make_layout((rows, BOX_COLS, stages), stride=(1, rows, rows * BOX_COLS)))
    return cute.flat_divide(plain, (BOX_ROWS, BOX_COLS))


def token_tile_partition(atom: cute.CopyAtom, view: cute.Tensor, tile: cute.Tensor, rows: int, stages: int):
    """`(slots, blocks)`: the TMA partition of `tile`'s token slots against `view`'s 16-row blocks,
    indexed `slots[None, slot, 0, stage]`, `blocks[None, block, 0]`."""
    blocks = cute.flat_divide(view, (BOX_ROWS, BOX_COLS))  # (16, 128, R / 16, 1)
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(token_slots(tile, rows, stages), 0, 2),
        cute.group_modes(blocks, 0, 2),
    )
