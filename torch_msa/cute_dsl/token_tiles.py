"""Token boxes: how the SM90 and SM100 kernels load a query-side operand tile one token at a time.

A `[T, Hq, 128]` tensor viewed as `[T * Hq, 128]` rows holds a token's 16 heads of one KV head in
16 consecutive rows, one *token box*. An operand tile of `rows` rows (64 on SM90, 128 on SM100)
holds `rows / 16` tokens, each in its 16-row *slot*, so a tile is filled by one TMA copy per token.

Device code: this module imports cutlass at the top, and only kernel modules import it.
"""

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

BOX_ROWS = 16  # query heads per KV head: the rows of one token box
BOX_COLS = 128  # head dim


def token_slots(tile: cute.Tensor, rows: int, stages: int) -> cute.Tensor:
    """A staged `rows x 128` MMA operand tile as `(16, 128, rows / 16, 1, stage)`: its token slots.

    The colexicographic index of an operand tile is `row + rows * col + rows * 128 * stage`
    (the swizzle is inside the layout's atoms), so this composition is its plain (row, col, stage)
    view."""
    plain = cute.composition(tile, cute.make_layout((rows, BOX_COLS, stages), stride=(1, rows, rows * BOX_COLS)))
    return cute.flat_divide(plain, (BOX_ROWS, BOX_COLS))


def token_tile_partition(atom: cute.CopyAtom, view: cute.Tensor, tile: cute.Tensor, rows: int, stages: int):
    """The TMA partition of a staged `rows x 128` tile's token slots against the 16-row token blocks
    of `view` (a `[R, 128]` TMA view): `(slots, blocks)`, indexed `slots[None, slot, 0, stage]` and
    `blocks[None, block, 0]`."""
    blocks = cute.flat_divide(view, (BOX_ROWS, BOX_COLS))  # (16, 128, R / 16, 1)
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(token_slots(tile, rows, stages), 0, 2),
        cute.group_modes(blocks, 0, 2),
    )
