"""The query groups and their query-outer blocks (`torch_msa.plan.groups`) against a plain-Python
construction, and the rule's edges."""

import pytest
import torch

from tests.support.documents import documents_of
from tests.support.groups_oracle import query_groups_python, units_python
from torch_msa import testing
from torch_msa.plan.groups import (
    DEFAULT_MIN_SEGMENT_QUERIES,
    Q_OUTER_COST,
    build_query_groups,
    default_min_queries,
    group_ids,
    group_tokens,
    max_group_blocks,
)
from torch_msa.selection_stats import query_outer_work

# (q lengths, k lengths, block size, topk, G)
LAYOUTS = {
    "pack-with-empty-and-1-token-documents": ([40, 0, 1, 90], [140, 5, 1, 90], 16, 4, 8),
    "suffix-pack-lq-below-lk": ([5, 200], [300, 260], 32, 6, 4),
    "one-document-topk-16": ([700], [700], 16, 16, 8),
    "one-token-groups": ([30, 17], [30, 40], 8, 5, 1),
}


def _selection(kind, cu_q, cu_k, num_kv_heads, topk, block_size):
    if kind == "random":
        return testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    if kind == "skewed":
        return testing.skewed_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    # "tiled": runs of 4 queries take the selection of the run's last query, where it is visible
    # to them all; a mix of blocks shared by every query of a group, by some and by one.
    chosen = testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    tiled = chosen.clone()
    for t in range(chosen.shape[1]):
        source = min(chosen.shape[1] - 1, (t // 4) * 4 + 3)
        row = chosen[:, source]
        tiled[:, t] = torch.where(row * block_size <= t, row, chosen[:, t])
    return tiled


def _token_groups(groups, num_queries):
    """The group of each query, read off the groups' bounds (`-1`: in none); no two groups overlap."""
    token_group = [-1] * num_queries
    for gid, (start, end) in enumerate(zip(groups.group_start.tolist(), groups.group_end.tolist(), strict=True)):
        for t in range(start, end):
            assert token_group[t] == -1, f"query {t} in groups {token_group[t]} and {gid}"
            token_group[t] = gid
    return token_group


def _check(groups, expected, num_kv_heads, tokens_per_group, topk):
    assert all(t.dtype == torch.int32 for t in groups)
    assert groups.group_blocks.shape[-1] == max_group_blocks(topk, tokens_per_group)
    assert _token_groups(groups, len(expected["token_group"])) == expected["token_group"]
    num_ids = groups.group_start.numel()
    for gid in range(num_ids):
        bounds = (int(groups.group_start[gid]), int(groups.group_end[gid]))
        assert bounds == expected["groups"].get(gid, (0, 0)), gid
        located = (int(groups.group_key_start[gid]), int(groups.group_position[gid]))
        if gid in expected["groups"]:
            # Each query of the group: its document's key 0 and its position, from the group's.
            for t in range(*bounds):
                assert (expected["key_start"][t], expected["position"][t]) == (
                    located[0], t - bounds[0] + located[1]), (gid, t)
        else:
            assert located == (0, 0), gid
        for head in range(num_kv_heads):
            blocks = [b for b in groups.group_blocks[head, gid].tolist() if b >= 0]
            assert blocks == expected["blocks"].get((head, gid), []), (head, gid)
            assert (groups.group_blocks[head, gid, len(blocks):] == -1).all()
            assert int(groups.group_union[head, gid]) == expected["union"].get((head, gid), 0), (head, gid)
            # A listed unit lists every distinct block: the SM90 groups kernel reads its count there.
            assert not blocks or len(blocks) == int(groups.group_union[head, gid]), (head, gid)
    units, units_before = units_python(expected["blocks"], num_kv_heads, num_ids)
    assert groups.units.tolist() == units
    assert groups.units_before.tolist() == units_before


@pytest.mark.parametrize("kind", ["random", "skewed", "tiled"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_match_the_python_build(layout, kind):
    q_lens, k_lens, block_size, topk, size = LAYOUTS[layout]
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens)
    block_indices = _selection(kind, cu_q, cu_k, 2, topk, block_size)
    groups = build_query_groups(block_indices, documents_of(cu_q, cu_k), sum(k_lens), block_size, size)
    assert groups.group_start.numel() == group_ids(sum(q_lens), len(q_lens), size)
    _check(groups, query_groups_python(block_indices, cu_q, cu_k, block_size, size), 2, size, topk)


@pytest.mark.parametrize("least", [2, 40, 91, 1 << 20])
def test_only_documents_of_the_least_queries_list_blocks(least):
    """`min_segment_queries`: a document shorter than it keeps its groups but lists no block."""
    q_lens, k_lens, block_size, topk, size = LAYOUTS["pack-with-empty-and-1-token-documents"]
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens)
    block_indices = _selection("tiled", cu_q, cu_k, 2, topk, block_size)
    groups = build_query_groups(block_indices, documents_of(cu_q, cu_k), sum(k_lens), block_size, size, least)
    expected = query_groups_python(block_indices, cu_q, cu_k, block_size, size, min_segment_queries=least)
    _check(groups, expected, 2, size, topk)
    bounds = list(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:]))
    listed = [gid for (_, gid), blocks in expected["blocks"].items() if blocks]
    for gid in listed:
        start = expected["groups"][gid][0]
        assert next(end - first for first, end in bounds if first <= start < end) >= least, gid
    # The rule takes the 90-query document's groups without the bound: the bound alone turns them away.
    assert bool(listed) == (least <= 90)


@pytest.mark.parametrize(("num_heads", "expected"), [
    (64, DEFAULT_MIN_SEGMENT_QUERIES), (128, DEFAULT_MIN_SEGMENT_QUERIES), (16, None), (32, None), (63, None),
])
def test_the_default_admits_the_head_counts_it_was_measured_to_win_on(num_heads, expected):
    assert default_min_queries(num_heads) == expected


def test_out_of_contract_ids_count_as_nothing():
    q_lens, k_lens, block_size, topk, size = LAYOUTS["pack-with-empty-and-1-token-documents"]
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens)
    block_indices = testing.random_block_indices(cu_q, cu_k, 3, topk, block_size)
    block_indices[0, :, -1] = block_indices[0, :, 0]  # repeats
    block_indices[1, ::2, 0] = 1 << 30  # beyond the causal horizon
    block_indices[2, 1::3, -1] = -7
    groups = build_query_groups(block_indices, documents_of(cu_q, cu_k), sum(k_lens), block_size, size)
    _check(groups, query_groups_python(block_indices, cu_q, cu_k, block_size, size), 3, size, topk)


def test_fragments_are_segments_of_their_own():
    frag = testing.fragments((150, 0, 1, 90), ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40)))
    documents, starts = frag.tensors
    block_indices = testing.random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, 2, 4, 16,
                                                 fragment_documents=documents, fragment_starts=starts)
    groups = build_query_groups(block_indices, documents_of(frag.cu_seqlens_q, frag.cu_seqlens_k, documents, starts),
                                int(frag.cu_seqlens_k[-1]), 16, 8)
    expected = query_groups_python(block_indices, frag.cu_seqlens_q, frag.cu_seqlens_k, 16, 8, documents, starts)
    _check(groups, expected, 2, 8, 4)
    # No group holds queries of two fragments, though fragments 1 and 3 are one document.
    bounds = frag.cu_seqlens_q.tolist()
    for start, end in expected["groups"].values():
        assert any(a <= start and end <= b for a, b in zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize(("shared", "pool", "expected"), [
    (16, 0, "all"),  # every query selects the same blocks
    (15, 2, "all"),  # union 17: full enough for the whole group, though blocks 15 and 16 are half-shared
    (8, 15, "all"),  # union 23 over 256 entries, the most a group runs query-outer: 23 * 16 * 11 <= 256 * 16
    (8, 16, "none"),  # union 24: 24 * 16 * 11 > 256 * 16, though every query selects blocks 0-7
    (0, 256, "none"),
])
def test_the_cost_rule_decides_each_group(shared, pool, expected):
    """One 16-query group whose queries each select `shared` common blocks and the rest from a pool
    of `pool` more, in turn: the whole group runs query-outer while its tiles are full enough, its
    256 entries at least 11/16 of its 16 queries' passes over its union (`Q_OUTER_COST`), else none
    of it does."""
    assert Q_OUTER_COST == (11, 16)
    size, topk, block_size = 16, 16, 4
    num_queries = 1024
    cu_q, cu_k = testing.cu_seqlens([num_queries])
    block_indices = torch.full((1, num_queries, topk), -1, dtype=torch.int32)
    for member, t in enumerate(range(num_queries - size, num_queries)):
        own = [shared + (member * (topk - shared) + i) % pool for i in range(topk - shared)] if pool else []
        block_indices[0, t] = torch.tensor(list(range(shared)) + own)
    groups = build_query_groups(block_indices, documents_of(cu_q, cu_k), num_queries, block_size, size)
    gid = (num_queries - size) // size
    union = shared + min(pool, size * (topk - shared))
    assert int(groups.group_union[0, gid]) == union
    blocks = [b for b in groups.group_blocks[0, gid].tolist() if b >= 0]
    assert blocks == (list(range(union)) if expected == "all" else [])


def test_the_kv_outer_selection_drops_each_listed_block_of_a_group():
    """Every occurrence of a block its query's group lists becomes -1, seen by the query or not
    and repeated or not; every other id stays. The valid entries dropped are those the rule runs
    query-outer."""
    q_lens, k_lens, block_size, topk, size = LAYOUTS["suffix-pack-lq-below-lk"]
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens)
    block_indices = _selection("tiled", cu_q, cu_k, 2, topk, block_size)
    block_indices[1, ::5, 0] = -3
    block_indices[0, ::3, -1] = block_indices[0, ::3, 0]  # repeats
    documents = documents_of(cu_q, cu_k)
    groups = build_query_groups(block_indices, documents, sum(k_lens), block_size, size)
    position = documents.locate(sum(q_lens), sum(k_lens)).position
    expected = query_groups_python(block_indices, cu_q, cu_k, block_size, size)
    got = groups.kv_outer_indices.tolist()
    ids = block_indices.tolist()
    dropped_valid = 0
    for head in range(2):
        for t in range(sum(q_lens)):
            listed = expected["blocks"].get((head, expected["token_group"][t]), [])
            seen = set()
            for s, block in enumerate(ids[head][t]):
                assert got[head][t][s] == (-1 if block in listed else block), (head, t, s)
                valid = block >= 0 and block * block_size <= int(position[t]) and block not in seen
                seen.add(block)
                dropped_valid += valid and block in listed
    assert dropped_valid > 0
    assert query_outer_work(block_indices, documents, sum(k_lens), num_heads=2 * 128 // size,
                            block_size=block_size).entries > 0


def test_malformed_boundaries_leave_their_queries_in_no_group():
    # Unsorted boundaries, a document past the keys, no documents, no keys, queries past the last boundary.
    cases = (([0, 90, 40, 131], [0, 140, 100, 236], 236), ([0, 50, 131], [0, 60, 400], 236), ([0], [0], 236),
             ([0, 131], [0, 0], 0), ([0, 100], [0, 100], 100))
    for q_bounds, k_bounds, num_keys in cases:
        cu_q, cu_k = (torch.tensor(bounds, dtype=torch.int32) for bounds in (q_bounds, k_bounds))
        block_indices = torch.randint(-2, 5, (2, 131, 4), dtype=torch.int32)
        documents = documents_of(cu_q, cu_k)
        groups = build_query_groups(block_indices, documents, num_keys, 64, 8)
        position = documents.locate(131, num_keys).position
        for gid in range(groups.group_start.numel()):
            start, end = int(groups.group_start[gid]), int(groups.group_end[gid])
            assert 0 <= start <= end <= 131 and end - start <= 8
        members = torch.tensor(_token_groups(groups, 131)) >= 0  # groups that do not overlap
        assert (position[members] >= 0).all(), q_bounds


def test_group_tokens_fill_a_tile_of_rows():
    assert group_tokens(64, 4) == 8  # M3: 16 heads per KV head
    assert group_tokens(16, 1) == 8
    assert group_tokens(6, 2) == 32  # 3 heads pad to 4
    assert group_tokens(64, 64) == 128
    assert group_tokens(256, 1) == 1
    assert max_group_blocks(16, 8) == 16 * Q_OUTER_COST[1] // Q_OUTER_COST[0]
    assert max_group_blocks(16, 1) == 16


def test_empty_inputs():
    cu_q, cu_k = testing.cu_seqlens([0], [5])
    for shape in ((2, 0, 4), (0, 0, 4), (2, 0, 0)):
        groups = build_query_groups(torch.zeros(shape, dtype=torch.int32), documents_of(cu_q, cu_k), 5, 4, 8)
        assert groups.group_blocks.shape[:2] == (shape[0], 1)
        assert (groups.group_end == groups.group_start).all()


def test_query_outer_work_summarises_the_rule():
    """64 queries in blocks of 16, 8-query groups (16 query heads over one KV head): each query
    selects block 0 and its local block, and the last query one more block of its own, which its
    group's small union still sends query-outer (3 * 8 * 9 <= 17 * 16) at one pass in 8 used."""
    cu_q, cu_k = testing.cu_seqlens([64])
    block_indices = torch.full((1, 64, 3), -1, dtype=torch.int32)
    for t in range(64):
        block_indices[0, t, :2] = torch.tensor([0, t // 16]) if t >= 16 else torch.tensor([0, -1])
    block_indices[0, 63, 2] = 1
    work = query_outer_work(block_indices, documents_of(cu_q, cu_k), 64, num_heads=16, block_size=16)
    assert work.group_size == 8
    assert work.entries == 1.0 and work.rows_without_combine == 1.0
    entries = 16 * 1 + 48 * 2 + 1  # the first block's queries select block 0 alone
    passes = 2 * 8 * 1 + 5 * 8 * 2 + 8 * 3
    assert work.tile_fill == pytest.approx(entries / passes)
    # Bounded to documents of more queries than this one has, the rule takes none of it.
    assert query_outer_work(block_indices, documents_of(cu_q, cu_k), 64, num_heads=16, block_size=16,
                            min_segment_queries=65).entries == 0.0


@pytest.mark.parametrize("given_plan", [True, False], ids=["call-plan", "no-plan"])
def test_the_windows_of_a_call_walk_one_kv_outer_plan_made_by_the_first_that_asks(given_plan, monkeypatch):
    """Over several query windows (`QueryOuter.kv_outer_plan`), the first window that asks restricts
    the call's plan, or builds one plan of the KV-outer part's selection, and cuts it for every
    window: each window's items cover exactly its queries' KV-outer entries. A plan given beside
    the call's, or to a window of part of the call, is refused."""
    from torch_msa import query_windows
    from torch_msa.plan import schedule as reference_plan
    from torch_msa.stages import query_outer

    num_heads, num_kv_heads, block_size, topk = 8, 2, 16, 4
    cu_q, cu_k = testing.cu_seqlens([40, 30], [40, 50])
    documents = documents_of(cu_q, cu_k)
    block_indices = testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    block_indices[:, 8:24] = block_indices[:, 23:24]  # groups that share their blocks: query-outer
    groups = build_query_groups(block_indices, documents, 90, block_size, group_tokens(num_heads, num_kv_heads))
    kv_outer = groups.kv_outer_indices
    item_size = reference_plan.entries_per_item(num_heads, num_kv_heads)
    restrictions, builds = [], []
    monkeypatch.setattr(query_outer, "restrict",  # the reference's, on CPU
                        lambda *args: restrictions.append(args) or reference_plan.restrict(*args))
    real_call = query_windows.backends.call
    monkeypatch.setattr(query_windows.backends, "call",
                        lambda op, *args: builds.append((op, args[1])) or real_call(op, *args))
    call_plan = reference_plan.pack(reference_plan.build_schedule(block_indices, documents, 90, block_size, item_size))
    work = query_outer.QueryOuter(groups, block_indices, documents, 0, 70, call_plan if given_plan else None)

    _, position = documents.locate(70, 90)
    kept = reference_plan.valid_entries(kv_outer, position, block_size)
    assert 0 < int(kept.sum()) < int(reference_plan.valid_entries(block_indices, position, block_size).sum())
    for start, stop in [(32, 64), (0, 32), (64, 70)]:  # in any order, the first restricts or builds
        schedule = work.window(start, stop).kv_outer_plan(None, 90, block_size, num_heads)
        items = torch.arange(schedule.item_start.numel()) < schedule.num_items
        covered = int(((schedule.item_end - schedule.item_start) * items).sum())
        assert covered == int(kept[:, start:stop].sum()), (start, stop)
        assert schedule.position.tolist() == position[start:stop].tolist()
    assert len(restrictions) == int(given_plan)
    assert [op for op, _ in builds] == ([] if given_plan else ["plan"])
    if not given_plan:
        assert builds[0][1] is kv_outer  # a plan of the KV-outer part's selection

    with pytest.raises(RuntimeError, match=r"queries \[0, 32\) of 70 walk the call's KV-outer plan"):
        work.window(0, 32).kv_outer_plan(call_plan, 90, block_size, num_heads)
    if given_plan:
        with pytest.raises(RuntimeError, match=r"queries \[0, 70\) of 70"):
            work.kv_outer_plan(call_plan, 90, block_size, num_heads)
