"""How much the selections of neighbouring tokens share: union sizes per group of tokens, and the
work the plan's rule (`torch_msa.plan.groups`) runs query-outer.

A group is `group_size` consecutive queries of one document (or fragment). Per (KV head, group)
the union is the distinct valid blocks its queries select; a block is *shared* when every query
of the group selects it. `union / topk` is how many more blocks a query-outer kernel reads per
group than per token.
"""

import dataclasses

import torch

from .documents import Documents, locate_queries
from .plan.groups import build_query_groups, group_tokens
from .plan.schedule import valid_entries

POSITION_EDGES = (2048, 8192)  # position buckets: dense prefix (topk * block_size at M3), mid, long


@dataclasses.dataclass(frozen=True)
class SharingSummary:
    """Statistics of (KV head, group) pairs; shares are in [0, 1], NaN where nothing was counted.

    Attributes:
        groups: (KV head, group) pairs summarised.
        union_mean, union_p10, union_p50, union_p90, union_max: distinct valid blocks per pair.
        shared_pairs: share of the valid (token, slot) pairs whose block every query of the group
            selects.
        block0: share of (KV head, query) rows with a real choice (more visible blocks than
            `topk`) that select block 0.
        previous_block: the same share for the block just before the local one (the local block
            itself is always selected).
    """

    groups: int
    union_mean: float
    union_p10: float
    union_p50: float
    union_p90: float
    union_max: float
    shared_pairs: float
    block0: float
    previous_block: float


@dataclasses.dataclass(frozen=True)
class SelectionSharing:
    """`selection_sharing`'s result: all groups, and the groups by their first query's position."""

    group_size: int
    overall: SharingSummary
    by_position: dict[str, SharingSummary]

    def as_dict(self) -> dict:
        return {"group_size": self.group_size, "overall": dataclasses.asdict(self.overall),
                "by_position": {name: dataclasses.asdict(row) for name, row in self.by_position.items()}}


def position_bucket_names(edges: tuple[int, ...] = POSITION_EDGES) -> list[str]:
    """`(2048, 8192)` -> `["0-2K", "2K-8K", "8K+"]`: the names of the buckets `edges` split positions into."""

    def short(n: int) -> str:
        return f"{n // 1024}K" if n and n % 1024 == 0 else str(n)

    bounds = [0, *edges]
    return [f"{short(a)}-{short(b)}" for a, b in zip(bounds, edges)] + [f"{short(bounds[-1])}+"]


def _share(numerator: torch.Tensor, denominator: torch.Tensor) -> float:
    return float(numerator) / float(denominator) if float(denominator) > 0 else float("nan")


def selection_sharing(
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    group_size: int = 8,
    block_size: int = 128,
    position_edges: tuple[int, ...] = POSITION_EDGES,
) -> SelectionSharing:
    """Union statistics of a selection over groups of `group_size` consecutive queries.

    Args:
        block_indices: int `[Hkv, Tq, topk]`, the op contract's selection (ids outside the contract,
            repeats and `-1` are not counted).
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]` document boundaries; `cu_seqlens_k` defaults to
            `cu_seqlens_q` (self-attention).
        group_size: queries per group, >= 1.
        block_size: keys per block.
        position_edges: increasing positions that split the groups by their first query's `p(t)`.

    Returns:
        A `SelectionSharing`; computing it syncs with the host.
    """
    if block_indices.dim() != 3:
        raise ValueError(f"block_indices: expected [Hkv, Tq, topk], got shape {tuple(block_indices.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")
    if list(position_edges) != sorted(set(position_edges)) or any(edge < 1 for edge in position_edges):
        raise ValueError(f"position_edges: expected increasing positive positions, got {position_edges}")
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    device = block_indices.device
    kv_heads, num_queries, topk = block_indices.shape
    cu_q = cu_seqlens_q.to(device=device, dtype=torch.int64)
    num_keys = int(cu_seqlens_k[-1])
    position = locate_queries(cu_seqlens_q.to(device), cu_seqlens_k.to(device), num_queries, num_keys).position

    # Group of every query: documents are cut into groups from their first query.
    token = torch.arange(num_queries, device=device)
    document = torch.searchsorted(cu_q, token, right=True) - 1
    lengths = cu_q[1:] - cu_q[:-1]
    groups_per_document = (lengths + group_size - 1) // group_size
    first_group = torch.cumsum(groups_per_document, 0) - groups_per_document
    group = first_group[document] + (token - cu_q[document]) // group_size
    num_groups = int(groups_per_document.sum())
    group_tokens = torch.bincount(group, minlength=num_groups)
    group_position = torch.full((num_groups,), -1, dtype=torch.int64, device=device)
    group_position.scatter_reduce_(0, group, position, "amin", include_self=False)

    ids = block_indices.to(torch.int64)
    valid = valid_entries(block_indices, position, block_size)
    max_blocks = max(int(ids.max()) + 1, 1) if ids.numel() else 1
    head = torch.arange(kv_heads, device=device).view(-1, 1, 1)
    key = ((head * num_groups + group.view(1, -1, 1)) * max_blocks + ids)[valid]
    blocks, counts = torch.unique(key, return_counts=True)
    pair = blocks // max_blocks  # (head * num_groups + group) of each distinct (head, group, block)
    pair_group = pair % num_groups
    union = torch.bincount(pair, minlength=kv_heads * num_groups)
    shared = torch.where(counts == group_tokens[pair_group], counts, 0)
    shared_pairs = torch.bincount(pair, weights=shared.double(), minlength=kv_heads * num_groups)
    valid_pairs = torch.bincount(pair, weights=counts.double(), minlength=kv_heads * num_groups)

    # Rows with a real choice: more visible blocks than slots.
    visible_blocks = torch.where(position >= 0, position // block_size + 1, 0)
    choosing = (visible_blocks > topk).view(1, -1).expand(kv_heads, -1)
    has_block0 = ((ids == 0) & valid).any(-1)
    previous = (visible_blocks - 2).view(1, -1, 1)
    has_previous = ((ids == previous) & valid).any(-1)
    row_group = group.view(1, -1).expand(kv_heads, -1)

    pair_position = group_position.repeat(kv_heads)
    row_position = group_position[row_group]
    present = (group_tokens > 0).repeat(kv_heads)
    names = position_bucket_names(tuple(position_edges))
    edges = torch.tensor(position_edges, device=device)
    pair_bucket = torch.bucketize(pair_position, edges, right=True)
    row_bucket = torch.bucketize(row_position, edges, right=True)

    def summary(pairs: torch.Tensor, rows: torch.Tensor) -> SharingSummary:
        sizes = union[pairs].double()
        quantiles = (torch.quantile(sizes, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64, device=device)).tolist()
                     if sizes.numel() else [float("nan")] * 3)
        chosen = rows & choosing
        return SharingSummary(
            groups=int(pairs.sum()),
            union_mean=float(sizes.mean()) if sizes.numel() else float("nan"),
            union_p10=quantiles[0], union_p50=quantiles[1], union_p90=quantiles[2],
            union_max=float(sizes.max()) if sizes.numel() else float("nan"),
            shared_pairs=_share(shared_pairs[pairs].sum(), valid_pairs[pairs].sum()),
            block0=_share((has_block0 & chosen).sum(), chosen.sum()),
            previous_block=_share((has_previous & chosen).sum(), chosen.sum()),
        )

    everything = torch.ones_like(row_group, dtype=torch.bool)
    return SelectionSharing(
        group_size=group_size,
        overall=summary(present, everything),
        by_position={name: summary(present & (pair_bucket == index), row_bucket == index)
                     for index, name in enumerate(names)},
    )


@dataclasses.dataclass(frozen=True)
class QueryOuterWork:
    """`query_outer_work`'s result; shares are in [0, 1], NaN where nothing was counted.

    Attributes:
        group_size: `G`, the queries of a group.
        entries: share of the valid (token, slot) pairs that run query-outer.
        tile_fill: of the (query, block) passes the query-outer tiles make (`G` per block of a
            group), the share a query selected; the rest are masked.
        rows_without_combine: share of the (KV head, query) rows with a valid entry whose entries
            all run query-outer, so that no KV-outer partial is left to merge.
    """

    group_size: int
    entries: float
    tile_fill: float
    rows_without_combine: float


def query_outer_work(block_indices: torch.Tensor, documents: Documents, num_keys: int, num_heads: int,
                     block_size: int = 128, min_segment_queries: int = 0) -> QueryOuterWork:
    """How much of `block_indices` the plan's rule (`torch_msa.plan.groups`) runs query-outer.

    Args:
        block_indices: int `[Hkv, Tq, topk]`, the op contract's selection.
        documents: its documents; num_keys: `Tk`; num_heads: `Hq`, which sizes the groups;
        block_size: keys per block; min_segment_queries: the rule's bound on the documents
            whose groups it takes (`build_query_groups`).

    Returns:
        A `QueryOuterWork`; computing it syncs with the host.
    """
    size = group_tokens(num_heads, block_indices.shape[0])
    block_indices = block_indices.to(torch.int32)
    groups = build_query_groups(block_indices, documents, num_keys, block_size, size, min_segment_queries)
    position = documents.locate(block_indices.shape[1], num_keys).position
    valid = valid_entries(block_indices, position, block_size)
    q_outer = valid & (groups.kv_outer_indices < 0)
    passes = (groups.group_blocks >= 0).sum() * size
    rows = valid.any(-1)
    return QueryOuterWork(
        group_size=size,
        entries=_share(q_outer.sum(), valid.sum()),
        tile_fill=_share(q_outer.sum(), passes),
        rows_without_combine=_share((rows & ~(valid & ~q_outer).any(-1)).sum(), rows.sum()),
    )
