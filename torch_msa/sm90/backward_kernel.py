"""The SM90 backward kernel (CuTe DSL, sm_90a): KV-outer, dK/dV accumulated on chip per item, dQ
added by bulk reduce-add. Compile-time variants: `deterministic` (dQ added in fixed point, whose
sums do not depend on the order; dK/dV stored per item) and `emit_teacher` (also writes the index
loss's teacher). Host side `backward_host.py`, design `README.md`.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float16, Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

from ..cute_dsl.compat import SmemAllocator
from ..cute_dsl.ptx import bulk_reduce_add_f32, bulk_reduce_add_u32, red_add_f32x2, round_to_int32
from .blocks_kernel import K_MAJOR, MN_MAJOR, BlocksKernel, thread_and_warp
from .common import (
    BLOCK_SIZE,
    DQ_DIM_GROUP,
    HEAD_DIM,
    HEADS_PER_KV,
    LOG2_E,
    TILE_ROWS,
    TOKENS_PER_TILE,
    ScheduleOperands,
)
from .mask import key_hidden, zero_keys_past
from .pipeline import consumer_state, producer_state
from .softmax import probability, quad_sum
from .tile_scheduler import Item, ItemScheduler
from .tma import (
    accumulator_as_operand_a,
    accumulator_rows_cols,
    load_key_blocks,
    load_next_tile,
    load_token_tile,
    token_tile_partition,
)

THREADS = 256  # two MMA warpgroups
CONSUMER_WARPS = THREADS // 32
KEYS_PER_WARPGROUP = BLOCK_SIZE // 2
TILE_STAGES = 2  # Q/dO: the next tile loads while this one is computed
# A warp's share of a tile's dQ, in 32-bit elements: its token's 16 heads x its warpgroup's 64 dims.
DQ_SHARE = HEADS_PER_KV * HEAD_DIM // 2


class Sm90BackwardKernel(BlocksKernel):
    """The SM90 backward blocks kernel; `__call__` is the `cute.jit` host function."""

    def __init__(self, num_kv_heads: int, deterministic: bool, emit_teacher: bool = False):
        super().__init__(num_kv_heads)
        self.deterministic = deterministic
        self.emit_teacher = emit_teacher

    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,  # `BlocksKernel`
        mdO: cute.Tensor,  # [Tq, Hq, 128]
        mLse: cute.Tensor,  # fp32 [Tq, Hq], natural log
        mDelta: cute.Tensor,  # fp32 [Tq, Hq]
        mdQ: cute.Tensor,  # [Tq, Hq, 128] added to, dim-grouped (`DQ_DIM_GROUP`): fp32, int32 if deterministic
        mdK: cute.Tensor,  # fp32 [Tk, Hkv, 128], added to
        mdV: cute.Tensor,  # fp32 [Tk, Hkv, 128], added to
        mTeacher: cute.Tensor,  # fp16 [Tq * Hkv * topk, 128], written with `emit_teacher`
        mDqScale: cute.Tensor,  # fp32 [Tq, Hq], deterministic: each row's fixed-point scale, NaN once marked
        *schedule_and_scalars,  # `BlocksKernel`: the schedule, then topk, scale_log2, softmax_scale,
        # dq_share_cap (deterministic: the largest scaled share), grid_size, stream
    ):
        schedule, (topk, scale_log2, softmax_scale, dq_share_cap, grid_size, stream) = self.split_schedule(
            schedule_and_scalars
        )
        self.dtype = mQ.element_type
        # sdp: S^T = K Q^T, dP^T = V dO^T; dkv: dV += P^T dO, dK += dS^T Q (A from registers); dq: dQ = dS K.
        mma_sdp = self.tiled_mma(K_MAJOR, (2, 1, 1), (KEYS_PER_WARPGROUP, TILE_ROWS))
        mma_dkv = self.tiled_mma(MN_MAJOR, (2, 1, 1), (KEYS_PER_WARPGROUP, HEAD_DIM), warpgroup.OperandSource.RMEM)
        mma_dq = self.tiled_mma(MN_MAJOR, (1, 2, 1), (TILE_ROWS, HEAD_DIM // 2))
        sdp_tiler = (BLOCK_SIZE, TILE_ROWS, HEAD_DIM)
        sK_layout = self.operand_a_tiles(sdp_tiler, 1)
        sQ_layout = self.operand_b_tiles(sdp_tiler, TILE_STAGES)
        sdS_layout = self.operand_a_tiles((TILE_ROWS, HEAD_DIM, BLOCK_SIZE), TILE_STAGES)

        (tma_atom_K, tma_K), (tma_atom_V, tma_V), (tma_atom_Q, tma_Q), token_rows = self.key_and_query_tma(
            mK, mV, mQ, sK_layout, sQ_layout
        )
        tma_atom_dO, tma_dO = self.query_tma(mdO, token_rows)
        self.tile_bytes = 2 * cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        dq_element = Int32 if self.deterministic else Float32
        self.shared_storage = self.make_shared_storage(
            {"sK": sK_layout, "sV": sK_layout, "sQ": sQ_layout, "sdO": sQ_layout, "sdS": sdS_layout},
            {
                "sdQ": cute.struct.Align[cute.struct.MemRange[dq_element, TILE_ROWS * HEAD_DIM], 1024],
                # Per row: lse (log2), delta, last visible key, dQ's fixed-point scale (deterministic);
                # one buffer per tile stage.
                "sLse": cute.struct.MemRange[Float32, TILE_ROWS * TILE_STAGES],
                "sDelta": cute.struct.MemRange[Float32, TILE_ROWS * TILE_STAGES],
                "sLast": cute.struct.MemRange[Int32, TILE_ROWS * TILE_STAGES],
                "sScale": cute.struct.MemRange[Float32, TILE_ROWS * TILE_STAGES if self.deterministic else 1],
            },
            1,
            TILE_STAGES,
        )
        self.kernel(
            mma_sdp, mma_dkv, mma_dq, tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mLse, mDelta, mdQ, mdK, mdV, mTeacher, mDqScale, schedule, topk, scale_log2, softmax_scale, dq_share_cap,
            sQ_layout, sK_layout, sdS_layout,
        ).launch(grid=(grid_size, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        tma_atom_Q: cute.CopyAtom,
        tma_Q: cute.Tensor,
        tma_atom_dO: cute.CopyAtom,
        tma_dO: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        tma_K: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tma_V: cute.Tensor,
        mLse: cute.Tensor,
        mDelta: cute.Tensor,
        mdQ: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mTeacher: cute.Tensor,
        mDqScale: cute.Tensor,
        schedule: ScheduleOperands,
        topk: Int32,
        scale_log2: Float32,
        softmax_scale: Float32,
        dq_share_cap: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
    ):
        tidx, warp = thread_and_warp()

        storage = SmemAllocator().allocate(self.shared_storage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        # (row, dim) over each token's [dim groups, 16 heads, 8 dims] block.
        sdQ = storage.sdQ.get_tensor(cute.make_layout(
            ((HEADS_PER_KV, TOKENS_PER_TILE), (DQ_DIM_GROUP, HEAD_DIM // DQ_DIM_GROUP)),
            stride=((DQ_DIM_GROUP, HEADS_PER_KV * HEAD_DIM), (1, HEADS_PER_KV * DQ_DIM_GROUP)),
        ))
        rows_layout = cute.make_layout((TILE_ROWS, TILE_STAGES))
        sLse = storage.sLse.get_tensor(rows_layout)
        sDelta = storage.sDelta.get_tensor(rows_layout)
        sLast = storage.sLast.get_tensor(rows_layout)
        sScale = storage.sScale.get_tensor(rows_layout if self.deterministic else cute.make_layout((1, 1)))
        # Transposed views for the GEMMs that read these MN-major.
        sQt = cute.make_tensor(sQ.iterator, cute.select(sQ.layout, mode=[1, 0, 2]))
        sdOt = cute.make_tensor(sdO.iterator, cute.select(sdO.layout, mode=[1, 0, 2]))
        sKt = cute.make_tensor(sK.iterator, cute.select(sK.layout, mode=[1, 0, 2]))
        sdSt = cute.make_tensor(sdS.iterator, cute.select(sdS.layout, mode=[1, 0, 2]))

        kv_pipeline, tile_pipeline = self.load_pipelines(
            storage, tidx, (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V), (1, CONSUMER_WARPS),
            (TILE_STAGES, self.tile_bytes, CONSUMER_WARPS),
        )

        tQsQ, tQgQ = token_tile_partition(tma_atom_Q, tma_Q, sQ, TILE_STAGES)
        tdOsdO, tdOgdO = token_tile_partition(tma_atom_dO, tma_dO, sdO, TILE_STAGES)
        key_copies = ((tma_atom_K, tma_K, sK), (tma_atom_V, tma_V, sV))
        tile_copies = ((tma_atom_Q, tQgQ, tQsQ), (tma_atom_dO, tdOgdO, tdOsdO))

        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        tSrK = mma_sdp.make_fragment_A(thr_sdp.partition_A(sK))
        tSrV = mma_sdp.make_fragment_A(thr_sdp.partition_A(sV))
        tSrQ = mma_sdp.make_fragment_B(thr_sdp.partition_B(sQ))
        tSrdO = mma_sdp.make_fragment_B(thr_sdp.partition_B(sdO))
        tVrdO = mma_dkv.make_fragment_B(thr_dkv.partition_B(sdOt))
        tKrQ = mma_dkv.make_fragment_B(thr_dkv.partition_B(sQt))
        tQrdS = mma_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tQrK = mma_dq.make_fragment_B(thr_dq.partition_B(sKt))
        dS_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype),
            mma_sdp,
        ).get_slice(tidx)
        tdQsdQ = thr_dq.partition_C(sdQ)

        cS = thr_sdp.partition_C(cute.make_identity_tensor((BLOCK_SIZE, TILE_ROWS)))
        cKV = thr_dkv.partition_C(cute.make_identity_tensor((BLOCK_SIZE, HEAD_DIM)))
        cQ = thr_dq.partition_C(cute.make_identity_tensor((TILE_ROWS, HEAD_DIM)))
        cQ_rc = cute.make_tensor(cQ.iterator, accumulator_rows_cols(cQ.layout))
        acc_S = cute.make_rmem_tensor(cS.shape, self.acc_dtype)
        acc_dP = cute.make_rmem_tensor(cS.shape, self.acc_dtype)
        acc_dK = cute.make_rmem_tensor(cKV.shape, self.acc_dtype)
        acc_dV = cute.make_rmem_tensor(cKV.shape, self.acc_dtype)
        acc_dQ = cute.make_rmem_tensor(cQ.shape, self.acc_dtype)
        s_rc = cute.make_tensor(acc_S.iterator, accumulator_rows_cols(acc_S.layout))
        dp_rc = cute.make_tensor(acc_dP.iterator, accumulator_rows_cols(acc_dP.layout))
        cS_rc = cute.make_tensor(cS.iterator, accumulator_rows_cols(cS.layout))
        dk_rc = cute.make_tensor(acc_dK.iterator, accumulator_rows_cols(acc_dK.layout))
        dv_rc = cute.make_tensor(acc_dV.iterator, accumulator_rows_cols(acc_dV.layout))
        cKV_rc = cute.make_tensor(cKV.iterator, accumulator_rows_cols(cKV.layout))
        rP = cute.make_rmem_tensor(cS.shape, self.dtype)
        rdS = cute.make_rmem_tensor(cS.shape, self.dtype)
        tVrP = cute.make_tensor(rP.iterator, accumulator_as_operand_a(rP.layout))
        tKrdS = cute.make_tensor(rdS.iterator, accumulator_as_operand_a(rdS.layout))
        # dK/dV accumulate over an item's tiles from zeros set at its start.
        mma_dkv.set(warpgroup.Field.ACCUMULATE, True)

        items = ItemScheduler.create(schedule, topk)
        kv_load, kv_read = producer_state(1), consumer_state(1)
        tile_load, tile_read = producer_state(TILE_STAGES), consumer_state(TILE_STAGES)
        for index in cutlass.range(items.first, items.count, items.stride, unroll=1):
            item = items.item(index)
            if warp == 0:
                kv_load = load_key_blocks(kv_pipeline, kv_load, key_copies, item)
                tile_load = load_token_tile(tile_pipeline, tile_load, tile_copies, items, item, item.start, self.num_kv_heads)
            if tidx >= THREADS - TILE_ROWS:
                self.stage_row(
                    sLse, sDelta, sLast, sScale, mLse, mDelta, mDqScale, items, item, item.start,
                    tidx - (THREADS - TILE_ROWS), tile_read.index,
                )
            cute.arch.barrier()
            acc_dK.fill(0.0)
            acc_dV.fill(0.0)

            # Row buffers and dS tiles are reused two tiles later: the tile between's barrier
            # orders the reuse after the last read.
            for tile in cutlass.range(item.num_tiles, unroll=1):
                first = item.start + tile * TOKENS_PER_TILE
                # Read before the GEMMs, which hide the latency.
                if cutlass.const_expr(self.emit_teacher):
                    teacher_row = self.teacher_row(items, first, item.end, item.kv_head)
                dq_offset = self.dq_offset(items, first, item.end, item.kv_head, warp)
                if warp == 0:
                    tile_load = load_next_tile(tile_pipeline, tile_load, tile_copies, items, item, tile, first, self.num_kv_heads)
                stage = tile_read.index
                tile_pipeline.consumer_wait(tile_read)
                if tile == 0:
                    kv_pipeline.consumer_wait(kv_read)
                    if item.key_count < BLOCK_SIZE:
                        zero_keys_past(sK[None, None, 0], item.key_count, tidx)
                        cute.arch.barrier()

                warpgroup.fence()
                mma_sdp.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tSrK, mode=[2])):
                    cute.gemm(mma_sdp, acc_S, tSrK[None, None, k, 0], tSrQ[None, None, k, stage], acc_S)
                    mma_sdp.set(warpgroup.Field.ACCUMULATE, True)
                mma_sdp.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tSrV, mode=[2])):
                    cute.gemm(mma_sdp, acc_dP, tSrV[None, None, k, 0], tSrdO[None, None, k, stage], acc_dP)
                    mma_sdp.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                # The next tile's rows, in the GEMMs' shadow; the barriers below publish them.
                if tidx >= THREADS - TILE_ROWS:
                    if tile + 1 < item.num_tiles:
                        self.stage_row(
                            sLse, sDelta, sLast, sScale, mLse, mDelta, mDqScale, items, item,
                            first + TOKENS_PER_TILE, tidx - (THREADS - TILE_ROWS), (stage + 1) % TILE_STAGES,
                        )
                warpgroup.wait_group(0)

                for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                    col = cS_rc[0, c][1]
                    row_lse = sLse[col, stage]
                    row_delta = sDelta[col, stage]
                    last = sLast[col, stage]
                    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
                        prob = probability(s_rc[r, c], scale_log2, row_lse)
                        d_score = prob * (dp_rc[r, c] - row_delta)
                        if key_hidden(cS_rc[r, c][0], last):
                            prob = Float32(0.0)
                            d_score = Float32(0.0)
                        s_rc[r, c] = prob
                        dp_rc[r, c] = d_score
                rP.store(acc_S.load().to(self.dtype))
                rdS.store(acc_dP.load().to(self.dtype))

                warpgroup.fence()
                for k in cutlass.range_constexpr(cute.size(tVrP, mode=[2])):
                    cute.gemm(mma_dkv, acc_dV, tVrP[None, None, k], tVrdO[None, None, k, stage], acc_dV)
                for k in cutlass.range_constexpr(cute.size(tKrdS, mode=[2])):
                    cute.gemm(mma_dkv, acc_dK, tKrdS[None, None, k], tKrQ[None, None, k, stage], acc_dK)
                warpgroup.commit_group()
                if cutlass.const_expr(self.emit_teacher):
                    self.store_teacher(mTeacher, s_rc, cS_rc, teacher_row)

                if cutlass.const_expr(self.deterministic):
                    # Read before the barrier: once past it, the staging threads overwrite this
                    # buffer with the rows of the tile after next.
                    dq_row_scales = self.dq_row_scales(sScale, cQ_rc, stage)
                # dQ = dS K needs both warpgroups' dS: the tile's one CTA barrier.
                cute.copy(dS_store, dS_store.retile(rdS), dS_store.partition_D(sdSt[None, None, stage]))
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier()
                warpgroup.fence()
                mma_dq.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tQrdS, mode=[2])):
                    cute.gemm(mma_dq, acc_dQ, tQrdS[None, None, k, stage], tQrK[None, None, k, 0], acc_dQ)
                    mma_dq.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                # A warp's own dQ share: warp-level waits and fences suffice.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()
                if cutlass.const_expr(self.deterministic):
                    self.store_fixed_point_dq(tdQsdQ, acc_dQ, cQ_rc, dq_row_scales, mDqScale, dq_offset, dq_share_cap)
                else:
                    tdQsdQ.store(acc_dQ.load() * softmax_scale)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_warp()
                self.reduce_dq(sdQ, mdQ, dq_offset, warp)
                tile_pipeline.consumer_release(tile_read)
                tile_read.advance()

            kv_pipeline.consumer_release(kv_read)
            kv_read.advance()
            if cutlass.const_expr(self.deterministic):
                self.store_keys(mdK, dk_rc, cKV_rc, index, item.key_count, softmax_scale)
                self.store_keys(mdV, dv_rc, cKV_rc, index, item.key_count, Float32(1.0))
            else:
                self.add_keys(mdK, acc_dK, dk_rc, cKV_rc, item, softmax_scale)
                self.add_keys(mdV, acc_dV, dv_rc, cKV_rc, item, Float32(1.0))
        # Shared memory must outlive the TMA engine's reads of the last dQ tile.
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def stage_row(
        self, sLse: cute.Tensor, sDelta: cute.Tensor, sLast: cute.Tensor, sScale: cute.Tensor, mLse: cute.Tensor,
        mDelta: cute.Tensor, mDqScale: cute.Tensor, items: ItemScheduler, item: Item, first: Int32, row: Int32,
        buffer: Int32,
    ):
        """Stage row `row` of the tile at entry `first`: lse (log2), delta, last visible key (-1:
        padding) and, deterministic, dQ's fixed-point scale."""
        entry = first + row // HEADS_PER_KV
        last = Int32(-1)
        if entry < item.end:
            token = items.token(entry)
            head = item.kv_head * HEADS_PER_KV + row % HEADS_PER_KV
            last = items.last_visible_key(token, item)
            row_lse = mLse[token, head] * Float32(LOG2_E)
            # Like the reference, a query with an empty key set (lse = -inf) shifts by 0, not inf.
            if row_lse == Float32.inf or row_lse == -Float32.inf:
                row_lse = Float32(0.0)
            sLse[row, buffer] = row_lse
            sDelta[row, buffer] = mDelta[token, head]
            if cutlass.const_expr(self.deterministic):
                sScale[row, buffer] = mDqScale[token, head]
        sLast[row, buffer] = last

    @cute.jit
    def dq_offset(self, items: ItemScheduler, first: Int32, end: Int32, kv_head: Int32, warp: Int32) -> Int64:
        """Offset in the dQ accumulator of warp `warp`'s share of the tile at entry `first`; -1 past `end`."""
        entry = first + warp % TOKENS_PER_TILE
        offset = Int64(-1)
        if entry < end:
            token = Int64(items.token(entry))
            offset = (token * self.num_heads + kv_head * HEADS_PER_KV) * HEAD_DIM + self.dq_half(warp)
        return offset

    def dq_half(self, warp):
        """Offset of warp `warp`'s half of the dims in a token's dQ block (tile and accumulator alike)."""
        return (warp // TOKENS_PER_TILE) * DQ_SHARE

    @cute.jit
    def dq_row_scales(self, sScale: cute.Tensor, cQ_rc: cute.Tensor, stage: Int32) -> cute.Tensor:
        """The fixed-point scales of this thread's dQ rows (`cQ_rc`'s), from stage `stage`."""
        scales = cute.make_rmem_tensor((cute.size(cQ_rc, mode=[0]),), Float32)
        for r in cutlass.range_constexpr(cute.size(cQ_rc, mode=[0])):
            scales[r] = sScale[cQ_rc[r, 0][0], stage]
        return scales

    @cute.jit
    def store_fixed_point_dq(
        self, tdQsdQ: cute.Tensor, acc_dQ: cute.Tensor, cQ_rc: cute.Tensor, row_scales: cute.Tensor,
        mDqScale: cute.Tensor, offset: Int64, share_cap: Float32,
    ):
        """Store this thread's part of the tile's dQ into the int32 tile `tdQsdQ`: each value times its
        row's scale (`row_scales`, by `dq_row_scales`), rounded to nearest. A value beyond
        `share_cap` or not finite stores 0 and marks its row: NaN in `mDqScale` (the row of warp
        share `offset`; none if negative), which the final cast writes as a NaN row."""
        shares = cute.make_rmem_tensor(acc_dQ.shape, Int32)
        shares_rc = cute.make_tensor(shares.iterator, accumulator_rows_cols(shares.layout))
        acc_rc = cute.make_tensor(acc_dQ.iterator, accumulator_rows_cols(acc_dQ.layout))
        for r in cutlass.range_constexpr(cute.size(acc_rc, mode=[0])):
            row = cQ_rc[r, 0][0]
            scale = row_scales[r]
            marked = Boolean(False)
            for c in cutlass.range_constexpr(cute.size(acc_rc, mode=[1])):
                scaled = acc_rc[r, c] * scale
                share = Int32(0)
                # Written so that NaN fails it.
                if scaled <= share_cap and scaled >= -share_cap:
                    share = round_to_int32(scaled)
                else:
                    marked = Boolean(True)
                shares_rc[r, c] = share
            if marked and offset >= 0:
                # Every writer writes the same NaN: the order does not matter.
                # A share starts inside its token and KV head's 16-head block of dQ.
                first_row = offset // (HEADS_PER_KV * HEAD_DIM) * HEADS_PER_KV
                target = cute.make_tensor(mDqScale.iterator + first_row + row % HEADS_PER_KV, cute.make_layout(1))
                target[0] = Float32(float("nan"))
        tdQsdQ.store(shares.load())

    @cute.jit
    def reduce_dq(self, sdQ: cute.Tensor, mdQ: cute.Tensor, offset: Int64, warp: Int32):
        """Bulk reduce-add warp `warp`'s dQ share at `offset` (none if negative); close its bulk group."""
        with cute.arch.elect_one():
            if offset >= 0:
                source = (sdQ.iterator + (warp % TOKENS_PER_TILE) * HEADS_PER_KV * HEAD_DIM + self.dq_half(warp)).toint()
                if cutlass.const_expr(self.deterministic):
                    bulk_reduce_add_u32((mdQ.iterator + offset).toint(), source, Int32(DQ_SHARE * 4))
                else:
                    bulk_reduce_add_f32((mdQ.iterator + offset).toint(), source, Int32(DQ_SHARE * 4))
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def teacher_row(self, items: ItemScheduler, first: Int32, end: Int32, kv_head: Int32) -> Int64:
        """The teacher row this thread writes (quad lane `s`: token `s`'s); -1 past `end`."""
        entry = first + cute.arch.lane_idx() % 4
        row = Int64(-1)
        if entry < end:
            token, selection_slot = items.token_and_slot(entry)
            row = (Int64(token) * self.num_kv_heads + kv_head) * items.topk + selection_slot
        return row

    @cute.jit
    def store_teacher(self, mTeacher: cute.Tensor, probs_rc: cute.Tensor, coords_rc: cute.Tensor, row: Int64):
        """Write the tile's teacher to `row`: per key, the fp16 mean of `P^T` over the token's 16
        heads. A thread's columns are 4 per token, in token order."""
        lane_in_quad = cute.arch.lane_idx() % 4
        columns_per_token = cute.size(probs_rc, mode=[1]) // TOKENS_PER_TILE
        # A pointer of its own: the teacher may pass 2**31 elements.
        target = cute.make_tensor(mTeacher.iterator + row * BLOCK_SIZE, cute.make_layout(BLOCK_SIZE))
        for r in cutlass.range_constexpr(cute.size(probs_rc, mode=[0])):
            own_sum = Float32(0.0)
            for slot in cutlass.range_constexpr(TOKENS_PER_TILE):
                partial = Float32(0.0)
                for c in cutlass.range_constexpr(slot * columns_per_token, (slot + 1) * columns_per_token):
                    partial = partial + probs_rc[r, c]
                # Shuffles need every lane, so all compute each token's sum.
                head_sum = quad_sum(partial)
                if lane_in_quad == slot:
                    own_sum = head_sum
            if row >= 0:
                target[coords_rc[r, 0][0]] = (own_sum * Float32(1.0 / HEADS_PER_KV)).to(Float16)

    @cute.jit
    def add_keys(
        self, accumulator: cute.Tensor, acc: cute.Tensor, acc_rc: cute.Tensor, coords_rc: cute.Tensor, item: Item,
        scale: Float32,
    ):
        """`accumulator[key_row + key, kv_head] += scale * acc` for keys inside the document (atomics)."""
        for r in cutlass.range_constexpr(cute.size(acc_rc, mode=[0])):
            key = coords_rc[r, 0][0]
            if key < item.key_count:
                row = (Int64(item.key_row) + key) * self.num_kv_heads + item.kv_head
                base = (accumulator.iterator + row * HEAD_DIM).toint()
                for c in cutlass.range_constexpr(0, cute.size(acc_rc, mode=[1]), 2):
                    dim = coords_rc[r, c][1]
                    red_add_f32x2(base + dim * 4, acc_rc[r, c] * scale, acc_rc[r, c + 1] * scale)

    @cute.jit
    def store_keys(
        self, workspace: cute.Tensor, acc_rc: cute.Tensor, coords_rc: cute.Tensor, item: Int32, key_count: Int32,
        scale: Float32,
    ):
        """`workspace[item * 128 + key] = scale * acc` for keys inside the document (the only ones read)."""
        for r in cutlass.range_constexpr(cute.size(acc_rc, mode=[0])):
            key = coords_rc[r, 0][0]
            if key < key_count:
                row = Int64(item) * BLOCK_SIZE + key
                # A pointer of its own: the workspace may pass 2**31 elements.
                target = cute.make_tensor(workspace.iterator + row * HEAD_DIM, cute.make_layout(HEAD_DIM))
                for c in cutlass.range_constexpr(cute.size(acc_rc, mode=[1])):
                    target[coords_rc[r, c][1]] = acc_rc[r, c] * scale
