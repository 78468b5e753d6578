"""`msa::forward` on Hopper: the host side of `forward_kernel.py`. The kernel writes per-(query,
slot) partials, `combine` merges them. One executable per dtype and Hkv.
"""

import functools
import math

import torch

from ..backends import UnsupportedInputs
from ..contract import compute_dtype
from ..cute_dsl import require_cute_dsl, sm_count
from ..cute_dsl.cute_io import aligned_operand, launcher
from ..plan.groups import group_tokens
from ..stages.combine import combine
from ..stages.query_outer import QueryOuter
from ..uninitialized import uninitialized
from .common import (
    HEAD_DIM,
    HEADS_PER_KV,
    LOG2_E,
    blocks_operands,
    check_served,
    compile_blocks,
    launch,
    step_schedule,
)

CTAS_PER_SM = 1  # one CTA uses 224 KiB of shared memory
# Rows, not elements: TMA addresses 64-bit, but extents and the partial lse's index are 32-bit.
MAX_PARTIAL_ROWS = 2**31 - 1


def check_rows(num_queries: int, num_kv_heads: int, topk: int) -> None:
    """Raises `UnsupportedInputs` when the `Tq * Hkv * topk * 16` partial rows exceed int32."""
    rows = num_queries * num_kv_heads * topk * HEADS_PER_KV
    if rows > MAX_PARTIAL_ROWS:
        raise UnsupportedInputs(
            f"the SM90 forward indexes its partial rows with 32-bit integers: {num_queries} queries x "
            f"{num_kv_heads} KV heads x topk {topk} x {HEADS_PER_KV} heads need {rows} rows, more than "
            f"{MAX_PARTIAL_ROWS}"
        )


def check_selection_entries(num_kv_heads: int, num_queries: int, topk: int) -> None:
    """Raises `UnsupportedInputs` when the call's `Hkv * Tq * topk` selection entries exceed int32
    (the query-outer kernel indexes the call's selection with 32-bit integers)."""
    entries = num_kv_heads * num_queries * topk
    if entries > MAX_PARTIAL_ROWS:
        raise UnsupportedInputs(
            f"the SM90 query-outer forward indexes the selection with 32-bit integers: {num_kv_heads} KV heads x "
            f"{num_queries} queries x topk {topk} are {entries} entries, more than {MAX_PARTIAL_ROWS}"
        )


def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan=None, query_outer=None, into=None):
    """Same contract as `torch_msa.reference.forward`: `out [Tq, Hq, D]`, `lse [Tq, Hq]` fp32.

    Walks `plan`'s items (any item size), or those of a new plan. With `query_outer`
    (`torch_msa.stages.query_outer.QueryOuter`, windowed to these queries), `block_indices` is its
    KV-outer part's selection and its query-outer part runs too. With `into`, `(out, lse)`
    contiguous of those shapes and dtypes, writes them and returns them.

    Raises:
        UnsupportedInputs: outside the served configuration (`check_served`), beyond int32
            partial rows (`check_rows`) or, with `query_outer`, selection entries
            (`check_selection_entries`).
    """
    check_served(q, k, v, block_size)
    check_rows(q.shape[0], k.shape[1], block_indices.shape[-1])
    if query_outer is not None:
        check_selection_entries(*query_outer.block_indices.shape)
    require_cute_dsl()

    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    topk = block_indices.shape[-1]
    out, lse = into if into is not None else (
        uninitialized((num_queries, num_heads, dim), dtype=q.dtype, device=q.device),
        uninitialized((num_queries, num_heads), dtype=compute_dtype(q.dtype), device=q.device))
    if num_queries == 0 or topk == 0 or num_keys == 0:
        return out.zero_(), lse.fill_(-math.inf)
    # TMA reads whole 16-byte aligned rows.
    q, k, v = (aligned_operand(x) for x in (q, k, v))
    rows = num_queries * num_kv_heads * topk * HEADS_PER_KV
    partial_out = uninitialized((rows, dim), dtype=q.dtype, device=q.device)
    # With the query-outer part, its done flags (`combine`'s) sit behind the partials' lse, so that
    # one fill sets both: read as int32, -inf's bits are negative, "not done".
    flags = 0 if query_outer is None else num_queries * num_kv_heads
    partial_lse = torch.full((rows + flags,), -math.inf, dtype=torch.float32, device=q.device)
    done = None
    if query_outer is not None:
        partial_lse, done = partial_lse[:rows], partial_lse[rows:].view(torch.int32)
        # The two kernels write disjoint partials: queued first, the query-outer part runs while
        # the host prepares the KV-outer part's plan and schedule.
        launch_groups(q, k, v, partial_out, partial_lse, out, lse, done, query_outer, softmax_scale)
        plan = query_outer.kv_outer_plan(plan, num_keys, block_size, num_heads)
    schedule, key_count = step_schedule(block_indices, documents, num_keys, num_heads, plan)
    launch_blocks(q, k, v, partial_out, partial_lse, schedule, key_count, topk, softmax_scale)
    combine(partial_out, partial_lse, out, lse, num_kv_heads, topk, done)
    return out, lse


def operands(num_kv_heads: int):
    """The kernel's tensor operands (`common.blocks_operands`); its own: the partials and their lse."""
    return blocks_operands(num_kv_heads, (("partial_out", (HEAD_DIM,), None), ("partial_lse", (), torch.float32)))


def launch_blocks(q, k, v, partial_out, partial_lse, schedule, key_count, topk, softmax_scale) -> None:
    """Launch the blocks kernel: fills the partials of every scheduled (query, slot)."""
    tensors = {"q": q, "k": k, "v": v, "partial_out": partial_out, "partial_lse": partial_lse}
    num_kv_heads = k.shape[1]
    launch(_compiled(q.dtype, num_kv_heads), operands(num_kv_heads), tensors, schedule, key_count, topk, softmax_scale, (),
           CTAS_PER_SM * sm_count(q.device))


@functools.cache
def _compiled(dtype: torch.dtype, num_kv_heads: int):
    """One executable per (dtype, Hkv); token, key and item counts are dynamic."""
    return launcher(compile_blocks_kernel(dtype, num_kv_heads))


def compile_blocks_kernel(
    dtype: torch.dtype = torch.bfloat16,
    num_kv_heads: int = 4,
    arch: str | None = None,
    dump_dir: str | None = None,
    listings: bool = False,
):
    """`cute.compile` the blocks kernel (`common.compile_blocks`; `arch=None`: this GPU)."""
    require_cute_dsl()
    from .forward_kernel import Sm90ForwardKernel

    return compile_blocks(Sm90ForwardKernel(num_kv_heads), operands(num_kv_heads), dtype, (), arch, dump_dir, listings)


def groups_operands(num_kv_heads: int) -> tuple:
    """The groups kernel's tensor operands in launch order (`common.blocks_operands` form): q, k,
    v, the partials, the output (shaped like q) with its flat lse and done flags, then `GroupTables`
    (int32)."""
    q_k_v = blocks_operands(num_kv_heads, ())[:3]
    tables = ("block_indices", "kv_outer_indices", "group_start", "group_end", "group_blocks", "group_union",
              "group_key_start", "group_position", "units", "units_before")
    return (
        *q_k_v, ("partial_out", (HEAD_DIM,), None), ("partial_lse", (), torch.float32),
        ("out", q_k_v[0][1], None), ("lse", (), torch.float32), ("done", (), torch.int32),
        *((name, (), torch.int32) for name in tables),
    )


def launch_groups(q, k, v, partial_out, partial_lse, out, lse, done, work: QueryOuter, softmax_scale: float) -> None:
    """The query-outer part of `work`'s window on the CuTe groups kernel, in place: into the
    partials of `launch_blocks`, as `torch_msa.stages.query_outer.add_partials` writes them, except
    for the (query, KV head) rows the KV-outer part holds no entry of: those go straight into `out`
    `[Tq_w, Hq, D]` and `lse` fp32 `[Tq_w, Hq]` (contiguous), with `done` (int32 `[Tq_w * Hkv]`,
    at most 0) set to 1 for `combine` to skip them."""
    num_kv_heads = k.shape[1]
    groups = work.groups
    num_call_queries, topk = work.block_indices.shape[1:]
    num_ids, most = groups.group_blocks.shape[1:]
    first_group, last_group = work.window_groups(group_tokens(q.shape[1], num_kv_heads))
    window_units = max(0, last_group - first_group + 1) * num_kv_heads  # the most units listed there
    if window_units == 0:
        return
    tensors = (q, k, v, partial_out, partial_lse, out, lse.view(-1), done, work.block_indices.contiguous().view(-1),
               groups.kv_outer_indices.view(-1), groups.group_start, groups.group_end,
               groups.group_blocks.contiguous().view(-1), groups.group_union.contiguous().view(-1),
               groups.group_key_start, groups.group_position, groups.units, groups.units_before)
    grid = max(1, min(window_units, CTAS_PER_SM * sm_count(q.device)))
    _compiled_groups(q.dtype, num_kv_heads)(*tensors, topk, softmax_scale * LOG2_E, most, num_ids, num_call_queries,
                                             first_group, last_group, work.start, work.stop, grid)


@functools.cache
def _compiled_groups(dtype: torch.dtype, num_kv_heads: int):
    return launcher(compile_groups_kernel(dtype, num_kv_heads))


def compile_groups_kernel(
    dtype: torch.dtype = torch.bfloat16,
    num_kv_heads: int = 4,
    arch: str | None = None,
    dump_dir: str | None = None,
    listings: bool = False,
):
    """`cute.compile` the query-outer groups kernel (`common.compile_blocks`; `arch=None`: this GPU)."""
    require_cute_dsl()
    import cutlass

    from .groups_kernel import Sm90GroupsKernel

    operands = groups_operands(num_kv_heads)
    walk_scalars = tuple(cutlass.Int32(1) for _ in range(7))
    return compile_blocks(Sm90GroupsKernel(num_kv_heads), operands, dtype, walk_scalars, arch, dump_dir, listings)
