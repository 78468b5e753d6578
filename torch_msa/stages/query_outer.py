"""The query-outer part of a forward: the query groups the plan's rule sends query-outer
(`torch_msa/plan/README.md`), run by one program per (group, KV head) into the partials of the
backend's KV-outer forward, which walks the rest of the selection.
"""

import dataclasses
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..documents import Documents
from ..plan.groups import QueryGroups, default_min_queries, group_tokens
from ..plan.kernels import query_groups, restrict, schedule_for
from ..plan.schedule import Schedule, entries_per_item
from ..query_windows import windowed_plan
from ..settings import query_outer_setting
from ..triton_utils.common import LOG2_E, binary_search_steps, dot_precision, locate_tokens
from ..triton_utils.launch import LaunchConfig, cached_launches, launch

GROUPS_CONFIGS = (LaunchConfig(num_stages=2), LaunchConfig(num_stages=1))


@cached_launches
@triton.jit
def msa_fwd_groups_kernel(
    q, k, v, partial_out, partial_lse,
    block_indices, kv_outer_indices, group_start, group_end, group_blocks,
    cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
    first_group, window_start, window_stop, num_ids, num_keys, num_segments, num_docs, search_steps, qk_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_bi_head, stride_bi_token, stride_bi_slot, stride_kv_head, stride_kv_token, stride_kv_slot,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, MOST: tl.constexpr, MOST_P2: tl.constexpr, BLOCK: tl.constexpr,
    DIM: tl.constexpr, PRECISION: tl.constexpr, FRAGMENTS: tl.constexpr, PARTS: tl.constexpr,
):
    # A group's `TOKENS * PARTS` queries run in `PARTS` programs of `TOKENS` queries each.
    group = first_group + tl.program_id(0) // PARTS
    kv_head = tl.program_id(1)
    part_start = tl.load(group_start + group) + (tl.program_id(0) % PARTS) * TOKENS
    start = tl.maximum(part_start, window_start)
    end = tl.minimum(tl.minimum(tl.load(group_end + group), part_start + TOKENS), window_stop)
    listed = tl.arange(0, MOST_P2)
    group_row = group_blocks + (kv_head.to(tl.int64) * num_ids + group) * MOST
    num_listed = tl.sum((tl.load(group_row + listed, mask=listed < MOST, other=-1) >= 0).to(tl.int32), axis=0)
    if (start >= end) | (num_listed == 0):
        return
    rows = tl.arange(0, TOKENS * GROUP_P2)
    group_head = rows % GROUP_P2
    token = (start + rows // GROUP_P2).to(tl.int64)
    row_ok = (token < end) & (group_head < GROUP)
    # A group's queries share a document: its key rows start at one `key_start`.
    pos, key_start, _ = locate_tokens(token, row_ok, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
                                      num_keys, num_segments, num_docs, search_steps, FRAGMENTS)
    first_key = tl.max(tl.where(row_ok, key_start, 0), axis=0)
    horizon = tl.max(tl.where(row_ok, pos, -1), axis=0)
    low = tl.min(tl.where(row_ok, pos, horizon), axis=0)

    # A row attends to a listed block when its selection holds the id (the causal mask hides one
    # it does not see yet). Its merged partial goes to the slot of its first seen listed id (the
    # KV-outer part has -1 there); the partials of its other slots of listed ids stay empty.
    slots = tl.arange(0, TOPK_P2)
    slot_ok = row_ok[:, None] & (slots[None, :] < TOPK)
    ids = tl.load(block_indices + kv_head.to(tl.int64) * stride_bi_head + token[:, None] * stride_bi_token
                  + slots[None, :] * stride_bi_slot, mask=slot_ok, other=-1)
    kv_outer = tl.load(kv_outer_indices + kv_head.to(tl.int64) * stride_kv_head + token[:, None] * stride_kv_token
                       + slots[None, :] * stride_kv_slot, mask=slot_ok, other=-1)
    seen = (ids >= 0) & (ids.to(tl.int64) <= tl.where(pos >= 0, pos // BLOCK, -1)[:, None])
    first_slot = tl.min(tl.where(seen & (kv_outer < 0), slots[None, :], TOPK_P2), axis=1)

    dims = tl.arange(0, DIM)
    offsets = tl.arange(0, BLOCK)
    local = token - window_start
    query_head = kv_head * GROUP + group_head
    q_rows = tl.load(q + local[:, None] * stride_q_token + query_head[:, None] * stride_q_head + dims[None, :],
                     mask=row_ok[:, None], other=0.0)
    row_max = tl.full((TOKENS * GROUP_P2,), float("-inf"), tl.float32)
    total = tl.zeros((TOKENS * GROUP_P2,), tl.float32)
    acc = tl.zeros((TOKENS * GROUP_P2, DIM), tl.float32)
    for index in range(num_listed):  # the listed blocks come first, then -1
        block = tl.load(group_row + index)
        key_position = block * BLOCK + offsets
        key_row = first_key + key_position
        # Keys past the group's last position may be another document's: never read.
        key_ok = (key_position <= horizon) & (key_row < num_keys)
        keys = tl.load(k + key_row[:, None] * stride_k_token + kv_head * stride_k_head + dims[None, :],
                       mask=key_ok[:, None], other=0.0)
        values = tl.load(v + key_row[:, None] * stride_v_token + kv_head * stride_v_head + dims[None, :],
                         mask=key_ok[:, None], other=0.0)
        selects = tl.max((ids == block).to(tl.int32), axis=1) > 0
        scores = tl.dot(q_rows, tl.trans(keys), input_precision=PRECISION) * qk_scale
        # A block every row selects and sees whole needs no mask.
        masked = ((tl.min(tl.where(row_ok, selects.to(tl.int32), 1), axis=0) == 0) | (block * BLOCK + BLOCK - 1 > low)
                  | (first_key + block * BLOCK + BLOCK > num_keys))
        if masked:
            visible = selects[:, None] & (key_position[None, :] <= pos[:, None]) & key_ok[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - shift)
        probs = tl.exp2(scores - shift[:, None])
        total = total * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=PRECISION)
        row_max = new_max

    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    lse = tl.where(total > 0, row_max + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
    written = row_ok & (first_slot < TOPK)
    # The KV-outer forward's partial layout: [Tq, Hkv, topk, G] rows of D.
    partial = ((local * NUM_KV_HEADS + kv_head) * TOPK + first_slot) * GROUP + group_head
    tl.store(partial_out + partial[:, None] * DIM + dims[None, :], out.to(partial_out.dtype.element_ty),
             mask=written[:, None])
    tl.store(partial_lse + partial, lse, mask=written)


@dataclasses.dataclass(frozen=True)
class QueryOuter:
    """The query-outer work of one forward call, seen from one window of its queries.

    Attributes:
        groups: the call's query groups.
        block_indices: the call's int32 `[Hkv, Tq, topk]` selection; documents: the call's documents.
        start, stop: the window, queries `[start, stop)` of the call's.
        call_plan: the call's plan (`msa::plan`'s or a `Schedule`), which the forward restricts to
            the KV-outer part itself (`kv_outer_plan`); None when the forward is given that part's
            plan, or none.
        window_plans: shared by every window of the call: empty until the first window that asks
            for its plan (`kv_outer_plan`) adds the KV-outer part's plan cut into windows
            (`torch_msa.query_windows.windowed_plan`).
    """

    groups: QueryGroups
    block_indices: torch.Tensor
    documents: Documents
    start: int
    stop: int
    call_plan: torch.Tensor | Schedule | None = None
    window_plans: list[Callable[[int, int], Schedule]] = dataclasses.field(default_factory=list, repr=False,
                                                                           compare=False)

    def window(self, start: int, stop: int) -> "QueryOuter":
        """The same call's work seen from queries `[start, stop)`."""
        return dataclasses.replace(self, start=start, stop=stop)

    def window_groups(self, tokens_per_group: int) -> tuple[int, int]:
        """`(first, last)`: the group ids that may meet the window. The group starting at query `t`
        of segment `s` has the id `t // G + s` (`torch_msa.plan.groups.group_ids`), so those of
        queries `[start, stop)` lie in `[start // G - 1, (stop - 1) // G + segments]`."""
        num_ids = self.groups.group_start.shape[0]
        num_segments = self.documents.cu_seqlens_q.shape[0] - 1
        return (max(0, self.start // tokens_per_group - 1),
                min(num_ids - 1, (self.stop - 1) // tokens_per_group + num_segments))

    def kv_outer_plan(self, plan, num_keys: int, block_size: int, num_heads: int):
        """The plan the KV-outer part of this window walks. A forward asks for it after queuing the
        query-outer part, so that building or restricting it overlaps that part's kernel.

        In one window of the whole call: `plan` as the forward is given it (None: the forward
        builds one), or, with a `call_plan`, that plan restricted to the KV-outer part
        (`restricted_plan`). In a window of part of the call: its share of the call's KV-outer
        plan (`call_plan` restricted, or a plan of the KV-outer part's selection), made by the first
        window that asks, for every window; such a window is given no plan of its own.

        Raises:
            RuntimeError: `plan` given beside a `call_plan`, or to a window of part of the call.
        """
        whole = (self.start, self.stop) == (0, self.block_indices.shape[1])
        if plan is not None and (self.call_plan is not None or not whole):
            raise RuntimeError(f"QueryOuter.kv_outer_plan: queries [{self.start}, {self.stop}) of "
                               f"{self.block_indices.shape[1]} walk the call's KV-outer plan, given another plan")
        if whole:
            return plan if self.call_plan is None else restricted_plan(self, num_keys, block_size, num_heads,
                                                                       self.call_plan)
        if not self.window_plans:
            kv_plan = (None if self.call_plan is None
                       else restricted_plan(self, num_keys, block_size, num_heads, self.call_plan))
            self.window_plans.append(windowed_plan(kv_plan, self.groups.kv_outer_indices, self.documents, num_keys,
                                                   block_size, num_heads))
        return self.window_plans[0](self.start, self.stop)


def restricted_plan(work: QueryOuter, num_keys: int, block_size: int, num_heads: int, plan) -> Schedule:
    """The call's `plan` restricted to the entries of `work`'s KV-outer part
    (`torch_msa.plan.kernels.restrict`: no second sort)."""
    block_indices = work.block_indices
    schedule = schedule_for(block_indices, work.documents, num_keys, block_size, num_heads, plan)
    return restrict(schedule, work.groups.kv_outer_indices, entries_per_item(num_heads, block_indices.shape[0]))


def for_call(block_indices, documents: Documents, num_keys: int, block_size: int, num_heads: int,
             min_segment_queries: int = 0) -> QueryOuter:
    """The query groups of a forward call (`torch_msa.plan.kernels.query_groups`), over all its
    queries, in documents (fragments) of at least `min_segment_queries` queries; `block_indices`
    int32, as `msa::forward` takes it."""
    groups = query_groups(block_indices, documents, num_keys, block_size,
                          group_tokens(num_heads, block_indices.shape[0]), min_segment_queries)
    return QueryOuter(groups, block_indices, documents, 0, block_indices.shape[1])


def segment_bound(num_heads: int, by_default: bool) -> int | None:
    """The least queries of a document whose groups may run query-outer under the setting
    (`torch_msa.settings.query_outer_setting`): 0 (any) when it is on; by default, where the
    backend's forward runs the query-outer part `by_default`, the default's rule
    (`torch_msa.plan.groups.default_min_queries`); None when no query-outer part runs.

    Raises:
        ValueError: an unknown setting.
    """
    setting = query_outer_setting()
    if setting == "on":
        return 0
    if setting == "off" or not by_default:
        return None
    return default_min_queries(num_heads)


def split_forward(q, block_indices, documents: Documents, num_keys: int, block_size: int, plan,
                  check: Callable[[], None] | None = None, by_default: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor | Schedule | None, Callable[[int, int], dict] | None]:
    """How a backend's forward runs a call on queries `q [Tq, Hq, D]`, as `(block_indices, plan,
    window_arguments)` for `torch_msa.query_windows.forward_in_windows`.

    Where no document of the call may run query-outer (`segment_bound`; the host bound
    `documents.max_seqlen_q` below it): the call's own, no window arguments. Otherwise: the
    KV-outer part's selection (`QueryGroups.kv_outer_indices`), no plan, and per window the
    `query_outer` keyword of the backend's forward, which gives the window its plan
    (`QueryOuter.kv_outer_plan`) once the window's query-outer kernel is queued: a given plan
    restricted to the entries that part keeps (`restricted_plan`, no second sort), or, without
    one, a plan of that part's selection. The groups are cut from the call's documents: a query
    window's one-token fragments would make groups of one query. `check`, when given, runs before
    the groups are built: a backend that may decline the inputs declines there, not after
    building them. `by_default`: whether the backend runs its query-outer part without the
    setting asking for it.
    """
    least = segment_bound(q.shape[1], by_default)
    if least is None or documents.max_seqlen_q < least:
        return block_indices, plan, None
    if check is not None:
        check()
    work = for_call(block_indices, documents, num_keys, block_size, q.shape[1], least)
    if plan is not None:
        work = dataclasses.replace(work, call_plan=plan)
    return work.groups.kv_outer_indices, None, lambda start, stop: {"query_outer": work.window(start, stop)}


def program_tokens(num_heads: int, num_kv_heads: int, rows: int) -> tuple[int, int]:
    """`(tokens, parts)`: a group's queries run in `parts` programs of `tokens` queries, `rows`
    (a power of two; 0 for the whole group) query rows each."""
    whole = group_tokens(num_heads, num_kv_heads)
    if not rows:
        return whole, 1
    tokens = max(1, min(whole, rows // triton.next_power_of_2(max(1, num_heads // max(1, num_kv_heads)))))
    return tokens, whole // tokens


def add_partials(q, k, v, partial_out, partial_lse, work: QueryOuter, block_size: int, softmax_scale: float) -> None:
    """Write the query-outer partials of `work`'s window into a KV-outer forward's (in place).

    Args:
        q: the window's `[Tq_w, Hq, D]`; k, v: `[Tk, Hkv, D]` (unit stride in D).
        partial_out, partial_lse: the KV-outer forward's, `[Tq_w * Hkv * topk * G, D]` and fp32
            `[Tq_w * Hkv * topk * G]` (`torch_msa.stages.combine.combine`), written where the
            KV-outer part's selection has `-1` for a listed block.
    """
    num_heads, dim = q.shape[1:]
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    groups, documents = work.groups, work.documents.map_tensors(torch.Tensor.contiguous)
    num_ids, most = groups.group_blocks.shape[1:]
    topk = work.block_indices.shape[-1]
    cu_seqlens_q, fragments = documents.cu_seqlens_q, documents.has_fragments
    num_segments = cu_seqlens_q.numel() - 1
    first_group, last_group = work.window_groups(group_tokens(num_heads, num_kv_heads))
    shape_key = (q.device, q.dtype, dim, block_size, group, topk)

    def launch_groups(config):
        part_tokens, parts = program_tokens(num_heads, num_kv_heads, config.rows)
        msa_fwd_groups_kernel[(max(1, last_group - first_group + 1) * parts, num_kv_heads)](
            q, k, v, partial_out, partial_lse,
            work.block_indices, groups.kv_outer_indices, groups.group_start, groups.group_end, groups.group_blocks,
            cu_seqlens_q, documents.cu_seqlens_k,
            documents.fragment_documents if fragments else cu_seqlens_q,
            documents.fragment_starts if fragments else cu_seqlens_q,
            first_group, work.start, work.stop, num_ids, num_keys, num_segments, documents.num_documents,
            binary_search_steps(num_segments), softmax_scale * LOG2_E.value,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *work.block_indices.stride(), *groups.kv_outer_indices.stride(),
            NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P2=triton.next_power_of_2(group), TOKENS=part_tokens,
            TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), MOST=most, MOST_P2=triton.next_power_of_2(most),
            BLOCK=block_size, DIM=dim, PRECISION=dot_precision(q.dtype), FRAGMENTS=fragments, PARTS=parts,
            **config.options,
        )

    launch("msa_fwd_groups_kernel", shape_key, GROUPS_CONFIGS, launch_groups)
