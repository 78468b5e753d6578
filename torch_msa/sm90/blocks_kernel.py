"""The base of the SM90 blocks kernels (`forward_kernel.py`, `backward_kernel.py`).

Both are KV-outer kernels over the step's plan for `num_kv_heads` KV heads of 16 query heads each,
with fp32 accumulators. Their `cute.jit` host functions take the same argument list around their
own tensors: first q `[Tq, Hq, 128]`, k and v `[Tk, Hkv, 128]`, then their own tensors, then the
schedule's tensors in `ScheduleOperands` order, then the scalars topk and scale_log2, their own
scalars and the grid size, the stream last (the order `common.blocks_operands` describes and
`common.launch` passes them in).

What the base holds is what both build the same way: their wgmmas (`tiled_mma`) and the
shared-memory tiles of their operands (`operand_a_tiles`, `operand_b_tiles`), the TMA of the
K/V key blocks and of Q's token boxes (`key_and_query_tma`), the layout of their shared memory
(`make_shared_storage`: the tiles, then the kernel's other fields, then the barriers of the K/V and
the token tile pipelines) and, on the device, the start of the kernel (`thread_and_warp`,
`load_pipelines`).

Device code: this module imports cutlass at the top, and only the kernel modules import it.
"""

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..cute_dsl.compat import LayoutEnum
from .common import HEADS_PER_KV, ScheduleOperands
from .pipeline import tma_load_pipeline
from .tiles import key_block_tma, query_rows, token_box_layout, token_rows_tma

K_MAJOR = cute.nvgpu.OperandMajorMode.K
MN_MAJOR = cute.nvgpu.OperandMajorMode.MN


def thread_and_warp():
    """This thread's index in the CTA and its warp's index, made warp-uniform."""
    tidx, _, _ = cute.arch.thread_idx()
    return tidx, cute.arch.make_warp_uniform(cute.arch.warp_idx())


class BlocksKernel:
    """A blocks kernel for `num_kv_heads` KV heads (`num_heads` query heads), fp32 accumulators.

    The host function sets `dtype` (q's element type) before it calls `tiled_mma`, the
    `operand_*_tiles` or `make_shared_storage`, and keeps the struct the latter returns as
    `shared_storage`, which the kernel allocates; `key_and_query_tma` sets `kv_bytes`, which
    `load_pipelines` reads."""

    acc_dtype = Float32
    dtype: type  # the operands' CuTe element type, set by the host function

    def __init__(self, num_kv_heads: int):
        self.num_kv_heads = num_kv_heads
        self.num_heads = HEADS_PER_KV * num_kv_heads

    @staticmethod
    def split_schedule(arguments: tuple) -> tuple[ScheduleOperands, tuple]:
        """The host function's arguments after its own tensors as (the schedule, the rest)."""
        count = len(ScheduleOperands._fields)
        return ScheduleOperands(*arguments[:count]), tuple(arguments[count:])

    def tiled_mma(self, b_major, atom_layout: tuple, tiler: tuple, a_source=warpgroup.OperandSource.SMEM):
        """A wgmma of `dtype` operands into fp32 over the (M, N) `tiler`, `atom_layout` warpgroups:
        A K-major (from shared memory, or from registers with `a_source` RMEM), B `b_major`
        (`K_MAJOR`, or `MN_MAJOR` for a tile read through a transposed view)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, b_major, self.acc_dtype, atom_layout, tiler, a_source
        )

    def operand_a_tiles(self, tiler: tuple, stages: int):
        """`stages` shared-memory tiles of a wgmma's A operand (`dtype`) for the (M, N, K) `tiler`,
        K-major (row-major) and swizzled: `(M, K, stages)`."""
        return sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tiler, self.dtype, stages)

    def operand_b_tiles(self, tiler: tuple, stages: int):
        """`stages` shared-memory tiles of a wgmma's B operand (`dtype`) for the (M, N, K) `tiler`,
        K-major (row-major) and swizzled: `(N, K, stages)`."""
        return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tiler, self.dtype, stages)

    def key_and_query_tma(self, mK: cute.Tensor, mV: cute.Tensor, mQ: cute.Tensor, sK_layout, sQ_layout):
        """The TMA loads of K and V's key blocks into a stage of `sK_layout` (`tiles.key_block_tma`;
        sets `kv_bytes`, the bytes of both boxes) and of Q's 16 x 128 token boxes into `sQ_layout`
        tiles: `(atom_K, view_K), (atom_V, view_V), (atom_Q, view_Q), token_layout`, where
        `token_layout` (`tiles.token_box_layout`) is one token of any of the kernel's 64-row tiles."""
        (key_tma, value_tma), self.kv_bytes = key_block_tma(mK, mV, sK_layout, self.num_kv_heads)
        token_layout = token_box_layout(sQ_layout)
        return key_tma, value_tma, self.query_tma(mQ, token_layout), token_layout

    def query_tma(self, mX: cute.Tensor, token_layout):
        """The TMA load of a `[T, Hq, 128]` tensor's token boxes (`tiles.query_rows`) as `token_layout`."""
        return token_rows_tma(cpasync.CopyBulkTensorTileG2SOp(), query_rows(mX, self.num_heads), token_layout)

    def make_shared_storage(self, tiles: dict, fields: dict, kv_stages: int, tile_stages: int):
        """The `cute.struct` of the kernel's shared memory, in this order: a `dtype` tile per entry
        of `tiles` (name: staged tile layout), 1024-byte aligned, which keeps the 128-byte swizzle
        pattern of every tile intact; the kernel's other `fields` (name: struct member); then the
        full and empty barriers of the `kv_stages`-stage K/V pipeline (`kv_barriers`) and of the
        `tile_stages`-stage token tile pipeline (`tile_barriers`), last, so that no alignment
        padding precedes the tiles."""
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
        """Thread 0 prefetches the TMA descriptors of `atoms`; then the kernel's two TMA load
        pipelines on `storage`'s barriers (`make_shared_storage`): K/V, `kv = (stages, consumer
        warps)`, each stage `kv_bytes`, and the token tiles, `tiles = (stages, bytes per stage,
        consumer warps)`; a stage is released once each of its consumer warps has arrived.
        Returns `(kv_pipeline, tile_pipeline)` once their barriers are initialised and, after a
        CTA barrier, visible to every thread."""
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
