"""A plain-Python build of the query groups (`torch_msa.plan.groups`): the oracle their device
builders are tested against.

Written with loops over Python lists from the rule's statement (groups of `G` consecutive queries of
one segment, from its first query; the cost rule of `Q_OUTER_COST`), sharing nothing with
`build_query_groups` or the Triton kernel, so that the builders and the oracle cannot share a
mistake. Well-formed boundaries only; small inputs only.
"""

import torch

from tests.support.schedule_oracle import query_locations_python
from torch_msa.plan.groups import Q_OUTER_COST


def query_groups_python(
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_size: int,
    tokens_per_group: int,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
    min_segment_queries: int = 0,
) -> dict:
    """The query groups of `torch_msa.plan.groups.build_query_groups`, built with plain Python.

    Returns `{"token_group": [gid or -1 per query], "groups": {gid: (start, end)},
    "union": {(head, gid): distinct blocks}, "blocks": {(head, gid): [query-outer blocks ascending]},
    "position": [per query], "key_start": [per query]}` over the groups kept (those whose queries
    all see a key); only a segment of at least `min_segment_queries` queries lists blocks.
    """
    num_kv_heads, num_queries, _ = block_indices.shape
    ids = block_indices.tolist()
    cu_q = cu_seqlens_q.tolist()
    size = tokens_per_group
    numerator, denominator = Q_OUTER_COST
    position, key_start = query_locations_python(cu_seqlens_q, cu_seqlens_k, num_queries, fragment_documents,
                                                 fragment_starts)

    result: dict = {"token_group": [-1] * num_queries, "groups": {}, "union": {}, "blocks": {},
                    "position": position, "key_start": key_start}
    for segment in range(len(cu_q) - 1):
        for offset in range(0, cu_q[segment + 1] - cu_q[segment], size):
            start = cu_q[segment] + offset
            end = min(start + size, cu_q[segment + 1])
            if any(position[t] < 0 for t in range(start, end)):
                continue
            gid = cu_q[segment] // size + segment + offset // size
            result["groups"][gid] = (start, end)
            for t in range(start, end):
                result["token_group"][t] = gid
            for head in range(num_kv_heads):
                chosen: set[int] = set()
                entries = 0
                for t in range(start, end):
                    row = {b for b in ids[head][t] if b >= 0 and b * block_size <= position[t]}
                    entries += len(row)
                    chosen |= row
                long_enough = cu_q[segment + 1] - cu_q[segment] >= min_segment_queries
                whole = long_enough and len(chosen) * size * numerator <= entries * denominator
                result["union"][head, gid] = len(chosen)
                result["blocks"][head, gid] = sorted(chosen) if whole else []
    return result


def units_python(blocks: dict, num_kv_heads: int, num_ids: int) -> tuple[list[int], list[int]]:
    """`(units, units_before)` of `QueryGroups` from the oracle's `blocks`: the (group, head) pairs
    with a listed block as `group * Hkv + head` in increasing order, `-1` up to `Hkv * NG`; per group
    id the pairs listed in the groups before it, then their total."""
    units, units_before = [], []
    for gid in range(num_ids):
        units_before.append(len(units))
        units += [gid * num_kv_heads + head for head in range(num_kv_heads) if blocks.get((head, gid))]
    units_before.append(len(units))
    return units + [-1] * (num_kv_heads * num_ids - len(units)), units_before
