"""The SM90 (Hopper, sm_90a) forward kernel in CuTe DSL: KV-outer sparse attention with wgmma and TMA,
warp-specialised.

Scope: G = 16 query heads per KV head, D = 128, key blocks of 128, bf16 or fp16 (MiniMax-M3:
Hq = 64, Hkv = 4); any top-k. Everything else is the Triton backend's. The host side (input
checks, buffers, the plan, launch, compile cache, the combine) is `forward_host.py`. What this
kernel shares with the backward kernel: `common.py` (constants), `blocks_kernel.py` (wgmmas,
operand tiles, TMA, shared memory, pipelines), `tile_scheduler.py` (the persistent walk over the
plan's items), `pipeline.py` (the TMA load pipelines), `mask.py` (which keys a query sees),
`softmax.py` and `tiles.py` (tile layouts and loads).

Design
------
* **Work.** The step's plan (`torch_msa/plan/schedule.py`, the one every op of the step reads), walked
  by a persistent grid of one CTA per SM (`tile_scheduler.py`): items of one KV head's key block
  and the (query, slot) entries that chose it (128 in the plans the public API builds; the
  kernel walks items of any size), their entries taken four at a time: a *tile* of 4 tokens x 16
  heads = 64 rows, one wgmma M.
* **CTA: a producer and two consumer warpgroups** (384 threads, 224 KiB of shared memory). The
  producer warpgroup gives its registers to the consumers (`setmaxnreg`: 24 against 240); its
  warp 0 fills both TMA load pipelines (`pipeline.py`): per item the block's K and V (128 keys x
  128 dims each, two stages, so the next item's block loads during this one) and per tile its Q
  (four stages). A token's 16 heads of one KV head are 16 consecutive rows of the `[Tq * Hq,
  128]` view of q, so each token is one 16 x 128 TMA box written straight into its 16 rows of the
  128-byte swizzled operand tile. The CTA's tiles, counted over all its items, alternate between
  the consumer warpgroups (even to the first, odd to the second), so each owns two of the Q
  stages; a Q stage is released as soon as `Q K^T` has read it, a K/V stage once both consumers'
  last `P V` of the item have.
* **Math, per consumer tile.** `S = Q K^T` (wgmma, A and B from shared memory, fp32 accumulators
  in registers); hidden keys (`mask.py`) selected to `-inf`; softmax over the one block in
  registers (`softmax.py`: no online rescale, one block per slot); `O = P V` (wgmma with P from
  registers, V read through a transposed view of its shared-memory tile). Warp `w` of a
  warpgroup owns token `w` of its tile, so a row's position, token and slot are per-warp scalars.
* **Overlap.** Inside a consumer, `P V` of its previous tile and `Q K^T` of its next are issued
  together, so the tensor cores work while it writes the previous tile's output and computes the
  next tile's softmax; the two consumers interleave freely. The reads of the schedule a tile
  needs (its tokens, slots and positions) are issued before its GEMMs, so their latency hides
  behind them. The consumers do not take turns on the tensor cores (FA3's ping-pong; why not:
  docs/performance.md).
* **Document isolation under NaN.** `P = 0` does not stop a NaN of V (`0 * NaN = NaN`), so when
  the block runs past its document's end (`bucket_key_count < 128`) the rows of V beyond it are
  zeroed in shared memory before `P V`. Both consumers zero the same rows with the same zeros
  before their first tile of the item, so neither waits for the other: a read that races another
  warpgroup's write of an equal value reads that value. Masked scores never reach a max or a sum.
* **Output.** Per (query, slot): the block-normalised partial output (input dtype) and its
  log2-sum-exp (fp32). A warp holds all 16 rows of its token, so it writes them to its rows of
  its consumer's shared-memory output tile and stores them by one 16 x 128 TMA store (full
  32-byte sectors; the TMA's 64-bit addressing, so no 2**31-element bound) without waiting for
  the other warps, the consumer's later tiles overlapping the store. Laid out `[Tq, Hkv, topk,
  G]`, they are merged by the Triton combine kernel (`torch_msa.triton.stages.combine`) into
  `out` and the natural-log `lse`.

Bytes per token (M3, bf16, top-16, long documents, nothing kept in L2): a token has 64 entries
(4 KV heads x 16 slots). Q is read once per entry, 64 x 16 heads x 128 x 2 B = 256 KiB; the
partial outputs are written and read back, 2 x 256 KiB, and their lse 2 x 4 KiB; `out` is
written, 16 KiB; K and V of a block (64 KiB) are read once per item of up to 128 entries, 32 KiB
per token. Total about 824 KiB = 0.84 MB per token, 60 % of it the partials. What that bounds
on a given GPU, what was measured and what is left to gain: docs/performance.md.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..cute_dsl.compat import SmemAllocator
from .blocks_kernel import K_MAJOR, MN_MAJOR, BlocksKernel, thread_and_warp
from .common import BLOCK_SIZE, HEAD_DIM, HEADS_PER_KV, TILE_ROWS, TOKENS_PER_TILE, ScheduleOperands
from .mask import hide_scores_past, zero_keys_past
from .pipeline import consumer_state, producer_state
from .softmax import block_softmax_row
from .tile_scheduler import ItemScheduler
from .tiles import (
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
# Named barriers (0 is the CTA's): one per consumer over its own 128 threads (the zeroed V rows).
WARPGROUP_BARRIER = 1


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
        self.dtype = mQ.element_type
        # S = Q K^T: M = 64 rows, N = 128 keys, K = 128 dims. O = P V: N = 128 dims, K = 128 keys.
        mma_qk = self.tiled_mma(K_MAJOR, (1, 1, 1), (TILE_ROWS, BLOCK_SIZE))
        mma_pv = self.tiled_mma(MN_MAJOR, (1, 1, 1), (TILE_ROWS, HEAD_DIM), warpgroup.OperandSource.RMEM)
        qk_tiler = (TILE_ROWS, BLOCK_SIZE, HEAD_DIM)
        sQ_layout = self.operand_a_tiles(qk_tiler, Q_STAGES)
        # K and V are both (key, dim) tiles with dims contiguous; P V reads V transposed.
        sK_layout = self.operand_b_tiles(qk_tiler, KV_STAGES)
        # The partial outputs leave through one tile per consumer, laid out like a Q stage, one
        # token's 16 rows per TMA store into its (query, KV head, slot) rows.
        sO_layout = self.operand_a_tiles(qk_tiler, CONSUMERS)

        (tma_atom_K, tma_K), (tma_atom_V, tma_V), (tma_atom_Q, tma_Q), token_rows = self.key_and_query_tma(
            mK, mV, mQ, sK_layout, sQ_layout
        )
        tma_atom_O, tma_O = token_rows_tma(cpasync.CopyBulkTensorTileS2GOp(), mPartialOut, token_rows)
        self.q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        # 224 KiB of the 227 KiB a CTA may have: no alignment padding precedes the tiles.
        self.shared_storage = self.make_shared_storage(
            {"sK": sK_layout, "sV": sK_layout, "sQ": sQ_layout, "sO": sO_layout}, {}, KV_STAGES, Q_STAGES
        )
        self.kernel(
            mma_qk, mma_pv, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_O, tma_O,
            mPartialLse, schedule, topk, scale_log2, sQ_layout, sK_layout, sO_layout,
        ).launch(grid=(grid_size, 1, 1), block=(THREADS, 1, 1), stream=stream)

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
        storage = SmemAllocator().allocate(self.shared_storage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        kv_pipeline, q_pipeline = self.load_pipelines(
            storage, tidx, (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O),
            (KV_STAGES, CONSUMERS * WARPS_PER_WARPGROUP), (Q_STAGES, self.q_bytes, WARPS_PER_WARPGROUP),
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
        """Warp 0: per item, its block's K and V, then the Q of each of its tiles, in the order the
        consumers read them; each load waits for its stage to be released."""
        # Q: 16-row token blocks of the [Tq * Hq, 128] view into the 4 token slots of a tile.
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
        """Consumer warpgroup `consumer` (`thread`, `warp`: this thread's and warp's index in it):
        the tiles it owns of every item (the module docstring's overlap). Each step issues the GEMMs
        of up to two tiles, `P V` of the pending tile (its softmax done) and `Q K^T` of the next,
        then writes the pending tile's output while `Q K^T` runs, and computes the next tile's
        softmax."""
        # V as the (dim, key) B operand of P V: the same bytes, modes swapped (MN-major).
        sVt = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))
        # The partial outputs: the 4 token slots of this consumer's output tile into 16-row blocks
        # of the partial rows (block (token * Hkv + kv head) * topk + slot).
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
        # The pending tile's row statistics: its rows' shift and sum (log2-sum-exp = shift + log2(sum)).
        row_shift = cute.make_rmem_tensor(rows_per_thread, Float32)
        row_sum = cute.make_rmem_tensor(rows_per_thread, Float32)
        output = (acc_O, o_rc, cO_rc, row_shift, row_sum, tOsO, tma_atom_O, tOsO_tma, tOgO_tma, mPartialLse)

        kv_read = consumer_state(KV_STAGES)
        # This consumer reads every other Q stage, starting from its own first tile's.
        q_read = consumer_state(Q_STAGES)
        if consumer == 1:
            q_read.advance()
        tiles_before = Int32(0)  # the CTA's tiles in its items before this one
        for index in cutlass.range(items.first, items.count, items.stride, unroll=1):
            item = items.item(index)
            # This consumer's tiles of the item: `first_own`, `first_own + 2`, ...: `own` of them.
            first_own = (consumer + tiles_before) % CONSUMERS
            own = (item.num_tiles - first_own + 1) // CONSUMERS
            kv_stage = kv_read.index
            kv_pipeline.consumer_wait(kv_read)
            if own > 0:
                if item.key_count < BLOCK_SIZE:
                    zero_keys_past(sV[None, None, kv_stage], item.key_count, thread)
                    cute.arch.barrier(barrier_id=WARPGROUP_BARRIER + consumer, number_of_threads=WARPGROUP_THREADS)
                # The GEMMs are issued in straight-line code and waited for before their
                # accumulators are read, so that the compiler keeps the wgmmas asynchronous.
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
            # This consumer's GEMMs of the item have completed: its K/V stage may be refilled.
            kv_pipeline.consumer_release(kv_read)
            kv_read.advance()
            tiles_before += item.num_tiles
        # Shared memory must outlive the TMA's reads of the last output rows.
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def warp_row(self, items: ItemScheduler, item, first: Int32, warp: Int32):
        """This warp's token of the tile at `item`'s entry `first` (warp w owns rows 16 w .. 16 w + 15):
        `(block, last_key)`, its 16-row block of the partial rows, `(token * Hkv + kv head) * topk +
        slot` (-1 for a slot past the item's end), and the last key of the block it sees. Read
        before the tile's GEMMs are issued, so that the reads' latency hides behind them."""
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
        """After `Q K^T` of a tile has completed: release its Q stage, and turn its scores (keys past
        this warp's `last_key` hidden) into the probabilities `rP` (the A operand of its `P V`) and
        its rows' shift and sum. Returns `q_read` advanced to this consumer's next Q stage."""
        # Only Q K^T reads the Q stage: the next load may refill it.
        q_pipeline.consumer_release(q_read)
        for _ in cutlass.range_constexpr(CONSUMERS):
            q_read.advance()
        for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
            hide_scores_past(s_rc, cS_rc, r, last_key)
            row_shift[r], row_sum[r] = block_softmax_row(s_rc, r, scale_log2)
        rP.store(acc_S.load().to(self.dtype))
        return q_read

    @cute.jit
    def write_output(self, output: tuple, block: Int32, consumer: Int32, thread: Int32, warp: Int32):
        """The partials of this warp's token of a tile (`block`, from `warp_row`; none for -1):
        `acc_O` normalised by the row sums, through this warp's 16 rows of the consumer's output
        tile to one TMA store, and the rows' log2-sum-exp. `output`: the accumulator, its (rows,
        cols) view and coordinates, the row statistics, the output tile (as `acc_O`'s partition
        and as the TMA's) and the partial rows (the TMA's view, and the lse). A warp holds all of
        its token's rows, so it writes and stores them without waiting for the other warps."""
        acc_O, o_rc, cO_rc, row_shift, row_sum, tOsO, tma_atom_O, tOsO_tma, tOgO_tma, mPartialLse = output
        # Normalise each row by its block sum: a row always sees its own key (sum >= 1), unless
        # its document holds NaN: then NaN flows on into out, as in the reference.
        for r in cutlass.range_constexpr(cute.size(o_rc, mode=[0])):
            inverse = Float32(1.0) / row_sum[r]
            for c in cutlass.range_constexpr(cute.size(o_rc, mode=[1])):
                o_rc[r, c] = o_rc[r, c] * inverse
        # The TMA has read this warp's previous output out of its rows: the lane that issued the
        # store waits for it, and the warp for that lane.
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()
        tOsO.store(acc_O.load().to(self.dtype))
        # The generic-proxy stores of the warp's threads before the TMA reads the rows.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if block >= 0:
            cute.copy(tma_atom_O, tOsO_tma[None, warp, 0, consumer], tOgO_tma[None, block, 0])
            cute.arch.cp_async_bulk_commit_group()
            if thread % 4 == 0:
                # Partials are [Tq, Hkv, topk, 16] rows: one (query, KV head) is contiguous.
                for r in cutlass.range_constexpr(cute.size(o_rc, mode=[0])):
                    head = cO_rc[r, 0][0] % HEADS_PER_KV
                    mPartialLse[block * HEADS_PER_KV + head] = row_shift[r] + cute.math.log2(row_sum[r], fastmath=True)


@cute.jit
def issue_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor):
    """Issue `acc = a b` (fragments `(mma, M or N, K steps)`) as one wgmma group; the caller waits.
    A fresh atom carries the accumulate flag, so that no value set here outlives the call."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, False)
    for k in cutlass.range_constexpr(cute.size(a, mode=[2])):
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
