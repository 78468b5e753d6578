"""The forward in query windows (`torch_msa/query_windows.py`) equals one call over all queries."""

import pytest
import torch

from tests.support.documents import Documents, backend_arguments
from torch_msa import query_windows, reference, testing
from torch_msa.documents import locate_queries, token_fragments

BLOCK = 16
HEADS, KV_HEADS, DIM, TOPK = 4, 2, 8, 3


def _problem(q_lens, k_lens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens)
    num_queries, num_keys = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(num_queries, HEADS, DIM, generator=generator, dtype=torch.float64)
    k = torch.randn(num_keys, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    v = torch.randn(num_keys, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    block_indices = testing.random_block_indices(cu_q, cu_k, KV_HEADS, TOPK, BLOCK, generator)
    return q, k, v, block_indices, cu_q, cu_k, max(q_lens), max(k_lens)


def _budget(window):
    return window * query_windows.partial_bytes_per_query(HEADS, TOPK, DIM, torch.float64)


class _Recorder:
    """`reference.forward` writing into what it is given, recording the queries and plan of every
    call (`calls`) and where it wrote (`written`)."""

    def __init__(self):
        self.calls, self.written = [], []

    def __call__(self, q, k, v, block_indices, documents, block_size, softmax_scale, plan, into=None):
        self.calls.append((q.shape[0], plan))
        out, lse = reference.forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan)
        if into is None:
            return out, lse
        self.written.append(into)
        into[0].copy_(out)
        into[1].copy_(lse)
        return into


def _windowed(problem, window, plan=None, fragments=(None, None), recorder=None):
    q, k, v, block_indices, cu_q, cu_k, max_q, max_k = problem
    recorder = recorder or _Recorder()
    out, lse = query_windows.forward_in_windows(recorder, q, k, v, block_indices,
                                                Documents(cu_q, cu_k, max_q, max_k, *fragments), BLOCK, DIM**-0.5, plan,
                                                budget=_budget(window))
    return out, lse, recorder.calls


def _assert_same(actual, expected):
    assert torch.equal(actual[0], expected[0])
    assert torch.equal(actual[1], expected[1])


@pytest.mark.parametrize("window", [1, 7, 64])
@pytest.mark.parametrize("lengths", [([70], [70]), ([30, 0, 1, 45], [30, 0, 1, 45]), ([20, 33], [90, 33])],
                         ids=["one-document", "pack-with-empty-and-1-token", "lq-below-lk"])
def test_windows_equal_one_call(window, lengths):
    problem = _problem(*lengths)
    q, k, v, block_indices, cu_q, cu_k, max_q, max_k = problem
    expected = reference.forward(q, k, v, block_indices, Documents(cu_q, cu_k, max_q, max_k), BLOCK, DIM**-0.5)
    out, lse, calls = _windowed(problem, window)
    _assert_same((out, lse), expected)
    assert all(queries <= window for queries, _ in calls)
    assert sum(queries for queries, _ in calls) == q.shape[0]


def test_each_window_writes_its_rows_of_the_result():
    """No window's output is copied: each forward writes the rows of the call's `out` and `lse`."""
    problem = _problem([70], [70])
    recorder = _Recorder()
    out, lse, _ = _windowed(problem, 32, recorder=recorder)
    starts = [0, 32, 64]
    assert len(recorder.written) == len(starts)
    for start, (window_out, window_lse) in zip(starts, recorder.written):
        assert window_out.data_ptr() == out[start:].data_ptr() and window_out.is_contiguous()
        assert window_lse.data_ptr() == lse[start:].data_ptr() and window_lse.is_contiguous()


def test_a_problem_that_fits_one_window_is_passed_through_with_its_plan():
    problem = _problem([40], [40])
    plan = torch.zeros(3, dtype=torch.int32)  # opaque to the windows: only passed on
    _, _, calls = _windowed(problem, window=40, plan=plan)
    assert len(calls) == 1 and calls[0][0] == 40 and calls[0][1] is plan


def test_windows_with_their_own_arguments_get_their_plans_there():
    """With `window_arguments` over several windows, each window gets its plan through its own
    arguments (the query-outer part's): the windows build no plan and pass None; a plan given
    beside them is refused before any window runs."""
    q, k, v, block_indices, cu_q, cu_k, max_q, max_k = _problem([70], [70])
    documents = Documents(cu_q, cu_k, max_q, max_k)
    calls = []

    def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan, into=None, marker=None):
        calls.append((q.shape[0], plan, marker))
        return into

    query_windows.forward_in_windows(forward, q, k, v, block_indices, documents, BLOCK, DIM**-0.5,
                                     budget=_budget(32), window_arguments=lambda start, stop: {"marker": (start, stop)})
    assert calls == [(32, None, (0, 32)), (32, None, (32, 64)), (6, None, (64, 70))]
    with pytest.raises(ValueError, match="plan: expected None with window_arguments over several windows"):
        query_windows.forward_in_windows(forward, q, k, v, block_indices, documents, BLOCK, DIM**-0.5,
                                         torch.zeros(3, dtype=torch.int32), budget=_budget(32),
                                         window_arguments=lambda start, stop: {})
    assert len(calls) == 3


def test_windows_of_fragments_equal_one_call():
    frags = testing.fragments([50, 40], [(1, 10, 20), (0, 0, 30), (1, 0, 5)])
    generator = torch.Generator().manual_seed(1)
    num_queries, num_keys = int(frags.cu_seqlens_q[-1]), int(frags.cu_seqlens_k[-1])
    q = torch.randn(num_queries, HEADS, DIM, generator=generator, dtype=torch.float64)
    k = torch.randn(num_keys, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    v = torch.randn(num_keys, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    block_indices = testing.random_block_indices(frags.cu_seqlens_q, frags.cu_seqlens_k, KV_HEADS, TOPK, BLOCK,
                                                 generator, *frags.tensors)
    problem = (q, k, v, block_indices, *frags.op_args)
    expected = reference.forward(*backend_arguments("forward", q, k, v, block_indices, *frags.op_args, BLOCK, DIM**-0.5, None,
                                                    *frags.tensors))
    out, lse, calls = _windowed(problem, window=9, fragments=frags.tensors)
    _assert_same((out, lse), expected)
    assert len(calls) == 7


def test_windows_keep_the_rule_for_malformed_documents():
    problem = list(_problem([30, 30], [30, 30]))
    problem[4] = torch.tensor([0, 40, 25], dtype=torch.int32)  # decreasing boundaries
    problem[3] = torch.full_like(problem[3], 1)
    q, k, v, block_indices, cu_q, cu_k, max_q, max_k = problem
    expected = reference.forward(q, k, v, block_indices, Documents(cu_q, cu_k, max_q, max_k), BLOCK, DIM**-0.5)
    out, lse, _ = _windowed(problem, window=8)
    _assert_same((out, lse), expected)


def test_a_non_finite_document_stays_in_its_document_across_windows():
    problem = _problem([25, 25], [25, 25])
    problem[0][:25] = float("nan")
    problem[1][:25] = float("nan")
    out, lse, _ = _windowed(problem, window=10)
    assert torch.isfinite(out[25:]).all() and torch.isfinite(lse[25:]).all()


def test_token_fragments_place_every_query_as_locate_queries_does():
    cu_q, cu_k = testing.cu_seqlens([3, 0, 5], [7, 2, 5])
    cu_q = torch.cat([cu_q, torch.tensor([6], dtype=torch.int32)])  # one malformed trailing boundary
    cu_k = torch.cat([cu_k, torch.tensor([14], dtype=torch.int32)])
    documents, starts = token_fragments(cu_q, cu_k, 9, 14)
    boundaries = torch.arange(10, dtype=torch.int32)
    direct = locate_queries(cu_q, cu_k, 9, 14)
    through_fragments = locate_queries(boundaries, cu_k, 9, 14, documents, starts)
    assert torch.equal(direct.position, through_fragments.position)
    assert torch.equal(direct.key_start, through_fragments.key_start)
    assert (documents[direct.position < 0] == -1).all()


def test_the_window_bounds_the_partial_bytes_whatever_the_length():
    per_query = query_windows.partial_bytes_per_query(64, 16, 128, torch.bfloat16)
    assert per_query == 64 * 16 * (128 * 2 + 4)
    window = query_windows.window_queries(64, 16, 128, torch.bfloat16)
    assert window * per_query <= query_windows.PARTIAL_BYTES < (window + 1) * per_query
