"""What the SM90 forward and backward kernels share about their tiles: wgmma accumulators seen as
(rows, cols) or reused as a register A operand, the per-token TMA boxes of a 64-row operand
tile, and the TMA loads of a key block and of a tile's token boxes.

The loads advance the pipeline state whose stage they fill and return it, and the kernels assign
it back (`state = load_token_tile(..., state, ...)`): the CuTe DSL carries a value out of a
run-time branch or loop only where the kernel's own code writes to it (an assignment, or a
method call on it), so a state advanced inside a called function alone would be lost.

These are device code, so this module imports cutlass at the top; only the kernel modules
(`forward_kernel.py`, `backward_kernel.py`) import it. The constants are `common.py`'s, the
module the host side reads them from too.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from ..cute_dsl import token_tiles
from .common import BLOCK_SIZE, HEAD_DIM, HEADS_PER_KV, TILE_ROWS, TOKENS_PER_TILE

SWIZZLE_COLS = 64  # elements of one 128-byte swizzle row (16-bit types)


def accumulator_rows_cols(layout: cute.Layout) -> cute.Layout:
    """The wgmma accumulator `((2, 2, N / 8), M, N)` viewed as (rows, cols) of one thread:
    mode 0 of the value mode pairs adjacent columns, mode 1 picks row r or r + 8."""
    flat = cute.make_layout(layout.shape)
    rows = ((flat.shape[0][1], flat.shape[1]), (flat.stride[0][1], flat.stride[1]))
    cols = (
        (flat.shape[0][0], flat.shape[0][2], flat.shape[2]),
        (flat.stride[0][0], flat.stride[0][2], flat.stride[2]),
    )
    return cute.composition(layout, cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1])))


def accumulator_as_operand_a(layout: cute.Layout) -> cute.Layout:
    """The accumulator layout `((2, 2, N / 8), M, N)` as the register A operand of a wgmma whose
    K is that N: `((2, 2, 2), M, N / 16)` (each K = 16 step takes two 8-column groups)."""
    split = cute.logical_divide(layout, ((None, None, 2), None, None))
    return cute.make_layout(
        (
            (split.shape[0][0], split.shape[0][1], split.shape[0][2][0]),
            split.shape[1],
            (split.shape[0][2][1], split.shape[2]),
        ),
        stride=(
            (split.stride[0][0], split.stride[0][1], split.stride[0][2][0]),
            split.stride[1],
            (split.stride[0][2][1], split.stride[2]),
        ),
    )


def token_box_layout(tile_layout: cute.ComposedLayout) -> cute.ComposedLayout:
    """One token (16 rows) of a 64 x 128 K-major tile with the 128-byte swizzle (`tile_layout`, a
    `make_smem_layout_a/b` result): the swizzle atom is 8 rows of 64 elements, repeated down the
    rows (stride 512) and then across the two 64-column halves (stride 64 * 64); the TMA writes
    or reads it as two 16 x 64 boxes."""
    return cute.make_composed_layout(
        tile_layout.inner,
        0,
        cute.make_layout(
            ((8, 2), (SWIZZLE_COLS, 2)), stride=((SWIZZLE_COLS, 8 * SWIZZLE_COLS), (1, TILE_ROWS * SWIZZLE_COLS))
        ),
    )


@cute.jit
def load_key_block(
    tma_atom: cute.CopyAtom, tma_rows: cute.Tensor, tile: cute.Tensor, stage: Int32, kv_head: Int32, key_row: Int32,
    barrier,
):
    """One TMA box into stage `stage` of the staged (key, dim, stage) `tile`: keys `key_row ..
    key_row + 127` of `kv_head` from the `(key, dim, kv head)` TMA view `tma_rows` (past the packed
    keys: zeros), completing on `barrier`."""
    rows = cute.domain_offset((key_row, 0), tma_rows[None, None, kv_head])
    block = cute.local_tile(rows, (BLOCK_SIZE, HEAD_DIM), (0, 0))
    tile_smem, tile_gmem = cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1), cute.group_modes(tile, 0, 2), cute.group_modes(block, 0, 2)
    )
    cute.copy(tma_atom, tile_gmem, tile_smem[None, stage], tma_bar_ptr=barrier)


@cute.jit
def load_token_tile(load_pipeline, state, copies, items, item, first: Int32, num_kv_heads: cutlass.Constexpr[int]):
    """Acquire stage `state.index` of `load_pipeline`, fill it with the tile of `item`'s entries
    `first .. first + 3` (`items.tile_entry`: slots past the item's end repeat the first), and
    advance `state`: for each `(atom, token blocks, slots)` of `copies`, one TMA box per token, its
    16 heads of the item's KV head (block `token * num_kv_heads + kv_head` of the `[T * Hq / 16]`
    token blocks) into the slot's 16 rows. All of warp 0 calls it: a TMA copy elects one lane of
    a converged warp. Returns `state` (the module docstring says why)."""
    load_pipeline.producer_acquire(state)
    barrier = load_pipeline.producer_get_barrier(state)
    for slot in cutlass.range_constexpr(TOKENS_PER_TILE):
        block = items.token(items.tile_entry(first, slot, item.end)) * num_kv_heads + item.kv_head
        for atom, blocks, slots in copies:
            cute.copy(atom, blocks[None, block, 0], slots[None, slot, 0, state.index], tma_bar_ptr=barrier)
    state.advance()
    return state


@cute.jit
def load_next_tile(
    load_pipeline, state, copies, items, item, tile: Int32, first: Int32, num_kv_heads: cutlass.Constexpr[int]
):
    """`load_token_tile` of the tile after tile `tile` of `item` (entries `first ..`), when the
    item has one. Returns `state`."""
    if tile + 1 < item.num_tiles:
        state = load_token_tile(load_pipeline, state, copies, items, item, first + TOKENS_PER_TILE, num_kv_heads)
    return state


@cute.jit
def load_key_blocks(load_pipeline, state, copies, item):
    """Acquire stage `state.index` of `load_pipeline`, fill it with one key block per `(atom,
    TMA view, tile)` of `copies` (K and V): keys `key_row .. key_row + 127` of `item`'s KV head,
    and advance `state`. All of warp 0 calls it. Returns `state` (the module docstring says why)."""
    load_pipeline.producer_acquire(state)
    barrier = load_pipeline.producer_get_barrier(state)
    for atom, rows, tile in copies:
        load_key_block(atom, rows, tile, state.index, item.kv_head, item.key_row, barrier)
    state.advance()
    return state


def key_block_tma(mK: cute.Tensor, mV: cute.Tensor, key_tile_layout: cute.ComposedLayout, num_kv_heads: int):
    """The TMA atoms and views of K and V `[Tk, Hkv, 128]` as `(key, dim, kv head)`, one 128 x 128
    box per key block into one stage of `key_tile_layout`: `((atom_K, view_K), (atom_V, view_V))`
    and the bytes both boxes write."""
    layout = cute.make_layout((mK.shape[0], HEAD_DIM, num_kv_heads), stride=(num_kv_heads * HEAD_DIM, 1, HEAD_DIM))
    stage = cute.select(key_tile_layout, mode=[0, 1])
    atoms = tuple(
        cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), cute.make_tensor(tensor.iterator, layout), stage, (BLOCK_SIZE, HEAD_DIM)
        )
        for tensor in (mK, mV)
    )
    return atoms, 2 * cute.size_in_bytes(mK.element_type, stage)


def token_tile_partition(atom: cute.CopyAtom, view: cute.Tensor, tile: cute.Tensor, stages: int):
    """`torch_msa.cute_dsl.token_tiles.token_tile_partition` of a staged 64-row tile."""
    return token_tiles.token_tile_partition(atom, view, tile, TILE_ROWS, stages)


def token_rows_tma(operation, rows: cute.Tensor, token_layout: cute.ComposedLayout):
    """The TMA atom and view of `rows` (`[R, 128]`) moved by `operation` (a G2S load or S2G store) in
    16 x 128 token boxes laid out as `token_layout` (`token_box_layout`)."""
    return cpasync.make_tiled_tma_atom(operation, rows, token_layout, (HEADS_PER_KV, HEAD_DIM))


def query_rows(mX: cute.Tensor, num_heads: int) -> cute.Tensor:
    """A `[T, Hq, 128]` tensor as `[T * Hq, 128]` rows: a token's 16 heads of one KV head are 16
    consecutive rows, one token box."""
    return cute.make_tensor(mX.iterator, cute.make_layout((mX.shape[0] * num_heads, HEAD_DIM), stride=(HEAD_DIM, 1)))
