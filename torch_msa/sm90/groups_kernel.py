"""The SM90 query-outer kernel (CuTe DSL, sm_90a): per (query group, KV head), the group's listed
blocks with an online softmax, written into the KV-outer forward's partials, or straight into the
forward's output where the query has no KV-outer entry (the query-outer stage,
`torch_msa/stages/README.md`); host side `forward_host.py`.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from .blocks_kernel import thread_and_warp
from .common import BLOCK_SIZE, TOKENS_PER_TILE
from .forward_kernel import (
    CONSUMER_REGISTERS,
    CONSUMERS,
    KV_STAGES,
    PRODUCER_REGISTERS,
    Q_STAGES,
    THREADS,
    WARPGROUP_BARRIER,
    WARPGROUP_THREADS,
    WARPS_PER_WARPGROUP,
    Sm90ForwardKernel,
    issue_gemm,
)
from .mask import hide_scores_past, zero_keys_past
from .pipeline import consumer_state, producer_state
from .softmax import online_softmax_row
from .tma import (
    load_key_block,
    query_rows,
    token_box_layout,
    token_rows_tma,
    token_tile_partition,
)

# Selection slots a loop over a query's row reads per unrolled step (M3's top-16 in one).
SLOT_UNROLL = 16


class GroupTables(NamedTuple):
    """The int32 tables the kernel reads (`torch_msa.plan.groups.QueryGroups` and the call's
    selection, flat): the selection and its KV-outer part `[Hkv * Tq * topk]`, the groups' bounds
    `[NG]`, their listed blocks `[Hkv * NG * MQ]` and distinct blocks `[Hkv * NG]` (a listed unit
    lists all of them); per group the packed row of its document's key 0 and its first query's
    position `[NG]`; the listed (group, KV head) units `[Hkv * NG]` and the units of the groups
    before each id `[NG + 1]`."""

    block_indices: cute.Tensor
    kv_outer_indices: cute.Tensor
    group_start: cute.Tensor
    group_end: cute.Tensor
    group_blocks: cute.Tensor
    group_union: cute.Tensor
    group_key_start: cute.Tensor
    group_position: cute.Tensor
    units: cute.Tensor
    units_before: cute.Tensor


class Unit(NamedTuple):
    """One (group, KV head): queries `start .. end - 1` (inside the window), `num_listed` blocks;
    `key_row`, the packed row of its document's key 0; query `t` at position `t + position_shift`."""

    group: Int32
    kv_head: Int32
    start: Int32
    end: Int32
    num_listed: Int32
    key_row: Int32
    position_shift: Int32


class Sm90GroupsKernel(Sm90ForwardKernel):
    """The SM90 query-outer kernel; `__call__` is the `cute.jit` host function."""

    @cute.jit
    def __call__(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
        mPartialOut: cute.Tensor,  # [Tq_w * Hkv * topk * 16, 128]
        mPartialLse: cute.Tensor,  # fp32 [Tq_w * Hkv * topk * 16]
        mOut: cute.Tensor,  # [Tq_w, Hq, 128], the forward's output
        mLse: cute.Tensor,  # fp32 [Tq_w * Hq], the forward's natural log-sum-exp
        mDone: cute.Tensor,  # int32 [Tq_w * Hkv], 1 where this kernel wrote the output
        *tables_and_scalars,  # `GroupTables`, topk, scale_log2, the unit walk's scalars, grid_size, stream
    ):
        count = len(GroupTables._fields)
        tables = GroupTables(*tables_and_scalars[:count])
        topk, scale_log2, most, num_ids, num_queries, first_group, last_group, window_start, window_stop, grid_size, \
            stream = tables_and_scalars[count:]
        operands, layouts = self.prepare(mQ, mK, mV, mPartialOut)
        tma_atom_Out, tma_Out = token_rows_tma(cpasync.CopyBulkTensorTileS2GOp(), query_rows(mOut, self.num_heads),
                                               token_box_layout(layouts[0]))
        self.kernel(
            *operands, mPartialLse, tma_atom_Out, tma_Out, mLse, mDone, tables, topk, most, num_ids, num_queries,
            first_group, last_group, window_start, window_stop, scale_log2, *layouts,
        ).launch(grid=(grid_size, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(
        self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, tma_atom_Q: cute.CopyAtom, tma_Q: cute.Tensor,
        tma_atom_K: cute.CopyAtom, tma_K: cute.Tensor, tma_atom_V: cute.CopyAtom, tma_V: cute.Tensor,
        tma_atom_O: cute.CopyAtom, tma_O: cute.Tensor, mPartialLse: cute.Tensor, tma_atom_Out: cute.CopyAtom,
        tma_Out: cute.Tensor, mLse: cute.Tensor, mDone: cute.Tensor, tables: GroupTables, topk: Int32, most: Int32,
        num_ids: Int32, num_queries: Int32, first_group: Int32, last_group: Int32, window_start: Int32,
        window_stop: Int32, scale_log2: Float32, sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
    ):
        tidx, warp = thread_and_warp()
        (sQ, sK, sV, sO), (kv_pipeline, q_pipeline) = self.shared_tiles(
            tidx, (sQ_layout, sK_layout, sO_layout), (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O)
        )
        walk = (tables, most, num_ids, window_start, window_stop)
        # The listed units of the window's groups, handed out in turn.
        units = (tables.units_before[first_group], tables.units_before[last_group + 1])
        warpgroup_index = warp // WARPS_PER_WARPGROUP
        if warpgroup_index == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                self.produce(kv_pipeline, q_pipeline, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, sQ, sK,
                             sV, walk, units)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self.consume(
                mma_qk, mma_pv, kv_pipeline, q_pipeline, tma_atom_O, tma_O, mPartialLse, (tma_atom_Out, tma_Out, mLse),
                mDone, sQ, sK, sV, sO, walk, units, topk, num_queries, scale_log2, warpgroup_index - 1,
                tidx % WARPGROUP_THREADS, warp % WARPS_PER_WARPGROUP,
            )

    @cute.jit
    def unit(self, walk: tuple, index: Int32) -> Unit:
        """Listed unit `index` (`GroupTables.units`): its group and KV head, cut to the window;
        `num_listed` counts its listed blocks (ascending, `-1` after), 0 outside the window."""
        tables, most, num_ids, window_start, window_stop = walk
        unit_id = tables.units[index]
        group = unit_id // self.num_kv_heads
        kv_head = unit_id - group * self.num_kv_heads
        start = cutlass.max(tables.group_start[group], window_start)
        end = cutlass.min(tables.group_end[group], window_stop)
        # A listed unit runs its whole group query-outer: it lists every distinct block (at most
        # `most` by the rule), one load where a scan of the row would be a chain of them.
        num_listed = cutlass.min(tables.group_union[kv_head * num_ids + group], most)
        if start >= end:
            num_listed = Int32(0)
        position_shift = tables.group_position[group] - tables.group_start[group]
        return Unit(group, kv_head, start, end, num_listed, tables.group_key_start[group], position_shift)

    @cute.jit
    def listed_block(self, walk: tuple, unit: Unit, index: Int32) -> Int32:
        tables, most, num_ids = walk[0], walk[1], walk[2]
        return tables.group_blocks[(unit.kv_head * num_ids + unit.group) * most + index]

    @cute.jit
    def produce(
        self, kv_pipeline, q_pipeline, tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V,
        sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, walk: tuple, units: tuple,
    ):
        """Warp 0: per unit the Q tile of each consumer (4 tokens each; a token past the group's end
        repeats its last), then K and V of each listed block."""
        window_start = walk[3]
        tQsQ, tQgQ = token_tile_partition(tma_atom_Q, tma_Q, sQ, Q_STAGES)
        kv_load, q_load = producer_state(KV_STAGES), producer_state(Q_STAGES)
        for index in cutlass.range(units[0] + cute.arch.block_idx()[0], units[1], cute.arch.grid_dim()[0], unroll=1):
            unit = self.unit(walk, index)
            if unit.num_listed > 0:
                for consumer in cutlass.range_constexpr(CONSUMERS):
                    q_pipeline.producer_acquire(q_load)
                    barrier = q_pipeline.producer_get_barrier(q_load)
                    for slot in cutlass.range_constexpr(TOKENS_PER_TILE):
                        token = cutlass.min(unit.start + consumer * TOKENS_PER_TILE + slot, unit.end - 1)
                        box = (token - window_start) * self.num_kv_heads + unit.kv_head
                        cute.copy(tma_atom_Q, tQgQ[None, box, 0], tQsQ[None, slot, 0, q_load.index],
                                  tma_bar_ptr=barrier)
                    q_load = advanced(q_load, 1)
                key_row = unit.key_row
                for listed in cutlass.range(unit.num_listed, unroll=1):
                    block = self.listed_block(walk, unit, listed)
                    kv_pipeline.producer_acquire(kv_load)
                    barrier = kv_pipeline.producer_get_barrier(kv_load)
                    for atom, rows, tile in ((tma_atom_K, tma_K, sK), (tma_atom_V, tma_V, sV)):
                        load_key_block(atom, rows, tile, kv_load.index, unit.kv_head, key_row + block * BLOCK_SIZE,
                                       barrier)
                    kv_load = advanced(kv_load, 1)

    @cute.jit
    def consume(
        self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, kv_pipeline, q_pipeline, tma_atom_O, tma_O,
        mPartialLse: cute.Tensor, final: tuple, mDone: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
        sV: cute.Tensor, sO: cute.Tensor, walk: tuple, units: tuple, topk: Int32, num_queries: Int32,
        scale_log2: Float32, consumer: Int32, thread: Int32, warp: Int32,
    ):
        """Consumer warpgroup `consumer`: tokens `4 * consumer ..` of every unit's group, warp `warp`
        one token, over the unit's listed blocks with an online softmax. Then the token's merged
        output goes into its first seen listed slot (`write_output`), or, where the KV-outer part
        holds none of its entries, into the forward's output and lse (`final`: the TMA atom and
        view of the output rows, the lse), with its `mDone` flag set for `combine` to skip."""
        tables, window_start = walk[0], walk[3]
        tSrQ, tSrK, tOrV, acc_S, s_rc, cS_rc, rP, tOrP, output = self.consumer_tiles(
            mma_qk, mma_pv, sQ, sK, sV, sO, tma_atom_O, tma_O, mPartialLse, consumer, thread
        )
        acc_O, o_rc, _, row_shift, row_sum = output[:5]
        tma_atom_Out, tma_Out, mLse = final
        tOsOut_tma, tOgOut_tma = token_tile_partition(tma_atom_Out, tma_Out, sO, CONSUMERS)
        final_output = (*output[:6], tma_atom_Out, tOsOut_tma, tOgOut_tma, mLse)
        rows_per_thread = cute.size(s_rc, mode=[0])

        kv_read = consumer_state(KV_STAGES)
        q_read = consumer_state(Q_STAGES)
        if consumer == 1:
            q_read = advanced(q_read, 1)
        for index in cutlass.range(units[0] + cute.arch.block_idx()[0], units[1], cute.arch.grid_dim()[0], unroll=1):
            unit = self.unit(walk, index)
            if unit.num_listed > 0:
                token = unit.start + consumer * TOKENS_PER_TILE + warp
                own = cutlass.min(token, unit.end - 1)
                position = own + unit.position_shift
                # Keys past the group's last position are no row's: zeroed in V (0 * NaN). A group
                # lies in one document or fragment, so its last query has its largest position.
                horizon = unit.end - 1 + unit.position_shift
                selection = (unit.kv_head * num_queries + own) * topk
                first_slot, kv_outer_entries = self.first_listed_slot(tables, selection, topk, position)
                acc_O.fill(0.0)
                row_shift.fill(-Float32.inf)
                row_sum.fill(0.0)
                attended = Int32(0)
                q_pipeline.consumer_wait(q_read)
                for listed in cutlass.range(unit.num_listed, unroll=1):
                    block = self.listed_block(walk, unit, listed)
                    # This warp's token sees the block's keys up to its position, if it selected it
                    # (read before the wait, so the loads overlap the block's TMA).
                    last_key = Int32(-1)
                    if token < unit.end and self.selects(tables, selection, topk, block):
                        last_key = position - block * BLOCK_SIZE
                    if last_key >= 0:
                        attended = Int32(1)
                    kv_stage = kv_read.index
                    kv_pipeline.consumer_wait(kv_read)
                    key_count = horizon - block * BLOCK_SIZE + 1
                    if key_count < BLOCK_SIZE:
                        zero_keys_past(sV[None, None, kv_stage], key_count, thread)
                        cute.arch.barrier(barrier_id=WARPGROUP_BARRIER + consumer, number_of_threads=WARPGROUP_THREADS)
                    issue_gemm(mma_qk, acc_S, tSrQ[None, None, None, q_read.index], tSrK[None, None, None, kv_stage])
                    warpgroup.wait_group(0)
                    for r in cutlass.range_constexpr(rows_per_thread):
                        hide_scores_past(s_rc, cS_rc, r, last_key)
                        row_shift[r], row_sum[r], rescale = online_softmax_row(
                            s_rc, r, scale_log2, row_shift[r], row_sum[r]
                        )
                        for c in cutlass.range_constexpr(cute.size(o_rc, mode=[1])):
                            o_rc[r, c] = o_rc[r, c] * rescale
                    rP.store(acc_S.load().to(self.dtype))
                    issue_gemm(mma_pv, acc_O, tOrP, tOrV[None, None, None, kv_stage], accumulate=True)
                    warpgroup.wait_group(0)
                    kv_pipeline.consumer_release(kv_read)
                    kv_read = advanced(kv_read, 1)
                q_pipeline.consumer_release(q_read)
                q_read = advanced(q_read, CONSUMERS)
                box = (token - window_start) * self.num_kv_heads + unit.kv_head
                if attended == 1 and kv_outer_entries == 0:
                    self.write_output(final_output, box, consumer, thread, warp, natural=True)
                    if thread % 32 == 0:
                        mDone[box] = Int32(1)
                else:
                    # A token that attended no listed block writes nothing: its slot keeps `-inf`.
                    partial_block = box * topk + first_slot
                    if attended == 0 or first_slot >= topk:
                        partial_block = Int32(-1)
                    self.write_output(output, partial_block, consumer, thread, warp)
        # Shared memory must outlive the TMA's reads of the last output rows.
        cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def first_listed_slot(self, tables: GroupTables, selection: Int32, topk: Int32, position: Int32):
        """`(slot, kv_outer)`: the first slot whose id the query sees and the KV-outer part dropped
        (`topk` if none), where its query-outer output goes; how many slots the query sees that
        the KV-outer part kept (0: this kernel's output is the query's whole output)."""
        found = topk
        kv_outer = Int32(0)
        last_block = position // BLOCK_SIZE
        if position < 0:
            last_block = Int32(-1)
        # Unrolled, with both loads ahead of the tests, so that a slot's loads do not wait for the
        # previous slot's: the row's loads are in flight together.
        for slot in cutlass.range(topk, unroll=SLOT_UNROLL):
            block = tables.block_indices[selection + slot]
            kept = tables.kv_outer_indices[selection + slot]
            seen = block >= 0 and block <= last_block
            if seen and kept >= 0:
                kv_outer += 1
            if found == topk and seen and kept < 0:
                found = slot
        return found, kv_outer

    @cute.jit
    def selects(self, tables: GroupTables, selection: Int32, topk: Int32, block: Int32):
        """Whether the query's selection holds `block`."""
        held = Int32(0)
        for slot in cutlass.range(topk, unroll=SLOT_UNROLL):
            if tables.block_indices[selection + slot] == block:
                held = Int32(1)
        return held > 0


def advanced(state, steps: int):
    """`state` advanced `steps` stages, returned for the caller to assign: the CuTe DSL carries a
    pipeline state out of a run-time branch or loop only where the kernel assigns it."""
    for _ in range(steps):
        state.advance()
    return state
