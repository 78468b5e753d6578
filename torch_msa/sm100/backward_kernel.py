"""The SM100 (sm_100a) main kernel of the MSA backward in CuTe DSL; its design is in `README.md`.

`dq_accum`, `dk_accum`, `dv_accum` are fp32 and must be zero on entry; dQ and dK are scaled by
`softmax_scale` in fp32 before the atomics. The host side is `backward_host.py`.
"""

import functools
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Boolean, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.cute.nvgpu.common import OperandMajorMode

from ..cute_dsl import token_tiles
from ..cute_dsl.compat import SmemAllocator
from ..cute_dsl.ptx import red_add_f32x4
from .common import BLOCK_SIZE, HEAD_DIM, HEADS_PER_KV, NUM_KV_HEADS, NUM_Q_HEADS, TILE, TOKENS_PER_TASK


class Gemms(NamedTuple):
    """The tcgen05 tiled MMAs of the five GEMMs."""

    s: cute.TiledMma  # S^T = K Q^T
    dp: cute.TiledMma  # dP^T = V dO^T
    dv: cute.TiledMma  # dV += P^T dO (A from TMEM)
    dk: cute.TiledMma  # dK += dS^T Q
    dq: cute.TiledMma  # dQ = dS K


class SharedTiles(NamedTuple):
    """The MMA operand tiles in shared memory, each `(MMA, MMA_M or MMA_N, MMA_K, stages)`: K, V and
    dS^T (one stage), Q (`q_stages`), dO (`do_stages`), then the MN-major views of the same bytes
    that the other GEMMs read (dS over dS^T, K^T over K, Q^T over Q, dO^T over dO)."""

    sK: cute.Tensor
    sV: cute.Tensor
    sQ: cute.Tensor
    sdO: cute.Tensor
    sdSt: cute.Tensor
    sdS: cute.Tensor
    sKt: cute.Tensor
    sQt: cute.Tensor
    sdOt: cute.Tensor


class TmemTiles(NamedTuple):
    """The fp32 accumulators in tensor memory (columns `Sm100BackwardKernel.tmem_*`; dP^T and dQ share
    theirs) and P^T, the bf16 A operand of the dV GEMM over S^T's columns."""

    tS: cute.Tensor
    tdP: cute.Tensor
    tdQ: cute.Tensor
    tdV: cute.Tensor
    tdK: cute.Tensor
    tPt: cute.Tensor


class Tasks(NamedTuple):
    """The task tables (`task_tables.TaskTables`, int32) and the rows `[lo, hi)` of them this CTA walks:
    `meta` `[max_tasks, 4]` rows `(kv_head, aligned_key_row, block_id, num_rows)`, `qrows` and `qpos`
    `[max_tasks, 8]` the query token and the position of each token slot."""

    meta: cute.Tensor
    qrows: cute.Tensor
    qpos: cute.Tensor
    lo: Int32
    hi: Int32


class Sm100BackwardKernel:
    """The SM100 main backward kernel; `__call__` is the `cute.jit` host function."""

    io_dtype = cutlass.BFloat16
    acc_dtype = cutlass.Float32
    mma_tiler = (TILE, TILE, HEAD_DIM)

    compute_warps = tuple(range(8))  # two warpgroups: query-row columns 0-63 and 64-127
    reduce_warps = (8, 9, 10, 11)
    mma_warp = 12
    load_warp = 13
    scalar_warp = 14  # warp 15 idles: it completes the fourth warpgroup
    threads_per_cta = 512
    # setmaxnreg budgets per warpgroup (sum * 128 threads = 64 K registers), so that ptxas spills
    # nothing: MMA warp, five GEMMs' descriptors; reduce, a 128-float row; compute, 64 P + 16 dP.
    compute_registers = 128
    reduce_registers = 144
    misc_registers = 112

    q_stages = 2  # Q is read by S^T and dK; double buffering lets the next tile load early
    do_stages = 1  # shared memory is full: K, V, 2 Q, dO and dS tiles are 192 KiB
    scalar_stages = 2

    # TMEM column offsets of the accumulators (512 columns, fp32).
    tmem_s = 0
    tmem_dp_dq = 128
    tmem_dv = 256
    tmem_dk = 384
    tmem_columns = 512

    # Named barrier ids (0 is __syncthreads).
    compute_barrier_id = 1

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # bf16 [Tq, 64, 128]
        mK: cute.Tensor,  # bf16 [W, 4, 128]
        mV: cute.Tensor,  # bf16 [W, 4, 128]
        mdO: cute.Tensor,  # bf16 [Tq, 64, 128]
        mLSE: cute.Tensor,  # fp32 [Tq, 64]
        mDelta: cute.Tensor,  # fp32 [Tq, 64]
        mTaskMeta: cute.Tensor,  # int32 [max_tasks, 4]
        mTaskQRows: cute.Tensor,  # int32 [max_tasks, 8]
        mTaskQPos: cute.Tensor,  # int32 [max_tasks, 8]
        mNumTasks: cute.Tensor,  # int32 [1]
        mdQ: cute.Tensor,  # fp32 [Tq, 64, 128]
        mdK: cute.Tensor,  # fp32 [W, 4, 128]
        mdV: cute.Tensor,  # fp32 [W, 4, 128]
        grid_size: Int32,
        softmax_scale: Float32,
        stream,
    ):
        bf16 = self.io_dtype
        # Views for the TMAs: q/dO as [Tq * 64 rows, 128] (a token's 16 heads of one kv head
        # are 16 consecutive rows); K/V as (key row, d, kv head) = the (M, K, L) modes of an
        # MMA operand.
        def head_rows(rows: cute.Tensor) -> cute.Tensor:
            layout = cute.make_layout((rows.shape[0] * NUM_Q_HEADS, HEAD_DIM), stride=(HEAD_DIM, 1))
            return cute.make_tensor(rows.iterator, layout)

        q_rows, do_rows = head_rows(mQ), head_rows(mdO)
        kv_layout = cute.make_layout(
            (mK.shape[0], HEAD_DIM, NUM_KV_HEADS), stride=(NUM_KV_HEADS * HEAD_DIM, 1, HEAD_DIM)
        )
        k_mkl = cute.make_tensor(mK.iterator, kv_layout)
        v_mkl = cute.make_tensor(mV.iterator, kv_layout)

        one = tcgen05.CtaGroup.ONE
        tile_mn = self.mma_tiler[:2]
        K_MAJOR, MN_MAJOR = OperandMajorMode.K, OperandMajorMode.MN
        mma_s = sm100_utils.make_trivial_tiled_mma(bf16, bf16, K_MAJOR, K_MAJOR, self.acc_dtype, one, tile_mn)
        mma_dp = sm100_utils.make_trivial_tiled_mma(bf16, bf16, K_MAJOR, K_MAJOR, self.acc_dtype, one, tile_mn)
        mma_dv = sm100_utils.make_trivial_tiled_mma(
            bf16, bf16, K_MAJOR, MN_MAJOR, self.acc_dtype, one, tile_mn, tcgen05.OperandSource.TMEM
        )
        mma_dk = sm100_utils.make_trivial_tiled_mma(bf16, bf16, K_MAJOR, MN_MAJOR, self.acc_dtype, one, tile_mn)
        mma_dq = sm100_utils.make_trivial_tiled_mma(bf16, bf16, MN_MAJOR, MN_MAJOR, self.acc_dtype, one, tile_mn)

        # Shared-memory operand layouts (128-byte swizzle). A K-major (row, k) tile and an
        # MN-major (k, row) view of it address the same bytes, so Q, dO, K and dS each live
        # in one buffer that serves two GEMMs (e.g. Q: B of S^T, and B of dK).
        tiler = self.mma_tiler
        sK_layout = sm100_utils.make_smem_layout_a(mma_s, tiler, bf16, 1)
        sV_layout = sm100_utils.make_smem_layout_a(mma_dp, tiler, bf16, 1)
        sQ_layout = sm100_utils.make_smem_layout_b(mma_s, tiler, bf16, self.q_stages)
        sdO_layout = sm100_utils.make_smem_layout_b(mma_dp, tiler, bf16, self.do_stages)
        sdSt_layout = sm100_utils.make_smem_layout_a(mma_dk, tiler, bf16, 1)
        sdS_layout = sm100_utils.make_smem_layout_a(mma_dq, tiler, bf16, 1)
        sKt_layout = sm100_utils.make_smem_layout_b(mma_dq, tiler, bf16, 1)
        sQt_layout = sm100_utils.make_smem_layout_b(mma_dk, tiler, bf16, self.q_stages)
        sdOt_layout = sm100_utils.make_smem_layout_b(mma_dv, tiler, bf16, self.do_stages)
        tPt_layout = sm100_utils.make_smem_layout_a(mma_dv, tiler, bf16, 1)

        tma_load = cpasync.CopyBulkTensorTileG2SOp(one)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, k_mkl, cute.select(sK_layout, mode=[0, 1, 2]), tiler, mma_s
        )
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, v_mkl, cute.select(sV_layout, mode=[0, 1, 2]), tiler, mma_dp
        )
        # One token slot (16 rows) of the (128 x 128) K-major tile: rows of 64 elements
        # (128 bytes, one swizzle row), and the tile's second 64-column half 128 * 64
        # elements further; the TMA writes it as two 16 x 64 boxes.
        token_rows = cute.make_composed_layout(
            sQ_layout.inner,
            0,
            cute.make_layout(((8, 2), (64, 2)), stride=((64, 8 * 64), (1, TILE * 64))),
        )
        slot_tile = (HEADS_PER_KV, HEAD_DIM)
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(tma_load, q_rows, token_rows, slot_tile)
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(tma_load, do_rows, token_rows, slot_tile)

        self.kv_bytes = 2 * cute.size_in_bytes(bf16, cute.select(sK_layout, mode=[0, 1, 2]))
        self.tile_bytes = cute.size_in_bytes(bf16, cute.select(sQ_layout, mode=[0, 1, 2]))

        scalar_rows = TILE * self.scalar_stages
        slot_rows = TOKENS_PER_TASK * self.scalar_stages

        @cute.struct
        class SharedStorage:
            kv_full_empty: cute.struct.MemRange[Int64, 2]
            q_full_empty: cute.struct.MemRange[Int64, 2 * self.q_stages]
            do_full_empty: cute.struct.MemRange[Int64, 2 * self.do_stages]
            scalar_full_empty: cute.struct.MemRange[Int64, 2 * self.scalar_stages]
            s_full_empty: cute.struct.MemRange[Int64, 2]
            p_full_empty: cute.struct.MemRange[Int64, 2]
            dp_full_empty: cute.struct.MemRange[Int64, 2]
            ds_full_empty: cute.struct.MemRange[Int64, 2]
            dq_full_empty: cute.struct.MemRange[Int64, 2]
            dkdv_full_empty: cute.struct.MemRange[Int64, 2]
            tmem_base: Int32
            lse_log2: cute.struct.Align[cute.struct.MemRange[Float32, scalar_rows], 16]
            delta: cute.struct.Align[cute.struct.MemRange[Float32, scalar_rows], 16]
            qpos: cute.struct.Align[cute.struct.MemRange[Int32, slot_rows], 16]
            qrows: cute.struct.Align[cute.struct.MemRange[Int32, slot_rows], 16]
            # 1024-byte alignment keeps the 128-byte swizzle pattern of every tile intact.
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sdSt_layout)], 1024]

        self.shared_storage = SharedStorage

        self.kernel(
            mma_s, mma_dp, mma_dv, mma_dk, mma_dq,
            tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_Q, tma_Q, tma_atom_dO, tma_dO,
            mLSE, mDelta, mTaskMeta, mTaskQRows, mTaskQPos, mNumTasks, mdQ, mdK, mdV,
            softmax_scale,
            sK_layout, sV_layout, sQ_layout, sdO_layout, sdSt_layout, sdS_layout,
            sKt_layout, sQt_layout, sdOt_layout, tPt_layout,
        ).launch(
            grid=(grid_size, 1, 1),
            block=(self.threads_per_cta, 1, 1),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mma_s: cute.TiledMma,
        mma_dp: cute.TiledMma,
        mma_dv: cute.TiledMma,
        mma_dk: cute.TiledMma,
        mma_dq: cute.TiledMma,
        tma_atom_K: cute.CopyAtom,
        tma_K: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tma_V: cute.Tensor,
        tma_atom_Q: cute.CopyAtom,
        tma_Q: cute.Tensor,
        tma_atom_dO: cute.CopyAtom,
        tma_dO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mTaskMeta: cute.Tensor,
        mTaskQRows: cute.Tensor,
        mTaskQPos: cute.Tensor,
        mNumTasks: cute.Tensor,
        mdQ: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        softmax_scale: Float32,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sdSt_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sKt_layout: cute.ComposedLayout,
        sQt_layout: cute.ComposedLayout,
        sdOt_layout: cute.ComposedLayout,
        tPt_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta = cute.arch.block_idx()[0]
        grid = cute.arch.grid_dim()[0]

        # This CTA's task rows: an even split of the real tasks over the grid.
        num_tasks = mNumTasks[0]
        per_cta = (num_tasks + grid - 1) // grid
        row_lo = cutlass.min(cta * per_cta, num_tasks)
        row_hi = cutlass.min(row_lo + per_cta, num_tasks)
        tasks = Tasks(mTaskMeta, mTaskQRows, mTaskQPos, row_lo, row_hi)

        if warp_idx == self.load_warp:
            for atom in (tma_atom_K, tma_atom_V, tma_atom_Q, tma_atom_dO):
                cpasync.prefetch_descriptor(atom)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        pipes = self._make_pipelines(storage)

        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sdSt = storage.sdS.get_tensor(sdSt_layout.outer, swizzle=sdSt_layout.inner)
        # The second (MN-major) views of the same bytes.
        sdS = cute.make_tensor(cute.recast_ptr(sdSt.iterator, sdS_layout.inner), sdS_layout.outer)
        sKt = cute.make_tensor(cute.recast_ptr(sK.iterator, sKt_layout.inner), sKt_layout.outer)
        sQt = cute.make_tensor(cute.recast_ptr(sQ.iterator, sQt_layout.inner), sQt_layout.outer)
        sdOt = cute.make_tensor(cute.recast_ptr(sdO.iterator, sdOt_layout.inner), sdOt_layout.outer)
        tiles = SharedTiles(sK, sV, sQ, sdO, sdSt, sdS, sKt, sQt, sdOt)
        gemms = Gemms(mma_s, mma_dp, mma_dv, mma_dk, mma_dq)
        # The load warp's TMAs: K and V tiles (each the A operand of its GEMM), Q and dO token tiles.
        key_copies = ((mma_s, tma_atom_K, tma_K, sK), (mma_dp, tma_atom_V, tma_V, sV))
        token_copies = ((tma_atom_Q, tma_Q, sQ), (tma_atom_dO, tma_dO, sdO))

        scalars = (
            storage.lse_log2.get_tensor(cute.make_layout((TILE, self.scalar_stages))),
            storage.delta.get_tensor(cute.make_layout((TILE, self.scalar_stages))),
            storage.qpos.get_tensor(cute.make_layout((TOKENS_PER_TASK, self.scalar_stages))),
            storage.qrows.get_tensor(cute.make_layout((TOKENS_PER_TASK, self.scalar_stages))),
        )

        if row_lo < row_hi:
            if warp_idx == self.mma_warp:
                cute.arch.alloc_tmem(self.tmem_columns, storage.tmem_base.ptr)
                cute.arch.relinquish_tmem_alloc_permit()
            # Publishes the TMEM base address (and the mbarrier inits) to every warp.
            cute.arch.barrier()
            tmem = cute.arch.retrieve_tmem_ptr(
                self.acc_dtype, alignment=16, ptr_to_buffer_holding_addr=storage.tmem_base.ptr
            )
            tS = self._tmem_accumulator(mma_s, tmem, self.tmem_s)
            tdP = self._tmem_accumulator(mma_dp, tmem, self.tmem_dp_dq)
            tdQ = self._tmem_accumulator(mma_dq, tmem, self.tmem_dp_dq)
            tdV = self._tmem_accumulator(mma_dv, tmem, self.tmem_dv)
            tdK = self._tmem_accumulator(mma_dk, tmem, self.tmem_dk)
            # P^T in bf16 overwrites S^T's columns once S^T is read (the TS-MMA A operand).
            tPt_fragment = mma_dv.make_fragment_A(
                cute.make_tensor(cute.make_ptr(self.io_dtype, 0, cute.AddressSpace.tmem), tPt_layout.outer)
            )[None, None, None, 0]
            tPt = cute.make_tensor(cute.recast_ptr(tS.iterator, dtype=self.io_dtype), tPt_fragment.layout)

            tmem_tiles = TmemTiles(tS, tdP, tdQ, tdV, tdK, tPt)

            if warp_idx == self.load_warp:
                cute.arch.setmaxregister_decrease(self.misc_registers)
                self.load(key_copies, token_copies, tasks, pipes)
            elif warp_idx == self.scalar_warp:
                cute.arch.setmaxregister_decrease(self.misc_registers)
                self.gather_scalars(mLSE, mDelta, scalars, tasks, pipes)
            elif warp_idx == self.mma_warp:
                cute.arch.setmaxregister_decrease(self.misc_registers)
                self.mma(gemms, tiles, tmem_tiles, tasks, pipes)
            elif warp_idx < len(self.compute_warps):
                cute.arch.setmaxregister_increase(self.compute_registers)
                self.compute(mma_dv, tmem_tiles, sdSt, scalars, softmax_scale, tasks, pipes)
            elif warp_idx <= self.reduce_warps[-1]:
                cute.arch.setmaxregister_increase(self.reduce_registers)
                self.reduce(tmem_tiles, (mdQ, mdK, mdV), scalars, softmax_scale, tasks, pipes)
            else:
                cute.arch.setmaxregister_decrease(self.misc_registers)

            # Every TMEM reader has waited for its last MMA, so the columns can go.
            cute.arch.barrier()
            if warp_idx == self.mma_warp:
                cute.arch.dealloc_tmem(tmem, self.tmem_columns)

    # -----------------------------------------------------------------------------------
    # Set-up helpers
    # -----------------------------------------------------------------------------------

    def _make_pipelines(self, storage):
        """The producer/consumer mbarrier pipelines between the warp roles, by name."""
        # Arrival counts: every thread of a warp (group) arrives on a plain mbarrier, while a
        # tcgen05.commit of the MMA warp and a TMA transaction count arrive once.
        def threads(count):
            return pipeline.CooperativeGroup(pipeline.Agent.Thread, count)

        one_warp, mma_thread = threads(32), threads(1)
        compute, reduce = threads(32 * len(self.compute_warps)), threads(32 * len(self.reduce_warps))
        compute_and_reduce = threads(32 * (len(self.compute_warps) + len(self.reduce_warps)))
        tma_mma = functools.partial(
            pipeline.PipelineTmaUmma.create, producer_group=mma_thread, consumer_group=mma_thread, defer_sync=True
        )
        mma_to = functools.partial(
            pipeline.PipelineUmmaAsync.create, num_stages=1, producer_group=mma_thread, defer_sync=True
        )
        to_mma = functools.partial(
            pipeline.PipelineAsyncUmma.create, num_stages=1, consumer_group=mma_thread, defer_sync=True
        )
        pipes = {
            # load warp -> MMA warp (TMA transaction counts)
            "kv": tma_mma(
                num_stages=1, tx_count=self.kv_bytes, barrier_storage=storage.kv_full_empty.data_ptr()
            ),
            "q": tma_mma(
                num_stages=self.q_stages, tx_count=self.tile_bytes, barrier_storage=storage.q_full_empty.data_ptr()
            ),
            "do": tma_mma(
                num_stages=self.do_stages, tx_count=self.tile_bytes,
                barrier_storage=storage.do_full_empty.data_ptr(),
            ),
            # scalar warp -> compute and reduce warps
            "scalar": pipeline.PipelineAsync.create(
                num_stages=self.scalar_stages, producer_group=one_warp, consumer_group=compute_and_reduce,
                barrier_storage=storage.scalar_full_empty.data_ptr(), defer_sync=True,
            ),
            # MMA warp -> compute warps: S^T and dP^T are in TMEM
            "s": mma_to(consumer_group=compute, barrier_storage=storage.s_full_empty.data_ptr()),
            "dp": mma_to(consumer_group=compute, barrier_storage=storage.dp_full_empty.data_ptr()),
            # compute warps -> MMA warp: P^T in TMEM, dS^T in shared memory
            "p": to_mma(producer_group=compute, barrier_storage=storage.p_full_empty.data_ptr()),
            "ds": to_mma(producer_group=compute, barrier_storage=storage.ds_full_empty.data_ptr()),
            # MMA warp -> reduce warps: dQ of a task, dK/dV of a segment
            "dq": mma_to(consumer_group=reduce, barrier_storage=storage.dq_full_empty.data_ptr()),
            "dkdv": mma_to(consumer_group=reduce, barrier_storage=storage.dkdv_full_empty.data_ptr()),
        }
        cute.arch.mbarrier_init_fence()
        return pipes

    @cute.jit
    def _tmem_accumulator(
        self, tiled_mma: cute.TiledMma, tmem: cute.Pointer, column: cutlass.Constexpr
    ) -> cute.Tensor:
        """The (MMA, MMA_M, MMA_N) fp32 accumulator of `tiled_mma` at TMEM column `column`."""
        fragment = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2]))
        return cute.make_tensor(tmem + column, fragment.layout)

    @cute.jit
    def _bucket_differs(self, mTaskMeta: cute.Tensor, row_a: Int32, row_b: Int32) -> Boolean:
        """Whether two task rows belong to different buckets (kv head or aligned key row)."""
        head_differs = mTaskMeta[row_a, 0] != mTaskMeta[row_b, 0]
        return head_differs | (mTaskMeta[row_a, 1] != mTaskMeta[row_b, 1])

    @cute.jit
    def _segment_bounds(self, tasks: Tasks, row: Int32):
        """`(starts, ends)`: whether task `row` opens / closes a segment of this CTA."""
        previous = row - 1
        if row == tasks.lo:
            previous = row
        following = row + 1
        if row == tasks.hi - 1:
            following = row
        starts = (row == tasks.lo) | self._bucket_differs(tasks.meta, previous, row)
        ends = (row == tasks.hi - 1) | self._bucket_differs(tasks.meta, row, following)
        return starts, ends

    # -----------------------------------------------------------------------------------
    # Warp roles
    # -----------------------------------------------------------------------------------

    @cute.jit
    def load(self, key_copies, token_copies, tasks: Tasks, pipes):
        """TMA producer: K/V once per segment, the gathered Q and dO tiles of every task.

        `key_copies`: `(tiled MMA, atom, TMA view, tile)` of K and of V, each a (key row, d, kv head)
        view loaded into the one-stage A operand tile of its MMA. `token_copies`: `(atom, TMA view,
        tiles)` of Q and of dO, each a `[Tq * 64, 128]` view gathered into its staged tiles."""
        # K/V: (M, K, L) tiles of the operand; coordinates (key row block, 0, kv head).
        tile_mk = cute.select(self.mma_tiler, mode=[0, 2])
        one_cta = cute.make_layout(1)
        key_loads = []  # (atom, tile slots, source blocks) of K, then V
        for tiled_mma, atom, view, tile in key_copies:
            blocks = tiled_mma.get_slice(0).partition_A(cute.local_tile(view, tile_mk, (None, None, None)))
            slots, blocks = cpasync.tma_partition(
                atom, 0, one_cta, cute.group_modes(tile, 0, 3), cute.group_modes(blocks, 0, 3)
            )
            key_loads.append((atom, slots, blocks))
        # Q/dO: 16-row token blocks of the [Tq * 64, 128] views into the 8 token slots of a
        # (128 x 128) tile; the tiles are viewed as plain (row, col, stage) to cut them.
        (atom_Q, view_Q, sQ), (atom_dO, view_dO, sdO) = token_copies
        tQsQ, tQgQ = token_tiles.token_tile_partition(atom_Q, view_Q, sQ, TILE, self.q_stages)
        tdOsdO, tdOgdO = token_tiles.token_tile_partition(atom_dO, view_dO, sdO, TILE, self.do_stages)

        kv_pipe, q_pipe, do_pipe = pipes["kv"], pipes["q"], pipes["do"]
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        for row in cutlass.range(tasks.lo, tasks.hi, unroll=1):
            kv_head = tasks.meta[row, 0]
            starts, _ = self._segment_bounds(tasks, row)
            if starts:
                key_block = tasks.meta[row, 1] // TILE
                kv_pipe.producer_acquire(kv_state)
                barrier = kv_pipe.producer_get_barrier(kv_state)
                for atom, slots, blocks in key_loads:
                    cute.copy(atom, blocks[None, key_block, 0, kv_head], slots[None, 0], tma_bar_ptr=barrier)
                kv_state.advance()

            q_pipe.producer_acquire(q_state)
            self._gather_tile(
                atom_Q, tQgQ, tQsQ[None, None, 0, q_state.index], q_pipe.producer_get_barrier(q_state),
                tasks.qrows, row, kv_head,
            )
            q_state.advance()
            do_pipe.producer_acquire(do_state)
            self._gather_tile(
                atom_dO, tdOgdO, tdOsdO[None, None, 0, do_state.index], do_pipe.producer_get_barrier(do_state),
                tasks.qrows, row, kv_head,
            )
            do_state.advance()

    @cute.jit
    def _gather_tile(
        self,
        tma_atom: cute.CopyAtom,
        source_blocks: cute.Tensor,
        slots: cute.Tensor,
        barrier: cute.Pointer,
        mTaskQRows: cute.Tensor,
        row: Int32,
        kv_head: Int32,
    ):
        """One TMA per token slot: token t's 16 heads of `kv_head` are 16-row block `4 t + kv_head`
        of the [Tq * 64, 128] view. A padding slot (-1) reloads the task's first token, so the
        tile holds finite data and the transaction count is always that of a full tile."""
        first_token = mTaskQRows[row, 0]
        for slot in cutlass.range_constexpr(TOKENS_PER_TASK):
            token = mTaskQRows[row, slot]
            if token < 0:
                token = first_token
            block = token * (NUM_Q_HEADS // HEADS_PER_KV) + kv_head
            cute.copy(tma_atom, source_blocks[None, block, 0], slots[None, slot], tma_bar_ptr=barrier)

    @cute.jit
    def gather_scalars(
        self,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        scalars,
        tasks: Tasks,
        pipes,
    ):
        """Per task: lse * log2(e) and delta of the 128 rows, tokens and positions of the 8 slots."""
        sLSE, sDelta, sQPos, sQRows = scalars
        lane = cute.arch.lane_idx()
        log2_e = Float32(1.4426950408889634)
        scalar_pipe = pipes["scalar"]
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.scalar_stages)
        # Lane l fills tile rows 4l..4l+3: slot l // 4, heads 4 (l % 4) .. 4 (l % 4) + 3.
        slot = lane // 4
        for row in cutlass.range(tasks.lo, tasks.hi, unroll=1):
            head_base = tasks.meta[row, 0] * HEADS_PER_KV + (lane % 4) * 4
            token = tasks.qrows[row, slot]
            scalar_pipe.producer_acquire(state)
            for k in cutlass.range_constexpr(4):
                lse_log2 = Float32(0.0)
                delta = Float32(0.0)
                if token >= 0:
                    lse_log2 = mLSE[token, head_base + k] * log2_e
                    delta = mDelta[token, head_base + k]
                sLSE[lane * 4 + k, state.index] = lse_log2
                sDelta[lane * 4 + k, state.index] = delta
            if lane < TOKENS_PER_TASK:
                sQRows[lane, state.index] = tasks.qrows[row, lane]
                sQPos[lane, state.index] = tasks.qpos[row, lane]
            scalar_pipe.producer_commit(state)
            state.advance()

    @cute.jit
    def mma(self, gemms: Gemms, tiles: SharedTiles, tmem_tiles: TmemTiles, tasks: Tasks, pipes):
        """Issues the five GEMMs of every task (one thread of this warp issues tcgen05.mma)."""
        mma_s, mma_dp, mma_dv, mma_dk, mma_dq = gemms
        tS, tdP, tdQ, tdV, tdK, tPt = tmem_tiles
        rK, rQ = mma_s.make_fragment_A(tiles.sK), mma_s.make_fragment_B(tiles.sQ)
        rV, rdO = mma_dp.make_fragment_A(tiles.sV), mma_dp.make_fragment_B(tiles.sdO)
        rdOt = mma_dv.make_fragment_B(tiles.sdOt)
        rdSt, rQt = mma_dk.make_fragment_A(tiles.sdSt), mma_dk.make_fragment_B(tiles.sQt)
        rdS, rKt = mma_dq.make_fragment_A(tiles.sdS), mma_dq.make_fragment_B(tiles.sKt)

        consumer, producer = pipeline.PipelineUserType.Consumer, pipeline.PipelineUserType.Producer
        kv_state = pipeline.make_pipeline_state(consumer, 1)
        q_state = pipeline.make_pipeline_state(consumer, self.q_stages)
        do_state = pipeline.make_pipeline_state(consumer, self.do_stages)
        # The single-stage pipelines that turn over once per task share one state per direction,
        # saving registers in the warp the hoisted shared-memory descriptors already fill.
        result_state = pipeline.make_pipeline_state(producer, 1)  # pipes s, dp, dq
        operand_state = pipeline.make_pipeline_state(consumer, 1)  # pipes p, ds
        dkdv_state = pipeline.make_pipeline_state(producer, 1)

        for row in cutlass.range(tasks.lo, tasks.hi, unroll=1):
            starts, ends = self._segment_bounds(tasks, row)
            if starts:
                pipes["kv"].consumer_wait(kv_state)

            # S^T = K Q^T
            pipes["q"].consumer_wait(q_state)
            pipes["s"].producer_acquire(result_state)
            self._gemm(mma_s, tS, rK[None, None, None, 0], rQ[None, None, None, q_state.index], Boolean(False))
            pipes["s"].producer_commit(result_state)

            # dP^T = V dO^T, into the columns that held the previous task's dQ.
            pipes["do"].consumer_wait(do_state)
            pipes["dp"].producer_acquire(result_state)
            pipes["dq"].producer_acquire(result_state)
            self._gemm(
                mma_dp, tdP, rV[None, None, None, 0], rdO[None, None, None, do_state.index], Boolean(False)
            )
            pipes["dp"].producer_commit(result_state)

            # dV += P^T dO; a segment's first task overwrites the flushed accumulators.
            pipes["p"].consumer_wait(operand_state)
            if starts:
                pipes["dkdv"].producer_acquire(dkdv_state)
            self._gemm(mma_dv, tdV, tPt, rdOt[None, None, None, do_state.index], ~starts)
            pipes["p"].consumer_release(operand_state)
            pipes["do"].consumer_release(do_state)
            do_state.advance()

            # dQ = dS K (dP^T has been read: dS exists) and dK += dS^T Q.
            pipes["ds"].consumer_wait(operand_state)
            self._gemm(mma_dq, tdQ, rdS[None, None, None, 0], rKt[None, None, None, 0], Boolean(False))
            pipes["dq"].producer_commit(result_state)
            self._gemm(mma_dk, tdK, rdSt[None, None, None, 0], rQt[None, None, None, q_state.index], ~starts)
            pipes["ds"].consumer_release(operand_state)
            operand_state.advance()
            result_state.advance()
            pipes["q"].consumer_release(q_state)
            q_state.advance()

            if ends:
                pipes["dkdv"].producer_commit(dkdv_state)
                dkdv_state.advance()
                pipes["kv"].consumer_release(kv_state)
                kv_state.advance()

    @cute.jit
    def _gemm(
        self,
        tiled_mma: cute.TiledMma,
        accumulator: cute.Tensor,
        a: cute.Tensor,
        b: cute.Tensor,
        accumulate: Boolean,
    ):
        """accumulator (+)= a b over the K blocks; `accumulate` False zero-initialises."""
        # A local atom carries the accumulate flag, so the caller's TiledMma (shared by the
        # warp-role branches) is never mutated inside this warp's loop.
        atom = cute.make_mma_atom(tiled_mma.op)
        for k_block in cutlass.range_constexpr(cute.size(a, mode=[2])):
            if cutlass.const_expr(k_block == 0):
                atom.set(tcgen05.Field.ACCUMULATE, accumulate)
            else:
                atom.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(atom, accumulator, a[None, None, k_block], b[None, None, k_block], accumulator)

    @cute.jit
    def _column_half(self, t: cute.Tensor, half: Int32) -> cute.Tensor:
        """The registers of a 32x32b TMEM partition that cover query rows [64 half, 64 half + 64)."""
        # Mode 2 walks the 128 columns in order; its first half is columns 0..63.
        repeats = cute.size(t, mode=[2])
        split = cute.composition(t, cute.make_layout((t.shape[0], t.shape[1], (repeats // 2, 2))))
        return split[None, None, (None, half)]

    @cute.jit
    def compute(
        self,
        mma_dv: cute.TiledMma,
        tmem_tiles: TmemTiles,
        sdSt: cute.Tensor,
        scalars,
        softmax_scale: Float32,
        tasks: Tasks,
        pipes,
    ):
        """P^T and dS^T of every task; thread = key (TMEM lane), warpgroup = 64 query rows."""
        sLSE, sDelta, sQPos, sQRows = scalars
        tS, tdP, tPt = tmem_tiles.tS, tmem_tiles.tdP, tmem_tiles.tPt
        tidx = cute.arch.thread_idx()[0]
        key = tidx % TILE
        half = tidx // TILE  # 0: query rows 0..63, 1: rows 64..127
        scale_log2 = softmax_scale * Float32(1.4426950408889634)
        compute_barrier = pipeline.NamedBarrier(
            barrier_id=self.compute_barrier_id, num_threads=32 * len(self.compute_warps)
        )

        tS2 = tS[(None, None), 0, 0]  # (128 keys, 128 query rows) fp32
        tdP2 = tdP[(None, None), 0, 0]
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(16)), self.acc_dtype)
        t2r = tcgen05.make_tmem_copy(load_atom, tS2).get_slice(key)
        coords = cute.make_identity_tensor((TILE, TILE))
        tTR_c = self._column_half(t2r.partition_D(coords), half)
        tTR_tS = self._column_half(t2r.partition_S(tS2), half)
        tTR_tdP = self._column_half(t2r.partition_S(tdP2), half)
        rS = cute.make_rmem_tensor(tTR_c.shape, self.acc_dtype)
        # A chunk is one 32x32b repeat: 16 consecutive query rows (one token slot). dP^T is
        # read a chunk at a time to bound register use.
        rdP = cute.make_rmem_tensor(tTR_c[None, None, 0].shape, self.acc_dtype)
        chunk_size = cute.size(rdP)
        assert chunk_size == HEADS_PER_KV, "a TMEM load repeat must cover exactly one token slot"

        # P^T goes back to TMEM as bf16 in the layout of the dV GEMM's A operand.
        store_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(8)), self.io_dtype)
        r2t_tiled = tcgen05.make_tmem_copy(store_atom, tPt)
        r2t = r2t_tiled.get_slice(key)
        tRT_tP = self._column_half_4(r2t.partition_D(tPt), half)
        tRT_c = self._column_half_4(r2t.partition_S(mma_dv.get_slice(0).partition_A(coords)), half)

        # dS^T row `key`, query rows of this half: 64 consecutive bf16 of the K-major tile.
        sdSt_plain = cute.composition(
            sdSt[None, None, None, 0], cute.make_layout((TILE, TILE), stride=(1, TILE))
        )
        sdS_row = cute.flat_divide(sdSt_plain[key, None], (TILE // 2,))[None, half]

        s_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        dp_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        p_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        ds_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        scalar_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.scalar_stages)

        for row in cutlass.range(tasks.lo, tasks.hi, unroll=1):
            key_position = tasks.meta[row, 2] * BLOCK_SIZE + key
            pipes["scalar"].consumer_wait(scalar_state)
            stage = scalar_state.index

            # P = exp2(S * scale * log2 e - lse * log2 e), 0 where the key is after the
            # query (causal) or the slot is padding (token -1, position -1).
            pipes["s"].consumer_wait(s_state)
            cute.copy(t2r, tTR_tS, rS)
            for chunk in cutlass.range_constexpr(cute.size(rS) // chunk_size):
                # A chunk is one token slot (its 16 heads), so one test serves it.
                slot = tTR_c[chunk * chunk_size][1] // HEADS_PER_KV
                visible = (key_position <= sQPos[slot, stage]) & (sQRows[slot, stage] >= 0)
                for j in cutlass.range_constexpr(chunk_size):
                    i = chunk * chunk_size + j
                    p = cute.math.exp2(rS[i] * scale_log2 - sLSE[tTR_c[i][1], stage], fastmath=True)
                    rS[i] = p if visible else Float32(0.0)
            cute.arch.fence_view_async_tmem_load()
            # Both warpgroups must finish reading S^T before P^T (bf16) overwrites it.
            compute_barrier.arrive_and_wait()
            pipes["p"].producer_acquire(p_state)
            rP = self._to_bf16(rS)
            cute.copy(r2t_tiled, cute.make_tensor(rP.iterator, cute.make_layout(tRT_c.shape)), tRT_tP)
            cute.arch.fence_view_async_tmem_store()
            pipes["p"].producer_commit(p_state)
            p_state.advance()
            pipes["s"].consumer_release(s_state)
            s_state.advance()

            # dS = P * (dP - delta), written as bf16 row `key` of dS^T.
            pipes["dp"].consumer_wait(dp_state)
            pipes["ds"].producer_acquire(ds_state)
            for chunk in cutlass.range_constexpr(cute.size(tTR_tdP, mode=[2])):
                cute.copy(t2r, tTR_tdP[None, None, chunk], rdP)
                for j in cutlass.range_constexpr(chunk_size):
                    i = chunk * chunk_size + j
                    rdP[j] = rS[i] * (rdP[j] - sDelta[tTR_c[i][1], stage])
                sdS_chunk = cute.flat_divide(sdS_row, (chunk_size,))[None, chunk]
                cute.autovec_copy(self._to_bf16(rdP), sdS_chunk)
            cute.arch.fence_view_async_tmem_load()
            pipes["dp"].consumer_release(dp_state)
            dp_state.advance()
            # Make the generic-proxy stores visible to the tensor core (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            pipes["ds"].producer_commit(ds_state)
            ds_state.advance()
            pipes["scalar"].consumer_release(scalar_state)
            scalar_state.advance()

    @cute.jit
    def _column_half_4(self, t: cute.Tensor, half: Int32) -> cute.Tensor:
        """`_column_half` for a rank-4 (MMA-operand) partition whose mode 3 walks the K blocks."""
        repeats = cute.size(t, mode=[3])
        split = cute.composition(
            t, cute.make_layout((t.shape[0], t.shape[1], t.shape[2], (repeats // 2, 2)))
        )
        return split[None, None, None, (None, half)]

    @cute.jit
    def _to_bf16(self, values: cute.Tensor) -> cute.Tensor:
        converted = cute.make_rmem_tensor(values.shape, self.io_dtype)
        converted.store(values.load().to(self.io_dtype))
        return converted

    @cute.jit
    def reduce(
        self,
        tmem_tiles: TmemTiles,
        accumulators,
        scalars,
        softmax_scale: Float32,
        tasks: Tasks,
        pipes,
    ):
        """Atomically adds each task's dQ rows and each segment's dK/dV rows (thread = TMEM lane)
        into `accumulators`, the fp32 `(mdQ, mdK, mdV)`."""
        _, _, _, sQRows = scalars
        mdQ, mdK, mdV = accumulators
        lane = cute.arch.thread_idx()[0] % TILE
        load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), self.acc_dtype)

        def lane_rows(accumulator):
            tmem = accumulator[(None, None), 0, 0]
            copy = tcgen05.make_tmem_copy(load_atom, tmem).get_slice(lane)
            return copy, copy.partition_S(tmem)

        dq_copy, tTR_dQ = lane_rows(tmem_tiles.tdQ)
        dv_copy, tTR_dV = lane_rows(tmem_tiles.tdV)
        dk_copy, tTR_dK = lane_rows(tmem_tiles.tdK)
        # 128 fp32 per thread: row `lane` of an accumulator, in column order.
        row_shape = dq_copy.partition_D(cute.make_identity_tensor((TILE, HEAD_DIM))).shape
        values = cute.make_rmem_tensor(row_shape, self.acc_dtype)

        scalar_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.scalar_stages)
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        dkdv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for row in cutlass.range(tasks.lo, tasks.hi, unroll=1):
            _, ends = self._segment_bounds(tasks, row)
            kv_head = tasks.meta[row, 0]

            # dQ row `lane` = token slot lane // 16, query head 16 kv_head + lane % 16.
            pipes["scalar"].consumer_wait(scalar_state)
            token = sQRows[lane // HEADS_PER_KV, scalar_state.index]
            pipes["scalar"].consumer_release(scalar_state)
            scalar_state.advance()
            pipes["dq"].consumer_wait(dq_state)
            cute.copy(dq_copy, tTR_dQ, values)
            cute.arch.fence_view_async_tmem_load()
            pipes["dq"].consumer_release(dq_state)
            dq_state.advance()
            if token >= 0:
                dq_row = Int64(token) * NUM_Q_HEADS + kv_head * HEADS_PER_KV + lane % HEADS_PER_KV
                self._add_row(mdQ, dq_row, values, softmax_scale)

            if ends:
                # dK/dV row `lane` = key row `aligned_key_row + lane` of this kv head.
                kv_row = (Int64(tasks.meta[row, 1]) + lane) * NUM_KV_HEADS + kv_head
                pipes["dkdv"].consumer_wait(dkdv_state)
                cute.copy(dv_copy, tTR_dV, values)
                self._add_row(mdV, kv_row, values, Float32(1.0))
                cute.copy(dk_copy, tTR_dK, values)
                cute.arch.fence_view_async_tmem_load()
                pipes["dkdv"].consumer_release(dkdv_state)
                dkdv_state.advance()
                self._add_row(mdK, kv_row, values, softmax_scale)

    @cute.jit
    def _add_row(self, accum: cute.Tensor, row: Int64, values: cute.Tensor, scale: Float32):
        """accum[row, :] += scale * values (128 fp32, in column order) with 16-byte atomics."""
        base = (accum.iterator + row * HEAD_DIM).toint()
        for c in cutlass.range_constexpr(0, HEAD_DIM, 4):
            red_add_f32x4(
                base + c * 4,
                values[c] * scale, values[c + 1] * scale, values[c + 2] * scale, values[c + 3] * scale,
            )
