"""The SM90 (Hopper, sm_90a) forward kernel in CuTe DSL: KV-outer sparse attention with wgmma and TMA.

Scope: G = 16 query heads per KV head, D = 128, key blocks of 128, bf16 or fp16 (MiniMax-M3:
Hq = 64, Hkv = 4); any top-k. Everything else is the Triton backend's. The host side (input
checks, buffers, the plan, launch, compile cache, the combine) is `forward_host.py`. What this
kernel shares with the backward kernel: `common.py` (constants), `tile_scheduler.py` (the
persistent walk over the plan's items), `pipeline.py` (the TMA load pipelines), `mask.py` (which
keys a query sees), `softmax.py` and `tiles.py` (tile layouts and loads).

Design
------
* **Work.** The step's plan (`torch_msa/schedule.py`, the one every op of the step reads), walked
  by a persistent grid (`tile_scheduler.py`): items of one KV head's key block and the (query,
  slot) entries that chose it (128 in the plans the public API builds; the kernel walks items of
  any size), their entries taken four at a time: a *tile* of 4 tokens x 16 heads = 64 rows, one
  wgmma M.
* **CTA.** One warpgroup (128 threads), two CTAs per SM (113 KiB of shared memory each). Warp 0
  produces both TMA load pipelines (`pipeline.py`): per item the block's K and V (128 keys x 128
  dims each, two TMA boxes, one stage) and per tile its Q (two stages: the next tile loads while
  this one is computed). A token's 16 heads of one KV head are 16 consecutive rows of the
  `[Tq * Hq, 128]` view of q, so each token is one 16 x 128 TMA box written straight into its 16
  rows of the 128-byte swizzled operand tile. A Q stage is released as soon as `Q K^T` has read
  it, K and V once the item's last `P V` has.
* **Math.** `S = Q K^T` (wgmma, A and B from shared memory, fp32 accumulators in registers);
  hidden keys (`mask.py`) selected to `-inf`; softmax over the one block in registers
  (`softmax.py`: no online rescale, one block per slot); `O = P V` (wgmma with P from registers,
  V read through a transposed view of its shared-memory tile). Warp `w` owns token `w` of the
  tile, so a row's position, token and slot are per-warp scalars.
* **Document isolation under NaN.** `P = 0` does not stop a NaN of V (`0 * NaN = NaN`), so when
  the block runs past its document's end (`bucket_key_count < 128`) the rows of V beyond it are
  zeroed in shared memory before `P V`. Masked scores never reach a max or a sum.
* **Output.** Per (query, slot): the block-normalised partial output (input dtype) and its
  log2-sum-exp (fp32). The output tile goes through shared memory and leaves as one 16 x 128 TMA
  store per token (full 32-byte sectors; the TMA's 64-bit addressing, so no 2**31-element
  bound), the next tile's math overlapping the store. Laid out `[Tq, Hkv, topk, G]`, they are
  merged by the Triton combine kernel (`torch_msa.triton.stages.combine`) into `out` and
  the natural-log `lse`.

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
    load_next_tile,
    load_token_tile,
    token_rows_tma,
    token_tile_partition,
)

THREADS = 128  # one warpgroup
CONSUMER_WARPS = THREADS // 32


class Sm90ForwardKernel(BlocksKernel):
    """The SM90 forward blocks kernel; `__call__` is the `cute.jit` host function."""

    q_stages = 2

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
        sQ_layout = self.operand_a_tiles(qk_tiler, self.q_stages)
        # K and V are both (key, dim) tiles with dims contiguous; P V reads V transposed.
        sK_layout = self.operand_b_tiles(qk_tiler, 1)
        # The partial outputs leave through a one-stage tile laid out like a Q stage, one
        # token's 16 rows per TMA store into its (query, KV head, slot) rows.
        sO_layout = self.operand_a_tiles(qk_tiler, 1)

        (tma_atom_K, tma_K), (tma_atom_V, tma_V), (tma_atom_Q, tma_Q), token_rows = self.key_and_query_tma(
            mK, mV, mQ, sK_layout, sQ_layout
        )
        tma_atom_O, tma_O = token_rows_tma(cpasync.CopyBulkTensorTileS2GOp(), mPartialOut, token_rows)
        self.q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        # No alignment padding precedes the tiles: two CTAs' 113 KiB must fit an SM's 228 KiB.
        self.shared_storage = self.make_shared_storage(
            {"sK": sK_layout, "sV": sK_layout, "sQ": sQ_layout, "sO": sO_layout}, {}, self.q_stages
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
        lane = tidx % 32

        storage = SmemAllocator().allocate(self.shared_storage)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        # V as the (dim, key) B operand of P V: the same bytes, modes swapped (MN-major).
        sVt = cute.make_tensor(sV.iterator, cute.select(sV.layout, mode=[1, 0, 2]))
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        kv_pipeline, q_pipeline = self.load_pipelines(
            storage, tidx, (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O), self.q_stages, self.q_bytes, CONSUMER_WARPS
        )

        # Q: 16-row token blocks of the [Tq * Hq, 128] view into the 4 token slots of a tile;
        # the partial outputs: the 4 token slots of the output tile into 16-row blocks of the
        # partial rows (block (token * Hkv + kv head) * topk + slot).
        tQsQ, tQgQ = token_tile_partition(tma_atom_Q, tma_Q, sQ, self.q_stages)
        tOsO_tma, tOgO_tma = token_tile_partition(tma_atom_O, tma_O, sO, 1)
        key_copies = ((tma_atom_K, tma_K, sK), (tma_atom_V, tma_V, sV))
        q_copies = ((tma_atom_Q, tQgQ, tQsQ),)

        thr_qk = mma_qk.get_slice(tidx)
        thr_pv = mma_pv.get_slice(tidx)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sVt))
        tOsO = thr_pv.partition_C(sO[None, None, 0])
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

        items = ItemScheduler.create(schedule, topk)
        kv_load, kv_read = producer_state(1), consumer_state(1)
        q_load, q_read = producer_state(self.q_stages), consumer_state(self.q_stages)
        for index in cutlass.range(items.first, items.count, items.stride, unroll=1):
            item = items.item(index)
            if warp == 0:
                kv_load = load_key_blocks(kv_pipeline, kv_load, key_copies, item)
                q_load = load_token_tile(q_pipeline, q_load, q_copies, items, item, item.start, self.num_kv_heads)

            for tile in cutlass.range(item.num_tiles, unroll=1):
                first = item.start + tile * TOKENS_PER_TILE
                if warp == 0:
                    q_load = load_next_tile(q_pipeline, q_load, q_copies, items, item, tile, first, self.num_kv_heads)
                q_pipeline.consumer_wait(q_read)
                if tile == 0:
                    kv_pipeline.consumer_wait(kv_read)
                    if item.key_count < BLOCK_SIZE:
                        zero_keys_past(sV, item.key_count, tidx)

                # This warp's token (warp w owns rows 16 w .. 16 w + 15 of the tile).
                row_valid = first + warp < item.end
                token, slot = items.token_and_slot(items.tile_entry(first, warp, item.end))
                last_key = items.last_visible_key(token, item)

                # S = Q K^T
                warpgroup.fence()
                mma_qk.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                    cute.gemm(mma_qk, acc_S, tSrQ[None, None, k, q_read.index], tSrK[None, None, k, 0], acc_S)
                    mma_qk.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                # Only Q K^T reads the Q stage: the next load may refill it.
                q_pipeline.consumer_release(q_read)
                q_read.advance()

                row_shift = cute.make_rmem_tensor(rows_per_thread, Float32)
                row_sum = cute.make_rmem_tensor(rows_per_thread, Float32)
                for r in cutlass.range_constexpr(rows_per_thread):
                    hide_scores_past(s_rc, cS_rc, r, last_key)
                    row_shift[r], row_sum[r] = block_softmax_row(s_rc, r, scale_log2)
                rP.store(acc_S.load().to(self.dtype))

                # O = P V
                warpgroup.fence()
                mma_pv.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                    cute.gemm(mma_pv, acc_O, tOrP[None, None, k], tOrV[None, None, k, 0], acc_O)
                    mma_pv.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)

                # Normalise each row by its block sum: a row always sees its own key (sum >= 1),
                # unless its document holds NaN: then NaN flows on into out, as in the reference.
                for r in cutlass.range_constexpr(rows_per_thread):
                    inverse = Float32(1.0) / row_sum[r]
                    for c in cutlass.range_constexpr(cute.size(o_rc, mode=[1])):
                        o_rc[r, c] = o_rc[r, c] * inverse
                # The TMA has read the previous tile's output out of the one output tile.
                if warp == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier()
                tOsO.store(acc_O.load().to(self.dtype))
                # The generic-proxy stores of every thread before the TMA reads the tile.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier()
                if warp == 0:
                    self.store_partials(tma_atom_O, tOsO_tma, tOgO_tma, items, first, item.end, item.kv_head)
                if row_valid and lane % 4 == 0:
                    # Partials are [Tq, Hkv, topk, 16] rows: one (query, KV head) is contiguous.
                    base = ((token * self.num_kv_heads + item.kv_head) * topk + slot) * HEADS_PER_KV
                    for r in cutlass.range_constexpr(rows_per_thread):
                        head = cO_rc[r, 0][0] % HEADS_PER_KV
                        mPartialLse[base + head] = row_shift[r] + cute.math.log2(row_sum[r], fastmath=True)
            # Every warp's GEMMs of the item have completed: the next item may refill K and V.
            kv_pipeline.consumer_release(kv_read)
            kv_read.advance()
        # Shared memory must outlive the TMA's reads of the last output tile.
        if warp == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def store_partials(
        self, tma_atom: cute.CopyAtom, tOsO: cute.Tensor, tOgO: cute.Tensor, items: ItemScheduler,
        first: Int32, end: Int32, kv_head: Int32,
    ):
        """The output tile of entries `first .. first + 3` (those before `end`) to their partial
        rows: one TMA store per token, then one bulk group for the next tile to wait on."""
        for slot in cutlass.range_constexpr(TOKENS_PER_TILE):
            entry = first + slot
            if entry < end:
                token, query_slot = items.token_and_slot(entry)
                block = (token * self.num_kv_heads + kv_head) * items.topk + query_slot
                cute.copy(tma_atom, tOsO[None, slot, 0, 0], tOgO[None, block, 0])
        cute.arch.cp_async_bulk_commit_group()
