"""The Triton plan, query-location and bucket-key-count kernels against their reference tables.

Where and how they run, and why in fp32 and fp16: `tests/support/triton_kernels.py`.
"""

import pytest
import torch

from tests.support.documents import documents_of
from tests.support.triton_kernels import (
    DEVICE,
    junk_indices,
    layout,
    require_a_device,
)
from torch_msa import testing
from torch_msa.plan import kernels as plan_kernel
from torch_msa.plan.groups import build_query_groups
from torch_msa.plan.schedule import build_schedule, pack
from torch_msa.triton_utils import common

require_a_device()


# (q lengths, k lengths, Hkv, block, topk); each with junk ids mixed in.
PLAN_CASES = {
    "pack-empty-and-1-token": ([40, 0, 1, 90], [140, 5, 1, 90], 2, 64, 4),
    "suffix-pack-topk-16": ([5, 200], [300, 260], 3, 64, 16),
    "one-doc-block-128": ([300], [300], 1, 128, 3),
}


@pytest.mark.parametrize("entries_per_item", [1, 16])
@pytest.mark.parametrize("case", PLAN_CASES)
def test_plan_build_equals_reference_tables(case, entries_per_item):
    q_lens, k_lens, num_kv_heads, block_size, topk = PLAN_CASES[case]
    cu_q, cu_k, _, num_keys, _, _ = layout(q_lens, k_lens)
    block_indices = junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    expected = pack(build_schedule(block_indices, documents_of(cu_q, cu_k), num_keys, block_size, entries_per_item))
    got = plan_kernel.plan(block_indices, documents_of(cu_q, cu_k), num_keys, block_size, entries_per_item)
    assert torch.equal(got, expected)
    if entries_per_item == 1:
        return  # the item size changes the last launch only: read the strides once per case
    # Strided selections and boundaries are read through their strides.
    strided = block_indices.transpose(0, 1).contiguous().transpose(0, 1)
    cu_q_strided, cu_k_strided = (torch.stack((cu, -cu), 1)[:, 0] for cu in (cu_q, cu_k))
    assert torch.equal(
        plan_kernel.plan(strided, documents_of(cu_q_strided, cu_k_strided), num_keys, block_size, entries_per_item), expected)


@pytest.mark.parametrize("chunks, chunk_queries, column_slots, column_chunks", [(4, 32, 32, 128), (1024, 1, 4, 16)])
def test_plan_build_carries_offsets_across_tiles_chunks_and_column_programs(monkeypatch, chunks, chunk_queries,
                                                                             column_slots, column_chunks):
    """Four chunks per KV head: a chunk walks eleven 8-query tiles, each starting where the one
    before left every slot's offset. Then one chunk per tile (42 chunks) and column-scan programs
    of 4 slots and 16 chunks: each carries its running counts across its chunk steps."""
    monkeypatch.setattr(plan_kernel, "_CHUNKS", chunks)
    monkeypatch.setattr(plan_kernel, "_CHUNK_QUERIES", chunk_queries)
    monkeypatch.setattr(plan_kernel, "_COLUMN_SLOTS", column_slots)
    monkeypatch.setattr(plan_kernel, "_COLUMN_CHUNKS", column_chunks)
    cu_q, cu_k, _, num_keys, _, _ = layout([300, 30], [300, 60])
    block_indices = junk_indices(cu_q, cu_k, 3, 16, 64)  # each KV head's columns, and its invalid entries
    documents = documents_of(cu_q, cu_k)
    expected = pack(build_schedule(block_indices, documents, num_keys, 64, 16))
    assert torch.equal(plan_kernel.plan(block_indices, documents, num_keys, 64, 16), expected)


def test_items_of_another_size_equal_the_reference():
    """`plan_kernel.with_items` (two launches; the index loss and the deterministic backward walk
    the step's plan in their own items) gives `schedule.with_items`'s tables."""
    from torch_msa.plan.schedule import with_items

    q_lens, k_lens, num_kv_heads, block_size, topk = PLAN_CASES["pack-empty-and-1-token"]
    cu_q, cu_k, _, num_keys, _, _ = layout(q_lens, k_lens)
    block_indices = junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    built = build_schedule(block_indices, documents_of(cu_q, cu_k), num_keys, block_size, 4)
    for entries_per_item in (1, 3, 64):
        expected, got = with_items(built, entries_per_item), plan_kernel.with_items(built, entries_per_item)
        for name, a, b in zip(expected._fields, got, expected, strict=True):
            assert torch.equal(a, b), (name, entries_per_item)


def test_plan_build_equals_reference_on_malformed_documents():
    # (cu_seqlens_q, cu_seqlens_k, Tk): unsorted boundaries, a document past the keys, no
    # documents, no keys, and overlapping documents with more key blocks than the bucket bound.
    cases = (
        ([0, 90, 40, 131], [0, 140, 100, 236], 236),
        ([0, 50, 131], [0, 60, 400], 236),
        ([0], [0], 236),
        ([0, 131], [0, 0], 0),
        ([0, 200, 200, 400, 400, 600], [0, 200, 1, 200, 2, 200], 200),
    )
    for q_bounds, k_bounds, num_keys in cases:
        cu_q = torch.tensor(q_bounds, dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor(k_bounds, dtype=torch.int32, device=DEVICE)
        block_indices = torch.randint(-2, 5, (2, max(131, q_bounds[-1]), 4), dtype=torch.int32, device=DEVICE)
        expected = pack(build_schedule(block_indices, documents_of(cu_q, cu_k), num_keys, 64, 8))
        assert torch.equal(plan_kernel.plan(block_indices, documents_of(cu_q, cu_k), num_keys, 64, 8), expected), q_bounds


@pytest.mark.parametrize(("case", "tokens_per_group"),
                         [("pack-empty-and-1-token", 8), ("one-doc-block-128", 2), ("suffix-pack-topk-16", 16)])
def test_query_groups_equal_the_reference_tables(case, tokens_per_group):
    """The groups kernel sorts a group's (query, slot) lanes by block: in one warp up to 128 lanes,
    in more past that (16 queries x 16 slots here); both give the reference's tables."""
    q_lens, k_lens, num_kv_heads, block_size, topk = PLAN_CASES[case]
    cu_q, cu_k, _, num_keys, _, _ = layout(q_lens, k_lens)
    block_indices = junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    # Runs of 4 queries share their last query's visible blocks, so that groups run blocks query-outer.
    source = (torch.arange(block_indices.shape[1], device=DEVICE) // 4 * 4 + 3).clamp(max=block_indices.shape[1] - 1)
    visible = block_indices[:, source] * block_size <= torch.arange(block_indices.shape[1], device=DEVICE).view(1, -1, 1)
    block_indices = torch.where(visible, block_indices[:, source], block_indices)
    documents = documents_of(cu_q, cu_k)
    expected = build_query_groups(block_indices, documents, num_keys, block_size, tokens_per_group)
    assert (expected.group_blocks >= 0).any()
    got = plan_kernel.query_groups(block_indices, documents, num_keys, block_size, tokens_per_group)
    for name, a, b in zip(expected._fields, got, expected):
        assert torch.equal(a, b), name
    if case == "pack-empty-and-1-token":
        # Read through the selection's strides.
        strided = block_indices.transpose(0, 1).contiguous().transpose(0, 1)
        got = plan_kernel.query_groups(strided, documents, num_keys, block_size, tokens_per_group)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        # Bounded to documents of 90 queries: the 90-query one lists blocks, the 40-query one none.
        bounded = build_query_groups(block_indices, documents, num_keys, block_size, tokens_per_group, 90)
        assert 0 < (bounded.group_blocks >= 0).sum() < (expected.group_blocks >= 0).sum()
        got = plan_kernel.query_groups(block_indices, documents, num_keys, block_size, tokens_per_group, 90)
        for name, a, b in zip(bounded._fields, got, bounded):
            assert torch.equal(a, b), name


def test_query_groups_list_a_block_for_the_queries_that_do_not_see_it_yet():
    """Blocks of 4 keys, groups of 8 queries; a group's first four queries see one block fewer
    than its last four.
    - Group 0: queries 0-3 name block 1, which they cannot see yet (an invalid entry), ahead of
      the valid choices of queries 4-7 in lane order; the group lists blocks 0 and 1 and drops
      block 1 from all eight rows.
    - Group 1: query 8 alone names block 3, which none of the queries that see it chooses: it is
      no entry and stays in its row. Query 9 repeats block 2: both slots leave its row.
    - Group 2: 16 valid entries over 3 blocks fall short of the cost rule (3 x 8 x 11 > 16 x 16),
      and query 16's repeat of block 4 would have tipped it: the group lists nothing."""
    cu_q = torch.tensor([0, 24], dtype=torch.int32, device=DEVICE)
    selection = ([[0, 1, -1]] * 8 + [[2, 0, 3], [2, 2, -1]] + [[2, 0, -1]] * 6
                 + [[4, 0, 4], [4, -1, -1]] + [[4, 0, -1]] * 5 + [[4, 0, 5]])
    block_indices = torch.tensor([selection], dtype=torch.int32, device=DEVICE)
    documents = documents_of(cu_q, cu_q)
    expected = build_query_groups(block_indices, documents, 24, 4, 8)
    assert expected.group_blocks[0, :3, :3].tolist() == [[0, 1, -1], [0, 2, -1], [-1, -1, -1]]
    assert expected.group_union[0, :3].tolist() == [2, 2, 3]
    assert (expected.kv_outer_indices[0, :8, :2] == -1).all()
    assert expected.kv_outer_indices[0, 8].tolist() == [-1, -1, 3]
    assert expected.kv_outer_indices[0, 9].tolist() == [-1, -1, -1]
    assert torch.equal(expected.kv_outer_indices[0, 16:], block_indices[0, 16:])
    got = plan_kernel.query_groups(block_indices, documents, 24, 4, 8)
    for name, a, b in zip(expected._fields, got, expected):
        assert torch.equal(a, b), name


def test_query_groups_equal_the_reference_on_fragments_and_malformed_documents():
    frag = testing.fragments((150, 0, 1, 90), ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40)), DEVICE)
    documents, starts = frag.tensors
    block_indices = testing.random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, 2, 4, 16,
                                                 fragment_documents=documents, fragment_starts=starts)
    block_indices[:, 1::2] = block_indices[:, ::2][:, : block_indices[:, 1::2].shape[1]]
    cases = [(block_indices, documents_of(frag.cu_seqlens_q, frag.cu_seqlens_k, documents, starts),
              int(frag.cu_seqlens_k[-1]))]
    for q_bounds, k_bounds, num_keys in (([0, 90, 40, 131], [0, 140, 100, 236], 236), ([0, 50, 131], [0, 60, 400], 236)):
        cu_q, cu_k = (torch.tensor(bounds, dtype=torch.int32, device=DEVICE) for bounds in (q_bounds, k_bounds))
        cases.append((torch.randint(-2, 5, (2, 131, 4), dtype=torch.int32, device=DEVICE), documents_of(cu_q, cu_k),
                      num_keys))
    for selection, docs, num_keys in cases:
        expected = build_query_groups(selection, docs, num_keys, 16, 8)
        got = plan_kernel.query_groups(selection, docs, num_keys, 16, 8)
        for name, a, b in zip(expected._fields, got, expected):
            assert torch.equal(a, b), (name, docs.cu_seqlens_q.tolist())


def test_located_queries_equal_the_documents_rule():
    """`common.locate_queries` (one kernel; the selection, the KL losses and the deterministic dQ
    read it) gives `documents.locate_queries`'s tables: well-formed and malformed boundaries
    (unsorted, past the keys, none, no keys, overlapping), strided boundaries, and fragments with an
    out-of-range document."""
    from torch_msa.documents import locate_queries

    cases = (
        ([0, 40, 40, 41, 131], [0, 140, 145, 146, 236], 236, 131),
        ([0, 90, 40, 131], [0, 140, 100, 236], 236, 131),
        ([0, 50, 131], [0, 60, 400], 236, 140),
        ([0], [0], 236, 20),
        ([0, 131], [0, 0], 0, 131),
        ([0, 200, 200, 400, 400, 600], [0, 200, 1, 200, 2, 200], 200, 600),
    )
    for q_bounds, k_bounds, num_keys, num_queries in cases:
        cu_q, cu_k = (torch.tensor(bounds, dtype=torch.int32, device=DEVICE) for bounds in (q_bounds, k_bounds))
        expected = locate_queries(cu_q, cu_k, num_queries, num_keys)
        for got in (common.locate_queries(cu_q, cu_k, num_queries, num_keys),
                    common.locate_queries(*(torch.stack((cu, -cu), 1)[:, 0] for cu in (cu_q, cu_k)), num_queries, num_keys)):
            assert got.key_start.dtype == got.position.dtype == torch.int64
            assert torch.equal(got.key_start, expected.key_start) and torch.equal(got.position, expected.position), q_bounds
    frag = testing.fragments((150, 0, 1, 90), ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40)), DEVICE)
    num_queries, num_keys = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
    documents, starts = frag.tensors
    for fragment_documents in (documents, torch.tensor([3, 0, 7, 0, -1], dtype=torch.int32, device=DEVICE)):
        args = (frag.cu_seqlens_q, frag.cu_seqlens_k, num_queries, num_keys, fragment_documents, starts)
        got, expected = common.locate_queries(*args), locate_queries(*args)
        assert torch.equal(got.key_start, expected.key_start) and torch.equal(got.position, expected.position)
    empty = common.locate_queries(frag.cu_seqlens_q, frag.cu_seqlens_k, 0, num_keys)
    assert empty.key_start.shape == empty.position.shape == (0,)


def test_bucket_key_counts_equal_the_reference():
    """`plan_kernel.bucket_key_count` (one kernel; the SM90 kernels read it) gives
    `schedule.bucket_key_count`'s counts, for block rows of well-formed documents, of empty ones,
    past every document and before the first, and over unsorted boundaries."""
    from torch_msa.plan.schedule import bucket_key_count

    rows = torch.tensor([0, 128, 200, 201, 329, 457, 499, 500, 900, -3, 0, 64], dtype=torch.int32, device=DEVICE)
    for bounds in ([0, 200, 200, 201, 500], [0], [0, 300, 100, 500], [10, 20]):
        cu_k = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
        for block_size in (64, 128):
            got = plan_kernel.bucket_key_count(rows, cu_k, block_size)
            assert got.dtype == torch.int32 and torch.equal(got, bucket_key_count(rows, cu_k, block_size)), bounds
    assert plan_kernel.bucket_key_count(rows[:0], cu_k, 128).shape == (0,)


@pytest.mark.parametrize("entries_per_program", [1024, 64])
@pytest.mark.parametrize("case", PLAN_CASES)
def test_restricted_plan_equals_the_reference(case, entries_per_program, monkeypatch):
    """`plan_kernel.restrict` (the KV-outer part of a step's plan) gives `schedule.restrict`'s
    tables, over junk ids and the query groups' dropped blocks; with 64 entries a program, buckets
    start inside programs and span several."""
    from torch_msa.plan.schedule import restrict

    monkeypatch.setattr(plan_kernel, "_ENTRIES", entries_per_program)

    q_lens, k_lens, num_kv_heads, block_size, topk = PLAN_CASES[case]
    cu_q, cu_k, _, num_keys, _, _ = layout(q_lens, k_lens)
    block_indices = junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    # Each odd query takes the selection of the query before it, so that groups of 2 share blocks.
    block_indices[:, 1::2] = block_indices[:, ::2][:, : block_indices[:, 1::2].shape[1]]
    documents = documents_of(cu_q, cu_k)
    kept_indices = build_query_groups(block_indices, documents, num_keys, block_size, 2).kv_outer_indices
    assert (kept_indices != block_indices).any()
    built = build_schedule(block_indices, documents, num_keys, block_size, 4)
    for entries_per_item in (1, 5):
        expected = restrict(built, kept_indices, entries_per_item)
        got = plan_kernel.restrict(built, kept_indices, entries_per_item)
        for name, a, b in zip(expected._fields, got, expected, strict=True):
            assert torch.equal(a, b), (name, entries_per_item)
