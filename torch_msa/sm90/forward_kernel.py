"""The SM90 forward kernel (CuTe DSL, sm_90a): KV-outer sparse attention, warp-specialised, with
wgmma and TMA. Writes per-(query, slot) partial outputs `[Tq * Hkv * topk * 16, 128]` and their
fp32 log2-sum-exp; host side `forward_host.py`, design `README.md`.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..cute_dsl.compat import SmemAllocator
from .blocks_kernel import K_MAJOR, MN_MAJOR, BlocksKernel, thread_and_warp
from .common import BLOCK_SIZE, HEAD_DIM, HEADS_PER_KV, LN_2, TILE_ROWS, TOKENS_PER_TILE, ScheduleOperands
from .mask import hide_scores_past, zero_keys_past
from .pipeline import consumer_state, producer_state
from .softmax import block_softmax_row
from .tile_scheduler import ItemScheduler
from .tma import (
    accumulator_as_operand_a,
    accumulator_rows_cols,
    load_key_blocks,
    load_token_tile,
    token_rows_tma,
    token_tile_partition,
)

WARPGROUP_THREADS = 128
CONSUMERS = 2  # consumer warpgroups; warpgroup 0 is the producer
THREADS = (1 + CONSUMERS) * WARPGROUP_THREADS
WARPS_PER_WARPGROUP = WARPGROUP_THREADS // 32
PRODUCER_REGISTERS = 24
CONSUMER_REGISTERS = 240  # 128 x 24 + 256 x 240 of the SM's 64K registers
KV_STAGES = 2
Q_STAGES = 2 * CONSUMERS  # two per consumer: its next tile loads while this one is computed
WARPGROUP_BARRIER = 1  # named barrier of consumer 0 (0 is the CTA's); consumer 1 takes the next


class ConsumerTiles(NamedTuple):
    """A consumer warpgroup's wgmma operands (`Q K^T`: `tSrQ`, `tSrK`; `P V`: `tOrP` over `rP`,
    `tOrV`), the scores `acc_S` as (row, key) `s_rc` with coordinates `cS_rc`, and `output`: what
    `Sm90ForwardKernel.write_output` takes, from the output accumulator and its rows' shift and sum."""

    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrV: cute.Tensor
    acc_S: cute.Tensor
    s_rc: cute.Tensor
    cS_rc: cute.Tensor
    rP: cute.Tensor
    tOrP: cute.Tensor
    output: tuple


class Sm90ForwardKernel(BlocksKernel):
    """The SM90 forward blocks kernel; `__call__` is the `cute.jit` host function."""

    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,  # `BlocksKernel`
        mPartialOut: cute.Tensor,  # [Tq * Hkv * topk * 16, 128]
        mPartialLse: cute.Tensor,  # fp32 [Tq * Hkv * topk * 16]
        *schedule_and_scalars,  # `BlocksKernel`: the schedule, then topk, scale_log2, grid_size, stream
    ):
        schedule, (topk, scale_log2, grid_size, stream) = self.split_schedule(schedule_and_scalars)
        operands, layouts = self.prepare(mQ, mK, mV, mPartialOut)
        self.kernel(*operands, mPartialLse, schedule, topk, scale_log2, *layouts).launch(
            grid=(grid_size, 1, 1), block=(THREADS, 1, 1), stream=stream
        )

    def prepare(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mPartialOut: cute.Tensor):
        """Set `dtype`, `q_bytes` and `shared_storage`; return `(operands, layouts)`: the wgmmas and
        the TMA atoms and views (`mma_qk, mma_pv`, then Q, K, V, O) and the shared-memory tiles
        (`sQ, sK, sO`), as `kernel` takes them."""
        self.dtype = mQ.element_type
        mma_qk = self.tiled_mma(K_MAJOR, (1, 1, 1), (TILE_ROWS, BLOCK_SIZE))
        mma_pv = self.tiled_mma(MN_MAJOR, (1, 1, 1), (TILE_ROWS, HEAD_DIM), warpgroup.OperandSource.RMEM)
        qk_tiler = (TILE_ROWS, BLOCK_SIZE, HEAD_DIM)
        sQ_layout = self.operand_a_tiles(qk_tiler, Q_STAGES)
        sK_layout = self.operand_b_tiles(qk_tiler, KV_STAGES)
        # One output tile per consumer, laid out like a Q stage.
        sO_layout = self.operand_a_tiles(qk_tiler, CONSUMERS)

        (tma_atom_K, tma_K), (tma_atom_V, tma_V), (tma_atom_Q, tma_Q), token_rows = self.key_and_query_tma(
            mK, mV, mQ, sK_layout, sQ_layout
        )
        tma_atom_O, tma_O = token_rows_tma(cpasync.CopyBulkTensorTileS2GOp(), mPartialOut, token_rows)
        self.q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        self.shared_storage = self.make_shared_storage(
            {"sK": sK_layout, "sV": sK_layout, "sQ": sQ_layout, "sO": sO_layout}, {}, KV_STAGES, Q_STAGES
        )
        operands = (mma_qk, mma_pv, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_O, tma_O)
        return operands, (sQ_layout, sK_layout, sO_layout)

    @cute.kernel
    def kernel(
        self,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        tma_atom_Q: cute.CopyAtom,
        tma_Q: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        tma_K: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tma_V: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        tma_O: cute.Tensor,
        mPartialLse: cute.Tensor,
        schedule: ScheduleOperands,
        topk: Int32,
        scale_log2: Float32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
    ):
        tidx, warp = thread_and_warp()
        (sQ, sK, sV, sO), (kv_pipeline, q_pipeline) = self.shared_tiles(
            tidx, (sQ_layout, sK_layout, sO_layout), (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O)
        )
        items = ItemScheduler.create(schedule, topk)
        warpgroup_index = warp // WARPS_PER_WARPGROUP
        if warpgroup_index == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                self.produce(kv_pipeline, q_pipeline, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
                             sQ, sK, sV, items)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self.consume(
                mma_qk, mma_pv, kv_pipeline, q_pipeline, tma_atom_O, tma_O, mPartialLse, sQ, sK, sV, sO, items,
                scale_log2, warpgroup_index - 1, tidx % WARPGROUP_THREADS, warp % WARPS_PER_WARPGROUP,
            )

    @cute.jit
    def produce(
        self, kv_pipeline, q_pipeline, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
        sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, items: ItemScheduler,
    ):
        """Warp 0: per item its K and V, then the Q of each tile, in the consumers' order."""
        tQsQ, tQgQ = token_tile_partition(tma_atom_Q, tma_Q, sQ, Q_STAGES)
        key_copies = ((tma_atom_K, tma_K, sK), (tma_atom_V, tma_V, sV))
        q_copies = ((tma_atom_Q, tQgQ, tQsQ),)
        kv_load, q_load = producer_state(KV_STAGES), producer_state(Q_STAGES)
        for index in cutlass.range(items.first, items.count, items.stride, unroll=1):
            item = items.item(index)
            kv_load = load_key_blocks(kv_pipeline, kv_load, key_copies, item)
            for tile in cutlass.range(item.num_tiles, unroll=1):
                q_load = load_token_tile(
                    q_pipeline, q_load, q_copies, items, item, item.start + tile * TOKENS_PER_TILE, self.num_kv_heads
                )

    @cute.jit
    def consume(
        self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, kv_pipeline, q_pipeline, tma_atom_O, tma_O,
        mPartialLse: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sO: cute.Tensor,
        items: ItemScheduler, scale_log2: Float32, consumer: Int32, thread: Int32, warp: Int32,
    ):
        """Consumer warpgroup `consumer` (`thread`, `warp`: indices within it) over its tiles of every
        item: `P V` of the pending tile and `Q K^T` of the next are issued together, the pending
        output written while `Q K^T` runs."""
        tSrQ, tSrK, tOrV, acc_S, s_rc, cS_rc, rP, tOrP, output = self.consumer_tiles(
            mma_qk, mma_pv, sQ, sK, sV, sO, tma_atom_O, tma_O, mPartialLse, consumer, thread
        )
        acc_O, _, _, row_shift, row_sum = output[:5]

        kv_read = consumer_state(KV_STAGES)
        q_read = consumer_state(Q_STAGES)
        if consumer == 1:
            q_read.advance()
        tiles_before = Int32(0)  # the CTA's tiles in its items before this one
        for index in cutlass.range(items.first, items.count, items.stride, unroll=1):
            item = items.item(index)
            # This consumer's tiles of the item: `first_own`, `first_own + 2`, ...
            first_own = (consumer + tiles_before) % CONSUMERS
            own = (item.num_tiles - first_own + 1) // CONSUMERS
            kv_stage = kv_read.index
            kv_pipeline.consumer_wait(kv_read)
            if own > 0:
                if item.key_count < BLOCK_SIZE:
                    zero_keys_past(sV[None, None, kv_stage], item.key_count, thread)
                    cute.arch.barrier(barrier_id=WARPGROUP_BARRIER + consumer, number_of_threads=WARPGROUP_THREADS)
                # Straight-line issue, waits before every accumulator read: otherwise ptxas
                # serialises the wgmmas.
                first = item.start + first_own * TOKENS_PER_TILE
                block, last_key = self.warp_row(items, item, first, warp)
                q_pipeline.consumer_wait(q_read)
                issue_gemm(mma_qk, acc_S, tSrQ[None, None, None, q_read.index], tSrK[None, None, None, kv_stage])
                warpgroup.wait_group(0)
                q_read = self.scores_to_probabilities(
                    s_rc, cS_rc, rP, acc_S, row_shift, row_sum, q_pipeline, q_read, last_key, scale_log2
                )
                for tile in cutlass.range(1, own, unroll=1):
                    pending_block = block
                    first = item.start + (first_own + CONSUMERS * tile) * TOKENS_PER_TILE
                    block, last_key = self.warp_row(items, item, first, warp)
                    q_pipeline.consumer_wait(q_read)
                    issue_gemm(mma_pv, acc_O, tOrP, tOrV[None, None, None, kv_stage])
                    issue_gemm(mma_qk, acc_S, tSrQ[None, None, None, q_read.index], tSrK[None, None, None, kv_stage])
                    warpgroup.wait_group(1)
                    self.write_output(output, pending_block, consumer, thread, warp)
                    warpgroup.wait_group(0)
                    q_read = self.scores_to_probabilities(
                        s_rc, cS_rc, rP, acc_S, row_shift, row_sum, q_pipeline, q_read, last_key, scale_log2
                    )
                issue_gemm(mma_pv, acc_O, tOrP, tOrV[None, None, None, kv_stage])
                warpgroup.wait_group(0)
                self.write_output(output, block, consumer, thread, warp)
            kv_pipeline.consumer_release(kv_read)
            kv_read.advance()
            tiles_before += item.num_tiles
        # Shared memory must outlive the TMA's reads of the last output rows.
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    def shared_tiles(self, tidx: Int32, layouts: tuple, atoms: tuple):
        """`((sQ, sK, sV, sO), (kv_pipeline, q_pipeline))`: the shared-memory tiles of `layouts`
        (`prepare`'s) and the load pipelines on their barriers, the TMA `atoms`' descriptors
        prefetched."""
        sQ_layout, sK_layout, sO_layout = layouts
        storage = SmemAllocator().allocate(self.shared_storage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        pipelines = self.load_pipelines(
            storage, tidx, atoms, (KV_STAGES, CONSUMERS * WARPS_PER_WARPGROUP),
            (Q_STAGES, self.q_bytes, WARPS_PER_WARPGROUP),
        )
        return (sQ, sK, sV, sO), pipelines

    def consumer_tiles(
        self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
        sO: cute.Tensor, tma_atom_O, tma_O, mPartialLse: cute.Tensor, consumer: Int32, thread: Int32,
    ) -> ConsumerTiles:
        """A consumer warpgroup's operands and registers (`thread`: its index within the warpgroup)."""
        # V as the (dim, key) B operand of P V: same bytes, modes swapped.
        sVt = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))
        tOsO_tma, tOgO_tma = token_tile_partition(tma_atom_O, tma_O, sO, CONSUMERS)
        thr_qk = mma_qk.get_slice(thread)
        thr_pv = mma_pv.get_slice(thread)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sVt))
        tOsO = thr_pv.partition_C(sO[None, None, consumer])
        cS = thr_qk.partition_C(cute.make_identity_tensor((TILE_ROWS, BLOCK_SIZE)))
        cO = thr_pv.partition_C(cute.make_identity_tensor((TILE_ROWS, HEAD_DIM)))
        acc_S = cute.make_rmem_tensor(cS.shape, self.acc_dtype)
        acc_O = cute.make_rmem_tensor(cO.shape, self.acc_dtype)
        s_rc, o_rc, cS_rc, cO_rc = (
            cute.make_tensor(x.iterator, accumulator_rows_cols(x.layout)) for x in (acc_S, acc_O, cS, cO)
        )
        rP = cute.make_rmem_tensor(cS.shape, self.dtype)
        tOrP = cute.make_tensor(rP.iterator, accumulator_as_operand_a(rP.layout))
        rows_per_thread = cute.size(s_rc, mode=[0])
        # The rows' log2-sum-exp = shift + log2(sum).
        row_shift = cute.make_rmem_tensor(rows_per_thread, Float32)
        row_sum = cute.make_rmem_tensor(rows_per_thread, Float32)
        output = (acc_O, o_rc, cO_rc, row_shift, row_sum, tOsO, tma_atom_O, tOsO_tma, tOgO_tma, mPartialLse)
        return ConsumerTiles(tSrQ, tSrK, tOrV, acc_S, s_rc, cS_rc, rP, tOrP, output)

    @cute.jit
    def warp_row(self, items: ItemScheduler, item, first: Int32, warp: Int32):
        """`(block, last_key)` of this warp's token in the tile at entry `first`: its partial-rows block
        `(token * Hkv + kv_head) * topk + slot` (-1 past the item's end), its last visible key."""
        token, slot = items.token_and_slot(items.tile_entry(first, warp, item.end))
        block = (token * self.num_kv_heads + item.kv_head) * items.topk + slot
        if first + warp >= item.end:
            block = Int32(-1)
        return block, items.last_visible_key(token, item)

    @cute.jit
    def scores_to_probabilities(
        self, s_rc: cute.Tensor, cS_rc: cute.Tensor, rP: cute.Tensor, acc_S: cute.Tensor, row_shift: cute.Tensor,
        row_sum: cute.Tensor, q_pipeline, q_read, last_key: Int32, scale_log2: Float32,
    ):
        """After `Q K^T`: release the Q stage (nothing else reads it), turn the scores into `rP` and the
        rows' shift and sum. Returns `q_read` at this consumer's next Q stage."""
        q_pipeline.consumer_release(q_read)
        for _ in cutlass.range_constexpr(CONSUMERS):
            q_read.advance()
        for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            hide_scores_past(s_rc, cS_rc, r, last_key)
            row_shift[r], row_sum[r] = block_softmax_row(s_rc, r, scale_log2)
        rP.store(acc_S.load().to(self.dtype))
        return q_read

    @cute.jit
    def write_output(self, output: tuple, block: Int32, consumer: Int32, thread: Int32, warp: Int32,
                     natural: cutlass.Constexpr[bool] = False):
        """Store this warp's token (`block` from `warp_row`; none for -1): normalised `acc_O` by one TMA
        store through the output tile, and the rows' log2-sum-exp (with `natural`, their natural
        log-sum-exp, as `combine` writes it). `output` as packed by `consume`."""
        acc_O, o_rc, cO_rc, row_shift, row_sum, tOsO, tma_atom_O, tOsO_tma, tOgO_tma, mRowLse = output
        # A row sees its own key, so sum >= 1, unless NaN: that flows into out, as in the reference.
        for r in cutlass.range_constexpr(cute.size(o_rc, mode=[0])):
            inverse = Float32(1.0) / row_sum[r]
            for c in cutlass.range_constexpr(cute.size(o_rc, mode=[1])):
                o_rc[r, c] = o_rc[r, c] * inverse
        # The issuing lane waits for the TMA to read the previous output, the warp for that lane.
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()
        tOsO.store(acc_O.load().to(self.dtype))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if block >= 0:
            cute.copy(tma_atom_O, tOsO_tma[None, warp, 0, consumer], tOgO_tma[None, block, 0])
            cute.arch.cp_async_bulk_commit_group()
            if thread % 4 == 0:
                for r in cutlass.range_constexpr(cute.size(o_rc, mode=[0])):
                    head = cO_rc[r, 0][0] % HEADS_PER_KV
                    row_lse = row_shift[r] + cute.math.log2(row_sum[r], fastmath=True)
                    if cutlass.const_expr(natural):
                        row_lse = row_lse * Float32(LN_2)
                    mRowLse[block * HEADS_PER_KV + head] = row_lse


@cute.jit
def issue_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
               accumulate: cutlass.Constexpr[bool] = False):
    """Issue `acc = a b` (with `accumulate`, `acc += a b`) as one wgmma group; the caller waits. A
    fresh atom keeps the accumulate flag local."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
