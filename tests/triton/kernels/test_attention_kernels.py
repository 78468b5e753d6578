"""The Triton forward and backward kernels against the reference at small shapes: document packs
with empty and 1-token documents, `Lq < Lk`, junk ids, a given plan, query fragments, query
windows.

Where and how they run, and why in fp32 and fp16: `tests/support/triton_kernels.py`.
"""

import pytest
import torch

from tests.support.documents import Documents, backend_arguments, documents_of
from tests.support.triton_kernels import (
    ATTENTION_CASES,
    DEVICE,
    TOLERANCE,
    close,
    junk_indices,
    layout,
    require_a_device,
)
from torch_msa import reference, testing
from torch_msa.plan import kernels as plan_kernel
from torch_msa.plan.groups import build_query_groups, group_tokens
from torch_msa.plan.schedule import Schedule, build_schedule, pack, unpack
from torch_msa.settings import QUERY_OUTER_ENV
from torch_msa.stages import query_outer
from torch_msa.stages.dq import ungroup_dq
from torch_msa.triton import backward as backward_kernel
from torch_msa.triton import backward_deterministic
from torch_msa.triton import forward as forward_kernel
from torch_msa.triton import select as select_kernel
from torch_msa.triton_utils import launch
from torch_msa.triton_utils.launch import LaunchConfig

require_a_device()


def _junk_problem(case):
    """Random q, k, v of `ATTENTION_CASES[case]` and the ops' arguments after them: a selection
    with junk ids, the documents, the block size and the scale `D^-0.5`."""
    q_lens, k_lens, num_heads, num_kv_heads, dim, block_size, topk, dtype = ATTENTION_CASES[case]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout(q_lens, k_lens)
    block_indices = junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype)
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, dim**-0.5)
    return q, k, v, args



@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_forward_and_backward_match_reference(case):
    q, k, v, args = _junk_problem(case)
    num_queries, num_heads, _ = q.shape
    dtype = q.dtype
    out_ref, lse_ref = reference.forward(*backend_arguments("forward", q, k, v, *args))
    out, lse = forward_kernel.forward(*backend_arguments("forward", q, k, v, *args))
    tolerance = TOLERANCE[dtype]
    close(out, out_ref, tolerance, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    close(lse.nan_to_num(neginf=0), lse_ref.nan_to_num(neginf=0), tolerance, "lse")

    grad_out = torch.randn_like(q)
    grad_lse = torch.randn(num_queries, num_heads, device=DEVICE)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, grad_lse))
    actual = backward_kernel.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, grad_lse))
    for name, got, want in zip(("dq", "dk", "dv"), actual, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        close(got, want, 4 * tolerance, name)


def test_backward_without_grad_lse_matches_reference():
    q_lens, k_lens, num_heads, num_kv_heads, dim, block_size, topk, dtype = ATTENTION_CASES["suffix-pack-group3"]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout(q_lens, k_lens)
    block_indices = testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, 0.3)
    out, lse = reference.forward(*backend_arguments("forward", q, k, v, *args))
    grad_out = torch.randn_like(q)
    for got, want in zip(backward_kernel.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args)),
                         reference.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args))):
        close(got, want, 1e-4, "gradient")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ungroup_dq_restores_natural_order(dtype):
    """The SM90 backward's dQ accumulator groups each 16-head block's dims by 8: `[D / 8, 16, 8]`."""
    num_queries, num_heads, dim, block_heads, width = 3, 32, 128, 16, 8
    natural = torch.randn(num_queries, num_heads, dim, device=DEVICE)
    grouped = natural.view(num_queries, num_heads // block_heads, block_heads, dim // width, width).transpose(2, 3)
    dq = torch.full_like(natural, float("nan"), dtype=dtype)
    ungroup_dq(grouped.contiguous().view_as(natural), dq, block_heads, width, (DEVICE, dtype, dim))
    assert torch.equal(dq, natural.to(dtype))
    empty = torch.empty(0, num_heads, dim, device=DEVICE)
    ungroup_dq(empty, empty.to(dtype), block_heads, width, (DEVICE, dtype, dim))


def test_the_combine_leaves_the_rows_flagged_done():
    """With `done` flags the combine writes every (query, KV head) row not flagged positive as
    without them (zero, and -inf's bits as the SM90 forward fills them) and leaves the flagged
    rows' output and lse as they are."""
    from torch_msa.stages.combine import combine

    num_queries, num_kv_heads, group, topk, dim = 5, 2, 4, 3, 16
    rows = num_queries * num_kv_heads * topk * group
    partial_out = torch.randn(rows, dim, device=DEVICE, dtype=torch.float16)
    partial_lse = torch.randn(rows, device=DEVICE)
    partial_lse[::7] = -float("inf")
    not_done = torch.tensor(-float("inf")).view(torch.int32).item()
    done = torch.tensor([1, 0, not_done, 1, 0, not_done, 1, 1, 0, not_done], dtype=torch.int32, device=DEVICE)
    shape = (num_queries, num_kv_heads * group)
    want_out, want_lse = torch.empty(*shape, dim, device=DEVICE, dtype=torch.float16), torch.empty(shape, device=DEVICE)
    combine(partial_out, partial_lse, want_out, want_lse, num_kv_heads, topk)
    out, lse = torch.full_like(want_out, 7.0), torch.full_like(want_lse, 7.0)
    combine(partial_out, partial_lse, out, lse, num_kv_heads, topk, done)
    flagged = (done.view(num_queries, num_kv_heads) > 0).repeat_interleave(group, 1)
    assert flagged.any() and (out[flagged] == 7.0).all() and (lse[flagged] == 7.0).all()
    assert torch.equal(out[~flagged], want_out[~flagged]) and torch.equal(lse[~flagged], want_lse[~flagged])


def test_forward_and_backward_read_a_given_plan():
    """A plan of any item size (here 8, the kernels build 128 for this shape) gives the results
    of the reference."""
    q, k, v, args = _junk_problem("pack-empty-and-1-token")
    block_indices, cu_q, cu_k, _, _, block_size, _ = args
    dtype = q.dtype
    plan = plan_kernel.plan(block_indices, documents_of(cu_q, cu_k), k.shape[0], block_size, 8)
    out_ref, lse_ref = reference.forward(*backend_arguments("forward", q, k, v, *args))
    out, _ = forward_kernel.forward(*backend_arguments("forward", q, k, v, *args, plan))
    close(out, out_ref, TOLERANCE[dtype], "out")
    grad_out = torch.randn_like(q)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args))
    actual = backward_kernel.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, None, plan))
    for name, got, want in zip(("dq", "dk", "dv"), actual, expected):
        close(got, want, 4 * TOLERANCE[dtype], name)


def test_fragments_match_reference():
    """Query fragments sharing their documents' keys (out of order, several per document, an
    empty and a 1-token document, junk ids and an out-of-range document id): every kernel against
    the reference, and the plan against the reference's tables."""
    lengths = (150, 0, 1, 90)
    pieces = ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40), (0, 100, 20))
    frag = testing.fragments(lengths, pieces, DEVICE)
    num_heads, num_kv_heads, dim, block_size, topk, dtype = 4, 2, 64, 64, 3, torch.float32
    num_queries, num_keys = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
    fragments = frag.tensors
    index_q = torch.randn(num_queries, num_kv_heads, 32, device=DEVICE, dtype=dtype)
    index_k = torch.randn(num_keys, 1, 32, device=DEVICE, dtype=dtype)
    select_args = (index_q, index_k, *frag.op_args, topk, block_size, *fragments)
    assert torch.equal(select_kernel.select_blocks(*backend_arguments("select_blocks", *select_args)),
                       reference.select_blocks(*backend_arguments("select_blocks", *select_args)))

    block_indices = testing.random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, num_kv_heads, topk, block_size,
                                                 None, *fragments)
    block_indices[-1, ::3, 0] = 10_000
    for entries_per_item in (1, 16):
        documents = Documents(*frag.op_args, *fragments)
        expected = pack(build_schedule(block_indices, documents, num_keys, block_size, entries_per_item))
        got = plan_kernel.plan(block_indices, documents, num_keys, block_size, entries_per_item)
        assert torch.equal(got, expected)
    unknown = Documents(*frag.op_args, torch.tensor([3, 0, 2, 0, 7, 0], dtype=torch.int32, device=DEVICE), fragments[1])
    assert torch.equal(plan_kernel.plan(block_indices, unknown, num_keys, block_size, 8),
                       pack(build_schedule(block_indices, unknown, num_keys, block_size, 8)))

    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    args = (block_indices, *frag.op_args, block_size, dim**-0.5)
    out_ref, lse_ref = reference.forward(*backend_arguments("forward", q, k, v, *args, None, *fragments))
    out, lse = forward_kernel.forward(*backend_arguments("forward", q, k, v, *args, None, *fragments))
    close(out, out_ref, TOLERANCE[dtype], "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))  # a junk local slot leaves a query no key
    close(lse.nan_to_num(neginf=0), lse_ref.nan_to_num(neginf=0), TOLERANCE[dtype], "lse")
    grad_out = torch.randn_like(q)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, None, None,
                                                     *fragments))
    for module in (backward_kernel, backward_deterministic):
        actual = module.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, None, None,
                                                    *fragments))
        for name, got, want in zip(("dq", "dk", "dv"), actual, expected):
            close(got, want, 4 * TOLERANCE[dtype], f"{module.__name__} {name}")


def test_forward_in_query_windows_equals_one_call(monkeypatch):
    """The backend's forward with its partials bounded to 17 queries at a time (several windows,
    with junk ids and a pack with empty and 1-token documents) equals one kernel call."""
    import torch_msa.triton.interface as triton_backend
    from torch_msa import query_windows

    q, k, v, args = _junk_problem("pack-empty-and-1-token")
    _, num_heads, dim = q.shape
    dtype, topk = q.dtype, args[0].shape[-1]
    expected = forward_kernel.forward(*backend_arguments("forward", q, k, v, *args))
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES", 17 * query_windows.partial_bytes_per_query(num_heads, topk, dim,
                                                                                                   dtype))
    out, lse = triton_backend.forward(*backend_arguments("forward", q, k, v, *args))
    # Each window groups other queries into a program's tile, so only the rounding may differ.
    close(out, expected[0], 1e-5, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(expected[1]))
    close(lse.nan_to_num(neginf=0), expected[1].nan_to_num(neginf=0), 1e-5, "lse")


def _shared_selection(block_indices, block_size, run):
    """`block_indices` with each run of `run` queries taking its last query's ids where they are
    visible to the query: blocks shared by whole groups, by some of their queries and by one."""
    num_queries = block_indices.shape[1]
    source = (torch.arange(num_queries, device=DEVICE) // run * run + run - 1).clamp(max=num_queries - 1)
    visible = block_indices[:, source] * block_size <= torch.arange(num_queries, device=DEVICE).view(1, -1, 1)
    return torch.where(visible, block_indices[:, source], block_indices)


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_the_query_outer_forward_matches_reference(case):
    """The blocks the query groups share run query-outer, the rest KV-outer, junk ids among them."""
    q, k, v, args = _junk_problem(case)
    block_indices = _shared_selection(args[0], args[5], 16)
    args = (block_indices, *args[1:])
    forward_args = backend_arguments("forward", q, k, v, *args)
    documents, num_keys, block_size = forward_args[4], k.shape[0], args[5]
    # The groups and plan of the reference builds (the Triton builds equal them:
    # test_plan_kernel.py), which the interpreter runs faster.
    groups = build_query_groups(block_indices, documents, num_keys, block_size, group_tokens(q.shape[1], k.shape[1]))
    kv_outer = groups.kv_outer_indices
    assert ((kv_outer < 0) & (block_indices >= 0)).any() and (kv_outer >= 0).any()
    work = query_outer.QueryOuter(groups, block_indices, documents, 0, q.shape[0])
    plan = pack(build_schedule(kv_outer, documents, num_keys, block_size, 16))
    out_ref, lse_ref = reference.forward(*forward_args)
    out, lse = forward_kernel.forward(*backend_arguments("forward", q, k, v, kv_outer, *args[1:], plan),
                                      query_outer=work)
    close(out, out_ref, TOLERANCE[q.dtype], "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    close(lse.nan_to_num(neginf=0), lse_ref.nan_to_num(neginf=0), TOLERANCE[q.dtype], "lse")


@pytest.mark.parametrize("rows, given_plan, windows", [(0, False, True), (32, True, True), (0, True, False)])
def test_the_query_outer_forward_over_windows_and_fragments(monkeypatch, rows, given_plan, windows):
    """Asked for by `TORCH_MSA_QUERY_OUTER`, the backend's forward groups the call's queries
    (fragments are segments of their own) and runs them through query windows of 45 queries, which
    cut groups: it still matches the reference, with a group in one program or (`rows` 32) in four,
    its KV-outer part in a plan of its own or in the given plan restricted to it."""
    import torch_msa.triton.interface as triton_backend
    from torch_msa import query_windows

    frag = testing.fragments((150, 0, 1, 90), ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40)), DEVICE)
    # 16 query heads per KV head: groups of 8 queries, which the windows cut and launch in part.
    num_heads, num_kv_heads, dim, block_size, topk, dtype = 32, 2, 64, 16, 4, torch.float32
    num_queries, num_keys = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
    fragments = frag.tensors
    block_indices = testing.random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, num_kv_heads, topk,
                                                 block_size, None, *fragments)
    # Runs that cross a fragment boundary bring ids of another document: valid or junk, as they fall.
    block_indices = _shared_selection(block_indices, block_size, 8)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    plan = (plan_kernel.plan(block_indices, documents_of(frag.cu_seqlens_q, frag.cu_seqlens_k, *fragments), num_keys,
                             block_size, 16) if given_plan else None)
    forward_args = backend_arguments("forward", q, k, v, block_indices, *frag.op_args, block_size, dim**-0.5, plan,
                                     *fragments)
    out_ref, lse_ref = reference.forward(*forward_args)
    # Windows of 45 queries, or one window of exactly the call's queries.
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES", (45 if windows else num_queries)
                        * query_windows.partial_bytes_per_query(num_heads, topk, dim, dtype))
    monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    kv_outer, kv_outer_plan, window_arguments = query_outer.split_forward(q, block_indices, forward_args[4], num_keys,
                                                                          block_size, plan)
    assert ((kv_outer < 0) & (block_indices >= 0)).any() and window_arguments is not None
    work = window_arguments(0, num_queries)["query_outer"]
    # Restricted by the forward, after the query-outer part: in its first window.
    assert kv_outer_plan is None and work.call_plan is (plan if given_plan else None)
    kv_outer_plan = work.kv_outer_plan(None, num_keys, block_size, num_heads)
    if given_plan:  # the plan's entries that run KV-outer, without a second sort
        whole = unpack(plan, block_indices, num_keys, forward_args[4].num_documents, block_size)
        assert 0 < int(kv_outer_plan.bucket_ptr[-1]) < int(whole.bucket_ptr[-1])
    else:
        assert kv_outer_plan is None
    restrictions, walked = [], []
    real_restricted_plan, real_schedule_for = query_outer.restricted_plan, forward_kernel.schedule_for
    monkeypatch.setattr(query_outer, "restricted_plan",
                        lambda *args: restrictions.append(args) or real_restricted_plan(*args))
    monkeypatch.setattr(forward_kernel, "schedule_for", lambda *args: walked.append(args[-1]) or real_schedule_for(*args))
    with launch.pinned("msa_fwd_groups_kernel", LaunchConfig(num_stages=1, num_warps=4, rows=rows)):
        out, lse = triton_backend.forward(*forward_args)
    assert len(restrictions) == int(given_plan)  # once a call, in its first window
    if not windows:  # the KV-outer kernel walks the restricted plan's entries, or a plan of its own
        (walked_plan,) = walked
        assert (walked_plan is None if kv_outer_plan is None
                else int(walked_plan.bucket_ptr[-1]) == int(kv_outer_plan.bucket_ptr[-1]))
    else:  # every window walks its cut of one plan (a cut keeps the call's bucket bounds)
        assert len(walked) > 1 and all(isinstance(cut, Schedule) for cut in walked)
        assert all(cut.bucket_ptr is walked[0].bucket_ptr for cut in walked)
    close(out, out_ref, TOLERANCE[dtype], "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    close(lse.nan_to_num(neginf=0), lse_ref.nan_to_num(neginf=0), TOLERANCE[dtype], "lse")
