"""The base of the SM90 blocks kernels: what both build alike (wgmmas, operand tiles, TMA, storage).
Their `cute.jit` host functions take q, k, v, their own tensors, the schedule (`ScheduleOperands`),
topk, scale_log2, their own scalars, the grid size and the stream (`common.blocks_operands` order).
"""

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..cute_dsl.compat import LayoutEnum
from .common import HEADS_PER_KV, ScheduleOperands
from .pipeline import tma_load_pipeline
from .tma import key_block_tma, query_rows, token_box_layout, token_rows_tma

K_MAJOR = cute.nvgpu.OperandMajorMode.K
MN_MAJOR = cute.nvgpu.OperandMajorMode.MN


def thread_and_warp():
    """This thread's index in the CTA and its warp's index, made warp-uniform."""
    tidx, _, _ = cute.arch.thread_idx()
    return tidx, cute.arch.make_warp_uniform(cute.arch.warp_idx())


class BlocksKernel:
    """A blocks kernel for `num_kv_heads` KV heads, fp32 accumulators. The host function sets `dtype`
    first and keeps `make_shared_storage`'s struct as `shared_storage`; `key_and_query_tma` sets
    `kv_bytes` for `load_pipelines`."""

    acc_dtype = Float32
    dtype: type

    def __init__(self, num_kv_heads: int):
        self.num_kv_heads = num_kv_heads
        self.num_heads = HEADS_PER_KV * num_kv_heads

    @staticmethod
    def split_schedule(arguments: tuple) -> tuple[ScheduleOperands, tuple]:
        """The host function's arguments after its own tensors as (the schedule, the rest)."""
        count = len(ScheduleOperands._fields)
        return ScheduleOperands(*arguments[:count]), tuple(arguments[count:])

    def tiled_mma(self, b_major, atom_layout: tuple, tiler: tuple, a_source=warpgroup.OperandSource.SMEM):
        """A wgmma of `dtype` into fp32 over the (M, N) `tiler` on `atom_layout` warpgroups: A K-major
        (shared memory, or registers with `a_source` RMEM), B `b_major`."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, b_major, self.acc_dtype, atom_layout, tiler, a_source
        )

    def operand_a_tiles(self, tiler: tuple, stages: int):
        """`(M, K, stages)` swizzled K-major shared-memory tiles of a wgmma's A operand."""
        return sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tiler, self.dtype, stages)

    def operand_b_tiles(self, tiler: tuple, stages: int):
        """`(N, K, stages)` swizzled K-major shared-memory tiles of a wgmma's B operand."""
        return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tiler, self.dtype, stages)

    def key_and_query_tma(self, mK: cute.Tensor, mV: cute.Tensor, mQ: cute.Tensor, sK_layout, sQ_layout):
        """TMA loads of K/V key blocks into `sK_layout` stages (sets `kv_bytes`) and of Q's token boxes:
        `(atom_K, view_K), (atom_V, view_V), (atom_Q, view_Q), token_layout` (`tma.token_box_layout`)."""
        (key_tma, value_tma), self.kv_bytes = key_block_tma(mK, mV, sK_layout, self.num_kv_heads)
        token_layout = token_box_layout(sQ_layout)
        return key_tma, value_tma, self.query_tma(mQ, token_layout), token_layout

    def query_tma(self, mX: cute.Tensor, token_layout):
        """The TMA load of a `[T, Hq, 128]` tensor's token boxes as `token_layout`."""
        return token_rows_tma(cpasync.CopyBulkTensorTileG2SOp(), query_rows(mX, self.num_heads), token_layout)

    def make_shared_storage(self, tiles: dict, fields: dict, kv_stages: int, tile_stages: int):
        """The kernel's shared-memory `cute.struct`: a `dtype` tile per `tiles` entry (1024-byte
        aligned, for the 128-byte swizzle), the other `fields`, then the K/V and token-tile
        pipelines' barriers last, so no alignment padding precedes the tiles."""
        members = {
            name: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
            for name, layout in tiles.items()
        }
        members.update(fields)
        members["kv_barriers"] = cute.struct.MemRange[Int64, 2 * kv_stages]
        members["tile_barriers"] = cute.struct.MemRange[Int64, 2 * tile_stages]
        return cute.struct(type("SharedStorage", (), {"__annotations__": members}))

    @cute.jit
    def load_pipelines(self, storage, tidx, atoms: tuple, kv: tuple, tiles: tuple):
        """Prefetch `atoms`' TMA descriptors and return `(kv_pipeline, tile_pipeline)` on `storage`'s
        barriers, initialised and visible to every thread. `kv = (stages, consumer warps)`;
        `tiles = (stages, bytes per stage, consumer warps)`."""
        if tidx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        kv_stages, kv_consumer_warps = kv
        tile_stages, tile_bytes, tile_consumer_warps = tiles
        kv_pipeline = tma_load_pipeline(storage.kv_barriers.data_ptr(), kv_stages, self.kv_bytes, kv_consumer_warps)
        tile_pipeline = tma_load_pipeline(
            storage.tile_barriers.data_ptr(), tile_stages, tile_bytes, tile_consumer_warps
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        return kv_pipeline, tile_pipeline
