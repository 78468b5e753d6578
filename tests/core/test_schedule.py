"""The shared KV-outer schedule (`torch_msa.plan.schedule`) against a plain-Python construction."""

import pytest
import torch

import torch_msa
from tests.support import install
from tests.support.documents import documents_of
from tests.support.host_calls import CountOps, KernelLaunches
from tests.support.schedule_oracle import build_schedule_python
from torch_msa import testing
from torch_msa.plan.schedule import bucket_key_count, build_schedule, max_buckets, plan_numel, unpack

LAYOUTS = {
    "pack-with-empty-documents": ([40, 0, 1, 90], [140, 5, 1, 90], 64, 4),
    "one-document": ([300], [300], 64, 3),
    "suffix-pack": ([5, 200], [300, 260], 64, 5),
    "block-128-topk-16": ([700, 1], [900, 1], 128, 16),
}


def _check(block_indices, cu_q, cu_k, num_keys, block_size, entries_per_item):
    schedule = build_schedule(block_indices, documents_of(cu_q, cu_k), num_keys, block_size, entries_per_item)
    expected = build_schedule_python(block_indices, cu_q, cu_k, num_keys, block_size, entries_per_item)
    assert all(t.dtype == torch.int32 for t in schedule)
    num_buckets, num_items = int(schedule.num_buckets), int(schedule.num_items)
    assert num_buckets == len(expected["buckets"])
    for bucket, (head, key_row, block, entries) in enumerate(expected["buckets"]):
        assert (int(schedule.bucket_head[bucket]), int(schedule.bucket_key_row[bucket]),
                int(schedule.bucket_block[bucket])) == (head, key_row, block)
        start, end = int(schedule.bucket_ptr[bucket]), int(schedule.bucket_ptr[bucket + 1])
        assert schedule.entry_query[start:end].tolist() == entries
    items = list(zip(*(t[:num_items].tolist() for t in (schedule.item_bucket, schedule.item_start, schedule.item_end))))
    assert items == expected["items"]
    assert torch.equal(schedule.item_start[num_items:], schedule.item_end[num_items:]), "unused items must be empty"
    assert (schedule.bucket_ptr[num_buckets:] == schedule.bucket_ptr[num_buckets]).all()


@pytest.mark.parametrize("entries_per_item", [1, 8, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_selection_matches_python_build(layout, entries_per_item):
    q_lens, k_lens, block_size, topk = LAYOUTS[layout]
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens)
    block_indices = testing.random_block_indices(cu_q, cu_k, 2, topk, block_size)
    _check(block_indices, cu_q, cu_k, sum(k_lens), block_size, entries_per_item)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_contract_ids_are_dropped(layout):
    q_lens, k_lens, block_size, topk = LAYOUTS[layout]
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens)
    block_indices = testing.random_block_indices(cu_q, cu_k, 3, topk, block_size)
    block_indices[0, :, -1] = block_indices[0, :, 0]  # repeats
    block_indices[1, ::2, 0] = 1 << 30  # beyond the causal horizon
    block_indices[2, 1::3, -1] = -7
    _check(block_indices, cu_q, cu_k, sum(k_lens), block_size, 8)


def test_skewed_selection_spreads_the_shared_block_over_items():
    cu_q, cu_k = testing.cu_seqlens([1000], [1000])
    block_indices = testing.skewed_block_indices(cu_q, cu_k, 2, 4, 64)
    _check(block_indices, cu_q, cu_k, 1000, 64, 16)
    schedule = build_schedule(block_indices, documents_of(cu_q, cu_k), 1000, 64, 16)
    sizes = (schedule.item_end - schedule.item_start)[: int(schedule.num_items)]
    assert int(sizes.max()) == 16, "block 0, read by every query, is split into items of 16 entries"


def test_bucket_bound_covers_every_document_block():
    # 3 documents of 129, 1 and 64 keys with block 64: 3 + 1 + 1 blocks per head.
    assert max_buckets(num_kv_heads=2, num_keys=194, num_docs=3, block_size=64) >= 2 * 5
    cu_q, cu_k = testing.cu_seqlens([129, 1, 64], [129, 1, 64])
    every_block = testing.random_block_indices(cu_q, cu_k, 2, 8, 64)
    _check(every_block, cu_q, cu_k, 194, 64, 4)


def test_build_schedule_stays_a_few_host_launches():
    """Eager mode pays a host launch per ATen call before every forward and backward: on an H200
    the schedule is host-bound (enqueue time equals device time), and the first version's 138
    calls took 2.4 ms at T = 8K in the bench, more than the forward's kernels."""
    cu_q, cu_k = testing.cu_seqlens([300, 200], [300, 200])
    block_indices = testing.random_block_indices(cu_q, cu_k, 4, 16, 64)
    documents = documents_of(cu_q, cu_k)
    with CountOps() as counted:
        build_schedule(block_indices, documents, 500, 64, 128)
    assert len(counted.calls) <= 115


def test_plan_op_packs_the_schedule_and_splits_back():
    cu_q, cu_k = testing.cu_seqlens([40, 0, 1, 90], [140, 5, 1, 90])
    block_indices = testing.random_block_indices(cu_q, cu_k, 2, 4, 64)
    plan = torch.ops.msa.plan(block_indices, cu_q, cu_k, 90, 140, 236, 64, 8)
    expected = build_schedule(block_indices, documents_of(cu_q, cu_k), 236, 64, 8)
    assert plan.dtype == torch.int32 and plan.numel() == plan_numel(block_indices.shape, 236, 4, 64, 8)
    for got, want in zip(unpack(plan, block_indices, 236, 4, 64), expected, strict=True):
        assert torch.equal(got, want)


def test_plan_fake_has_the_real_length():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cu_q, cu_k = testing.cu_seqlens([5, 200], [300, 260])
    block_indices = testing.random_block_indices(cu_q, cu_k, 3, 5, 64)
    real = torch.ops.msa.plan(block_indices, cu_q, cu_k, 200, 300, 560, 64, 16)
    with FakeTensorMode() as mode:
        fake = torch.ops.msa.plan(*(mode.from_tensor(x) for x in (block_indices, cu_q, cu_k)), 200, 300, 560, 64, 16)
    assert fake.shape == real.shape and fake.dtype == real.dtype


def test_a_plan_of_other_shapes_is_refused():
    cu_q, cu_k = testing.cu_seqlens([300], [300])
    block_indices = testing.random_block_indices(cu_q, cu_k, 2, 3, 64)
    plan = torch.ops.msa.plan(block_indices, cu_q, cu_k, 300, 300, 300, 64, 8)
    with pytest.raises(ValueError, match="plan: expected .* int32 entries"):
        unpack(plan[:-4], block_indices, 300, 1, 64)
    with pytest.raises(ValueError, match="plan: expected a 1-D int32 tensor"):
        q = torch.randn(300, 2, 64)
        k = torch.randn(300, 2, 64)
        torch.ops.msa.forward(q, k, k, block_indices, cu_q, cu_k, 300, 300, 64, 0.125, plan.float())


def test_sparse_attention_builds_one_plan_for_forward_and_backward(monkeypatch):
    calls = []
    original = torch_msa.backends._BACKENDS["reference"].ops["backward"]

    def backward(*args):
        calls.append(args[11])  # the plan, after grad_lse
        return original(*args)

    monkeypatch.setitem(torch_msa.backends._BACKENDS["reference"].ops, "backward", backward)
    cu_q, cu_k = testing.cu_seqlens([100], [100])
    block_indices = testing.random_block_indices(cu_q, cu_k, 1, 2, 64)
    q, k, v = (torch.randn(100, 2, 64, requires_grad=True) for _ in range(3))
    with CountOps() as counted:
        out = torch_msa.sparse_attention(q, k[:, :1], v[:, :1], block_indices, cu_q, cu_k, block_size=64)
        out.sum().backward()
    assert counted.count(torch.ops.msa.plan.default) == 1
    assert len(calls) == 1 and calls[0].dtype == torch.int32, "the backward receives the forward's plan"


def test_triton_plan_build_stays_a_few_host_calls(monkeypatch):
    """The Triton build's host work, counted without a GPU: ATen calls and kernel launches (the
    kernels replaced by counters). Each costs a host-side launch in eager mode."""
    pytest.importorskip("triton", reason=install.TRITON)
    from torch_msa.plan import kernels as plan_kernel

    launches = KernelLaunches(monkeypatch)
    launches.replace(plan_kernel, "msa_plan_place_kernel", "msa_plan_column_scan_kernel", "msa_plan_scan_kernel",
                     "msa_plan_item_tables_kernel")
    cu_q, cu_k = testing.cu_seqlens([300, 200], [300, 200])
    block_indices = testing.random_block_indices(cu_q, cu_k, 4, 16, 64)
    documents = documents_of(cu_q, cu_k)
    with CountOps() as counted:
        plan_kernel.plan(block_indices, documents, 500, 64, 128)
    # Count, the two scans, place, items: no sort, no scan of torch's, nothing else launched.
    assert launches.names == ["msa_plan_place_kernel", "msa_plan_column_scan_kernel", "msa_plan_scan_kernel",
                              "msa_plan_place_kernel", "msa_plan_item_tables_kernel"]
    assert {str(call) for call in counted.calls} <= {"aten.empty.memory_format", "aten.split_with_sizes.default",
                                                     "aten.slice.Tensor"}, counted.calls
    assert len(counted.calls) <= 5, counted.calls


def test_bucket_key_count_stops_at_the_document_end():
    cu_seqlens_k = torch.tensor([0, 200, 200, 201, 500], dtype=torch.int32)
    # Blocks start at a document's start plus a multiple of 128.
    key_rows = torch.tensor([0, 128, 200, 201, 329, 457], dtype=torch.int32)
    assert bucket_key_count(key_rows, cu_seqlens_k, 128).tolist() == [128, 72, 1, 128, 128, 43]


def _covered(schedule, first_query=0):
    """`{(head, key row, block, query slot)}`: every entry the schedule's items cover, with its
    bucket's fields and its query slot counted from `first_query`; and the largest item."""
    covered, largest = set(), 0
    for item in range(int(schedule.num_items)):
        bucket, start, end = (int(t[item]) for t in (schedule.item_bucket, schedule.item_start, schedule.item_end))
        fields = (int(schedule.bucket_head[bucket]), int(schedule.bucket_key_row[bucket]),
                  int(schedule.bucket_block[bucket]))
        covered |= {(*fields, slot + first_query) for slot in schedule.entry_query[start:end].tolist()}
        largest = max(largest, end - start)
    return covered, largest


@pytest.mark.parametrize("layout", LAYOUTS)
def test_with_items_equals_a_build_of_that_item_size(layout):
    """The plan's entries walked in other items (the index loss's, the deterministic backward's):
    entry for entry the tables a new build of that item size writes, without sorting again."""
    from torch_msa.plan.schedule import with_items

    lengths_q, lengths_k, block_size, topk = LAYOUTS[layout]
    cu_q, cu_k = testing.cu_seqlens(lengths_q, lengths_k)
    block_indices = testing.random_block_indices(cu_q, cu_k, 2, topk, block_size)
    documents, num_keys = documents_of(cu_q, cu_k), sum(lengths_k)
    built = build_schedule(block_indices, documents, num_keys, block_size, 8)
    for item_size in (1, 3, 64):
        regrouped = with_items(built, item_size)
        expected = build_schedule(block_indices, documents, num_keys, block_size, item_size)
        for name, got, want in zip(expected._fields, regrouped, expected, strict=True):
            assert torch.equal(got, want), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", [1, 37, 128])
def test_a_query_window_walks_exactly_its_queries_entries(layout, window):
    """`query_windows` cuts a call's plan to the queries of one window: the entries of those
    queries and no other, with the window's positions, in items no larger than asked."""
    from torch_msa.plan.schedule import query_windows

    lengths_q, lengths_k, block_size, topk = LAYOUTS[layout]
    cu_q, cu_k = testing.cu_seqlens(lengths_q, lengths_k)
    block_indices = testing.random_block_indices(cu_q, cu_k, 2, topk, block_size)
    documents, num_keys, num_queries = documents_of(cu_q, cu_k), sum(lengths_k), sum(lengths_q)
    whole = build_schedule(block_indices, documents, num_keys, block_size, 8)
    every, _ = _covered(whole)
    cut = query_windows(whole, topk, 5)
    for start in range(0, num_queries, window):
        stop = min(num_queries, start + window)
        part = cut(start, stop)
        covered, largest = _covered(part, first_query=start * topk)
        assert covered == {entry for entry in every if start * topk <= entry[3] < stop * topk}
        assert largest <= 5 and part.item_start.numel() >= int(part.num_items)
        assert torch.equal(part.position, whole.position[start:stop])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dropped", ["every-other-slot", "query-groups"])
def test_a_restricted_schedule_keeps_exactly_the_kept_entries_in_order(layout, dropped):
    """`restrict` (the KV-outer part of a step's plan): each bucket holds the entries of the kept
    selection that a plain-Python build gives it, in query order, then every dropped row; the items
    cover the kept entries alone; the other tables are the plan's."""
    from torch_msa.plan.groups import build_query_groups
    from torch_msa.plan.schedule import restrict

    lengths_q, lengths_k, block_size, topk = LAYOUTS[layout]
    cu_q, cu_k = testing.cu_seqlens(lengths_q, lengths_k)
    block_indices = testing.skewed_block_indices(cu_q, cu_k, 2, topk, block_size)
    block_indices[1, ::3, 0] = 10_000  # out-of-contract ids stay dropped
    documents, num_keys, num_queries = documents_of(cu_q, cu_k), sum(lengths_k), sum(lengths_q)
    if dropped == "query-groups":
        kept_indices = build_query_groups(block_indices, documents, num_keys, block_size, 4).kv_outer_indices
    else:
        kept_indices = block_indices.clone()
        kept_indices[:, ::2, 1::2] = -1
    assert (kept_indices < 0).sum() > (block_indices < 0).sum()
    whole = build_schedule(block_indices, documents, num_keys, block_size, 8)
    part = restrict(whole, kept_indices, 3)
    expected = build_schedule_python(kept_indices, cu_q, cu_k, num_keys, block_size, 3)

    by_bucket = {(head, row): entries for head, row, _, entries in expected["buckets"]}
    kept_rows = []
    for bucket in range(int(whole.num_buckets)):
        key = (int(whole.bucket_head[bucket]), int(whole.bucket_key_row[bucket]))
        start, end = int(part.bucket_ptr[bucket]), int(part.bucket_ptr[bucket + 1])
        assert part.entry_query[start:end].tolist() == by_bucket.pop(key, []), key
        kept_rows += part.entry_query[start:end].tolist()
    assert not by_bucket, "a kept entry outside the plan's buckets"
    total = len(kept_rows)
    assert (part.bucket_ptr[int(whole.num_buckets):] == total).all()
    heads = torch.repeat_interleave(whole.bucket_head, whole.bucket_ptr.diff()).tolist()  # of the valid rows
    flat = kept_indices.reshape(kept_indices.shape[0], -1).tolist()
    dropped_rows = [q for row, q in enumerate(whole.entry_query.tolist())
                    if row >= len(heads) or flat[heads[row]][q] < 0]
    assert part.entry_query[total:].tolist() == dropped_rows

    covered, largest = _covered(part)
    assert len(covered) == total and largest <= 3
    assert torch.equal(part.item_start[int(part.num_items):], part.item_end[int(part.num_items):])
    for name in ("bucket_head", "bucket_key_row", "bucket_block", "position", "num_buckets"):
        assert torch.equal(getattr(part, name), getattr(whole, name)), name
    # Cut into query windows as a plan's schedule is.
    from torch_msa.plan.schedule import query_windows
    window = query_windows(part, topk, 3)(0, num_queries // 2)
    assert _covered(window)[0] == {entry for entry in covered if entry[3] < num_queries // 2 * topk}


def test_triton_query_groups_build_stays_a_few_host_calls(monkeypatch):
    """The query groups' Triton build before the query-outer forward's first kernel, counted
    without a GPU: one allocation for every table, the copy of the selection the groups kernel
    marks, views, and the groups and units kernels."""
    pytest.importorskip("triton", reason=install.TRITON)
    from torch_msa.plan import kernels as plan_kernel

    launches = KernelLaunches(monkeypatch)
    launches.replace(plan_kernel, "msa_plan_query_groups_kernel", "msa_plan_query_units_kernel")
    cu_q, cu_k = testing.cu_seqlens([300, 200], [300, 200])
    block_indices = testing.random_block_indices(cu_q, cu_k, 4, 16, 64)
    documents = documents_of(cu_q, cu_k)
    with CountOps() as counted:
        groups = plan_kernel.query_groups(block_indices, documents, 500, 64, 8)
    assert launches.names == ["msa_plan_query_groups_kernel", "msa_plan_query_units_kernel"]
    names = sorted(str(call) for call in counted.calls)
    expected = ["aten.copy_.default", "aten.empty.memory_format", "aten.split_with_sizes.default"]
    assert names == expected + ["aten.view.default"] * 3, names
    assert torch.equal(groups.kv_outer_indices, block_indices)  # the stand-in kernels marked nothing


def test_sparse_attention_that_autograd_does_not_record_leaves_the_plan_to_the_forward(monkeypatch):
    """Without a gradient to compute no plan op runs: the forward builds the plan it walks (with
    its query-outer part, the KV-outer part's alone), and gets the same output."""
    forwards = []
    original = torch_msa.backends._BACKENDS["reference"].ops["forward"]

    def forward(*args):
        forwards.append(args[-1])  # the plan
        return original(*args)

    monkeypatch.setitem(torch_msa.backends._BACKENDS["reference"].ops, "forward", forward)
    cu_q, cu_k = testing.cu_seqlens([100], [100])
    block_indices = testing.random_block_indices(cu_q, cu_k, 1, 2, 64)
    q, k, v = (torch.randn(100, 2, 64, requires_grad=True) for _ in range(3))
    with torch.no_grad(), CountOps() as counted:
        out = torch_msa.sparse_attention(q, k[:, :1], v[:, :1], block_indices, cu_q, cu_k, block_size=64)
    assert counted.count(torch.ops.msa.plan.default) == 0 and forwards == [None]
    with CountOps() as counted:
        recorded = torch_msa.sparse_attention(q, k[:, :1], v[:, :1], block_indices, cu_q, cu_k, block_size=64)
    assert counted.count(torch.ops.msa.plan.default) == 1 and forwards[-1] is not None
    assert torch.equal(out, recorded.detach())
