"""The query groups of a selection and the blocks each group runs query-outer: the rule, its tables
and the reference build. Design and cost model: `torch_msa/plan/README.md`.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..documents import Documents
from .schedule import valid_entries

GROUP_ROWS = 128
"""Query rows (tokens x query heads of a KV head) of a group: the rows of one query-outer tile."""

Q_OUTER_COST = (11, 16)
"""`(numerator, denominator)`: the least fill `E / (U * G)` of a group's query-outer tiles (its
valid entries over its tokens' passes over its blocks, selected or masked) at which the group runs
query-outer: what one pass costs there relative to one KV-outer entry with its share of the
combine, the unit's own work included (`torch_msa/plan/README.md`)."""

DEFAULT_MIN_SEGMENT_QUERIES = 8192
"""By default (`torch_msa.settings.QUERY_OUTER_ENV` unset) the rule takes groups only in
documents (fragments) of at least this many queries: below, the host work the query-outer part
adds to a call outweighs what it saves on the device (`docs/performance.md`, "The default")."""

DEFAULT_MIN_QUERY_HEADS = 64
"""By default the query-outer part runs only with at least this many query heads (M3's 64): with
fewer rows per token (16 query heads over 1 KV head was measured) it saves too little to pay for
its host work."""


class QueryGroups(NamedTuple):
    """Device tables of the query groups (all int32).

    A group is at most `G` consecutive queries of one document (one fragment when fragments are
    given), cut from its first query; group ids come from the segment boundaries alone
    (`group_ids`), so some ids hold no group.

    Attributes:
        group_start, group_end: `[NG]` the group's queries `[start, end)`; empty (`0, 0`) for an
            id that holds no group. The groups do not overlap; a query outside them all is in no
            group.
        group_key_start: `[NG]` the packed row of key 0 of the group's document
            (`Documents.locate`), 0 for an id that holds no group.
        group_position: `[NG]` the position of the group's first query in its document (its
            query `t` is at `t - group_start + group_position`: a group lies in one document or
            fragment), 0 for an id that holds no group.
        group_union: `[Hkv, NG]` how many distinct blocks the group's queries validly select, 0 for
            an id that holds no group. A group that lists blocks lists all of them (the rule takes
            whole groups): the SM90 query-outer kernel reads its count of listed blocks here.
        group_blocks: `[Hkv, NG, MQ]` the blocks the group runs query-outer, ascending, `-1` after.
        kv_outer_indices: `[Hkv, Tq, topk]`, contiguous, the selection the KV-outer part walks:
            `block_indices` with `-1` wherever the id is a block the query's group lists. A valid
            entry runs query-outer where its id is replaced, KV-outer where it is kept.
        units: `[Hkv * NG]` the (group, KV head) pairs that list a block, as `group * Hkv + head`,
            ascending, `-1` after: the query-outer work, so that a kernel hands out no empty pair.
        units_before: `[NG + 1]` the listed pairs of the groups below each id: the pairs of groups
            `[a, b]` are `units[units_before[a]:units_before[b + 1]]`.
    """

    group_start: torch.Tensor
    group_end: torch.Tensor
    group_key_start: torch.Tensor
    group_position: torch.Tensor
    group_union: torch.Tensor
    group_blocks: torch.Tensor
    kv_outer_indices: torch.Tensor
    units: torch.Tensor
    units_before: torch.Tensor


def group_tokens(num_heads: int, num_kv_heads: int) -> int:
    """`G`, the queries of a group: `GROUP_ROWS` rows of the head group `Hq / Hkv` padded to a power of two."""
    group = max(1, num_heads // max(1, num_kv_heads))
    return max(1, GROUP_ROWS // (1 << (group - 1).bit_length()))


def group_ids(num_queries: int, num_segments: int, tokens_per_group: int) -> int:
    """`NG`, the group ids of `Tq` queries in `num_segments` documents (or fragments).

    Segment `s` starting at query `c_s` numbers its groups from `c_s // G + s`: increasing in `s`,
    one id per group, all below `ceil(Tq / G) + num_segments`.
    """
    return (num_queries + tokens_per_group - 1) // tokens_per_group + max(0, num_segments)


def default_min_queries(num_heads: int) -> int | None:
    """The least queries of a document (fragment) whose groups the default's rule may take at
    `num_heads` query heads; None where the default runs no query-outer part.

    A document's own length decides, never the call's: a document's output is the same alone and
    packed with others.
    """
    if num_heads < DEFAULT_MIN_QUERY_HEADS:
        return None
    return DEFAULT_MIN_SEGMENT_QUERIES


def max_group_blocks(topk: int, tokens_per_group: int) -> int:
    """`MQ`, the most blocks a group runs query-outer: a group of at most `G * topk` entries has a
    fill of at least `cost` (`Q_OUTER_COST`) over at most `topk / cost` blocks."""
    numerator, denominator = Q_OUTER_COST
    return max(1, min(tokens_per_group * topk, topk * denominator // numerator))


def build_query_groups(
    block_indices: torch.Tensor,
    documents: Documents,
    num_keys: int,
    block_size: int,
    tokens_per_group: int,
    min_segment_queries: int = 0,
) -> QueryGroups:
    """The query groups of `block_indices` on its device, without a host sync (the reference build).

    A group holds the queries `[start, start + G)` of its segment, cut at the segment's end; it is
    kept only when every one of them lies in that segment and sees a key (malformed boundaries
    leave their queries in no group; an empty selection has none). Per (KV head, group) with `E`
    valid entries over `U` distinct blocks, the whole group runs query-outer when
    `U * G * cost <= E` (`Q_OUTER_COST`) and its segment has at least `min_segment_queries`
    queries, else none of it does.

    Args:
        block_indices: int32 `[Hkv, Tq, topk]`.
        documents: the documents; fragments are segments of their own.
        num_keys: `Tk`; block_size: keys per block; tokens_per_group: `G` (`group_tokens`).
        min_segment_queries: the least queries of a segment whose groups may run query-outer
            (`default_min_queries`; 0: any).
    """
    num_kv_heads, num_queries, topk = block_indices.shape
    device = block_indices.device
    size = tokens_per_group
    cu_q = documents.cu_seqlens_q.to(torch.int64)
    num_segments = max(0, cu_q.numel() - 1)
    num_ids = group_ids(num_queries, num_segments, size)
    most = max_group_blocks(topk, size)
    if block_indices.numel() == 0:
        zeros = torch.zeros(num_ids, dtype=torch.int32, device=device)
        group_blocks = torch.full((num_kv_heads, num_ids, most), -1, dtype=torch.int32, device=device)
        return QueryGroups(zeros, zeros.clone(), zeros.clone(), zeros.clone(),
                           torch.zeros((num_kv_heads, num_ids), dtype=torch.int32, device=device), group_blocks,
                           block_indices.to(torch.int32, memory_format=torch.contiguous_format, copy=True),
                           *unit_list(group_blocks))
    key_start, position = documents.locate(num_queries, num_keys)

    # The segment of each group id: the probes of a binary search for the last `s` with
    # `max(c_s, 0) // G + s <= id`, as the Triton build makes them.
    segment_keys = cu_q[:num_segments].clamp(min=0) // size + torch.arange(num_segments, device=device)
    ids = torch.arange(num_ids, device=device, dtype=torch.int64)
    segment = torch.searchsorted(segment_keys, ids, right=True) - 1
    has_segment = segment >= 0
    segment = segment.clamp(min=0)
    first = cu_q[:num_segments].index_select(0, segment) if num_segments else torch.zeros_like(ids)
    last = cu_q[1:].index_select(0, segment) if num_segments else torch.zeros_like(ids)
    start = first + (ids - segment_keys.index_select(0, segment) if num_segments else ids) * size
    end = torch.minimum(torch.minimum(start + size, last), torch.full_like(start, num_queries))

    # A group's queries: each must lie in the group's segment and see a key.
    offsets = torch.arange(size, device=device)
    tokens = start.view(-1, 1) + offsets
    in_group = tokens < end.view(-1, 1)
    token_index = tokens.clamp(0, max(0, num_queries - 1))
    token_segment = torch.searchsorted(cu_q[1:].contiguous(), token_index, right=True)
    member = (token_segment == segment.view(-1, 1)) & (position.index_select(0, token_index.view(-1)).view_as(tokens) >= 0)
    kept = has_segment & (start >= 0) & (start < end) & (member | ~in_group).all(1)
    rows = in_group & kept.view(-1, 1)
    first_token = token_index[:, 0]

    # Per (KV head, group): the valid entries sorted by block, run by run.
    valid = valid_entries(block_indices, position, block_size)
    flat = token_index.view(-1)
    group_ids_of = block_indices.index_select(1, flat).view(num_kv_heads, num_ids, size * topk)
    group_valid = (valid.index_select(1, flat).view(num_kv_heads, num_ids, size, topk) & rows.view(1, -1, size, 1))
    past_all = torch.iinfo(torch.int32).max
    keys = torch.where(group_valid.view(num_kv_heads, num_ids, -1), group_ids_of, past_all)
    keys = keys.sort(-1).values
    real = keys < past_all
    run_start = real & (keys != F.pad(keys[..., :-1], (1, 0), value=-1))
    union = run_start.sum(-1, dtype=torch.int32)
    entries = real.sum(-1)
    numerator, denominator = Q_OUTER_COST
    long_enough = (last - first) >= min_segment_queries
    whole = ((union * size * numerator <= entries * denominator) & long_enough).unsqueeze(-1)
    blocks = torch.where(run_start & whole, keys, past_all).sort(-1).values[..., :most]
    blocks = F.pad(blocks, (0, most - blocks.shape[-1]), value=past_all)

    token_group = torch.full((num_queries,), -1, dtype=torch.int32, device=device)
    token_group.index_put_((token_index[rows],), ids.view(-1, 1).expand_as(rows)[rows].to(torch.int32))
    group_blocks = torch.where(blocks == past_all, -1, blocks).to(torch.int32)
    units, units_before = unit_list(group_blocks)
    # The ids a query's group lists, every occurrence: `-1` in the KV-outer part's selection.
    listed = group_blocks.index_select(1, token_group.to(torch.int64).clamp(min=0))  # [Hkv, Tq, MQ]
    query_outer = torch.zeros_like(valid)
    for column in listed.unbind(-1):
        query_outer |= (block_indices == column.unsqueeze(-1)) & (column >= 0).unsqueeze(-1)
    query_outer &= (token_group >= 0).view(1, -1, 1)
    return QueryGroups(
        group_start=torch.where(kept, start, 0).to(torch.int32),
        group_end=torch.where(kept, end, 0).to(torch.int32),
        group_key_start=torch.where(kept, key_start.index_select(0, first_token), 0).to(torch.int32),
        group_position=torch.where(kept, position.index_select(0, first_token), 0).to(torch.int32),
        group_union=union,
        group_blocks=group_blocks,
        kv_outer_indices=torch.where(query_outer, -1, block_indices).to(torch.int32),
        units=units,
        units_before=units_before,
    )


def unit_list(group_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(units, units_before)` of `QueryGroups` from int32 `group_blocks [Hkv, NG, MQ]`, without a host sync."""
    num_kv_heads, num_ids, _ = group_blocks.shape
    listed = (group_blocks[..., 0] >= 0).t().reshape(-1)  # by unit id, group * Hkv + head
    total = listed.numel()
    ids = torch.arange(total, dtype=torch.int32, device=group_blocks.device)
    # Unlisted ids sort after every listed one.
    ordered = torch.where(listed, ids, ids + total).sort().values
    per_group = listed.view(num_ids, num_kv_heads).sum(1)
    return torch.where(ordered < total, ordered, -1), F.pad(per_group.cumsum(0), (1, 0)).to(torch.int32)
