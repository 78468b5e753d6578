"""The TMA of the SM90 kernels' tiles (K/V key blocks, 16 x 128 token boxes), the loads that fill a
pipeline stage, and the wgmma accumulator layouts. Loaders return the state they advance (README.md).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from ..cute_dsl import token_tiles
from .common import BLOCK_SIZE, HEAD_DIM, HEADS_PER_KV, TILE_ROWS, TOKENS_PER_TILE

SWIZZLE_COLS = 64  # elements of one 128-byte swizzle row (16-bit types)


def accumulator_rows_cols(layout: cute.Layout) -> cute.Layout:
    """One thread's wgmma accumulator `((2, 2, N / 8), M, N)` as (rows, cols)."""
    flat = cute.make_layout(layout.shape)
    rows = ((flat.shape[0][1], flat.shape[1]), (flat.stride[0][1], flat.stride[1]))
    cols = (
        (flat.shape[0][0], flat.shape[0][2], flat.shape[2]),
        (flat.stride[0][0], flat.stride[0][2], flat.stride[2]),
    )
    return cute.composition(layout, cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1])))


def accumulator_as_operand_a(layout: cute.Layout) -> cute.Layout:
    """The accumulator `((2, 2, N / 8), M, N)` as the register A operand `((2, 2, 2), M, N / 16)` of
    a wgmma whose K is that N."""
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
    """One token (16 rows) of a 64 x 128 K-major 128-byte-swizzled `tile_layout`: swizzle atoms of
    8 x 64 down the rows, then across the two 64-column halves (two TMA boxes)."""
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
    """TMA keys `key_row .. key_row + 127` of `kv_head` (zeros past the packed keys) into stage
    `stage` of `tile`, completing on `barrier`."""
    rows = cute.domain_offset((key_row, 0), tma_rows[None, None, kv_head])
    block = cute.local_tile(rows, (BLOCK_SIZE, HEAD_DIM), (0, 0))
    tile_smem, tile_gmem = cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1), cute.group_modes(tile, 0, 2), cute.group_modes(block, 0, 2)
    )
    cute.copy(tma_atom, tile_gmem, tile_smem[None, stage], tma_bar_ptr=barrier)


@cute.jit
def load_token_tile(load_pipeline, state, copies, items, item, first: Int32, num_kv_heads: cutlass.Constexpr[int]):
    """Fill the next stage with the tile at `item`'s entry `first`: per `(atom, token blocks, slots)`
    of `copies`, one TMA box per token. Called by all of warp 0 (a TMA copy elects a lane of a
    converged warp). Returns the advanced `state`."""
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
    """`load_token_tile` of the tile after `tile` (at entry `first`), if `item` has one. Returns `state`."""
    if tile + 1 < item.num_tiles:
        state = load_token_tile(load_pipeline, state, copies, items, item, first + TOKENS_PER_TILE, num_kv_heads)
    return state


@cute.jit
def load_key_blocks(load_pipeline, state, copies, item):
    """Fill the next stage with `item`'s key block per `(atom, view, tile)` of `copies` (K and V).
    Called by all of warp 0. Returns the advanced `state`."""
    load_pipeline.producer_acquire(state)
    barrier = load_pipeline.producer_get_barrier(state)
    for atom, rows, tile in copies:
        load_key_block(atom, rows, tile, state.index, item.kv_head, item.key_row, barrier)
    state.advance()
    return state


def key_block_tma(mK: cute.Tensor, mV: cute.Tensor, key_tile_layout: cute.ComposedLayout, num_kv_heads: int):
    """`((atom_K, view_K), (atom_V, view_V))` over `(key, dim, kv head)` views, one 128 x 128 box per
    key block, and the bytes both boxes write."""
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
    """The TMA atom and view of `[R, 128]` `rows` for `operation` (load or store) in token boxes."""
    return cpasync.make_tiled_tma_atom(operation, rows, token_layout, (HEADS_PER_KV, HEAD_DIM))


def query_rows(mX: cute.Tensor, num_heads: int) -> cute.Tensor:
    """A `[T, Hq, 128]` tensor as `[T * Hq, 128]` rows (16 consecutive rows: one token box)."""
    return cute.make_tensor(mX.iterator, cute.make_layout((mX.shape[0] * num_heads, HEAD_DIM), stride=(HEAD_DIM, 1)))
