"""Query fragments (context parallelism) against the same documents as one causal suffix.

A set of fragments that together hold every query of every document must give, row for row,
the selection, output, lse and dq of the plain pack, and the same dk and dv: fragments share the
documents' keys and add into them. Runs on every backend present (the reference on CPU; the
Triton backend on CUDA); `tests/triton/kernels` covers the Triton kernels under the interpreter.
"""

import pytest
import torch

import torch_msa
from tests.support.documents import Documents
from tests.support.schedule_oracle import build_schedule_python
from torch_msa import testing
from torch_msa.documents import locate_queries
from torch_msa.plan.schedule import build_schedule

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LENGTHS = (300, 0, 1, 200, 129)
# Every query once, fragments out of order, several per document.
PIECES = ((3, 120, 80), (0, 0, 100), (4, 0, 129), (0, 100, 150), (2, 0, 1), (3, 0, 120), (0, 250, 50))
HEADS, KV_HEADS, DIM, INDEX_DIM, BLOCK, TOPK = 4, 2, 64, 32, 64, 3


def _problem(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)

    def tensor(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    q, k, v = tensor(total, HEADS, DIM), tensor(total, KV_HEADS, DIM), tensor(total, KV_HEADS, DIM)
    index_q, index_k = tensor(total, KV_HEADS, INDEX_DIM), tensor(total, 1, INDEX_DIM)
    cu, _ = testing.cu_seqlens(LENGTHS, LENGTHS, device)
    return q, k, v, index_q, index_k, cu, testing.fragments(LENGTHS, PIECES, device)


def _dtype(device):
    return torch.float64 if device == "cpu" else torch.bfloat16


def _close(actual, expected, device, what):
    tolerance = 1e-10 if device == "cpu" else 2e-2
    error = (actual.double() - expected.double()).abs().max().item()
    scale = max(1.0, expected.double().abs().max().item())
    assert error <= tolerance * scale, f"{what}: max error {error:.3g}"


def test_fragment_positions():
    frag = testing.fragments(LENGTHS, PIECES)
    docs = locate_queries(frag.cu_seqlens_q, frag.cu_seqlens_k, sum(LENGTHS), sum(LENGTHS), *frag.tensors)
    suffix = locate_queries(frag.cu_seqlens_k, frag.cu_seqlens_k, sum(LENGTHS), sum(LENGTHS))
    assert torch.equal(docs.position, suffix.position[frag.rows])
    assert torch.equal(docs.key_start, suffix.key_start[frag.rows])


@pytest.mark.parametrize("device", DEVICES)
def test_selection_of_fragments_equals_the_suffix_selection(device):
    _, _, _, index_q, index_k, cu, frag = _problem(device, _dtype(device))
    expected = torch_msa.select_blocks(index_q, index_k, cu, cu, max(LENGTHS), max(LENGTHS), topk=TOPK,
                                       block_size=BLOCK)
    actual = torch_msa.select_blocks(index_q[frag.rows], index_k, *frag.op_args, topk=TOPK, block_size=BLOCK,
                                     fragment_documents=frag.fragment_documents, fragment_starts=frag.fragment_starts)
    # Compared as sets per row, the contract's reading.
    assert torch.equal(actual.sort(-1).values, expected[:, frag.rows].sort(-1).values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_attention_of_fragments_equals_the_suffix_attention(device, deterministic):
    q, k, v, _, _, cu, frag = _problem(device, _dtype(device))
    block_indices = testing.random_block_indices(cu, cu, KV_HEADS, TOPK, BLOCK, torch.Generator().manual_seed(1))
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(q)
    grad_lse = torch.randn(q.shape[:2], generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(
        device=device, dtype=torch.float64 if device == "cpu" else torch.float32)

    def run(rows, *docs, **fragments):
        leaves = [x.detach().clone().requires_grad_() for x in (q[rows], k, v)]
        out, lse = torch_msa.sparse_attention(*leaves, block_indices[:, rows].contiguous(), *docs, block_size=BLOCK,
                                              return_lse=True, **fragments)
        torch.autograd.backward((out, lse), (grad_out[rows], grad_lse[rows]))
        return out, lse, *(x.grad for x in leaves)

    with torch.backends.cudnn.flags(), _deterministic(deterministic):
        expected = run(slice(None), cu, cu, max(LENGTHS), max(LENGTHS))
        actual = run(frag.rows, *frag.op_args, fragment_documents=frag.fragment_documents,
                     fragment_starts=frag.fragment_starts)
    for name, got, want, per_query in zip(("out", "lse", "dq", "dk", "dv"), actual, expected,
                                          (True, True, True, False, False)):
        _close(got, want[frag.rows] if per_query else want, device, name)


class _deterministic:
    def __init__(self, enabled):
        self.enabled, self.before = enabled, torch.are_deterministic_algorithms_enabled()

    def __enter__(self):
        torch.use_deterministic_algorithms(self.enabled)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.before)


@pytest.mark.parametrize("device", DEVICES)
def test_kl_loss_of_fragments_equals_the_suffix_loss(device):
    q, k, _, index_q, index_k, cu, frag = _problem(device, _dtype(device))
    block_indices = testing.random_block_indices(cu, cu, KV_HEADS, TOPK, BLOCK, torch.Generator().manual_seed(4))
    _, lse = torch_msa.sparse_attention(q, k, k, block_indices, cu, cu, block_size=BLOCK, return_lse=True)

    def run(rows, bi, *docs, **fragments):
        leaves = [x.detach().clone().requires_grad_() for x in (index_q[rows], index_k)]
        sparse = torch_msa.indexer_kl_loss(q[rows], k, lse[rows], *leaves, bi, *docs, block_size=BLOCK, **fragments)
        dense = torch_msa.indexer_kl_loss_dense(q[rows], k, *leaves, *docs, block_size=BLOCK, **fragments)
        (sparse + dense).backward()
        return sparse, dense, *(x.grad for x in leaves)

    expected = run(slice(None), block_indices, cu, cu, max(LENGTHS), max(LENGTHS))
    actual = run(frag.rows, block_indices[:, frag.rows].contiguous(), *frag.op_args,
                 fragment_documents=frag.fragment_documents, fragment_starts=frag.fragment_starts)
    for name, got, want, per_query in zip(("sparse loss", "dense loss", "d index_q", "d index_k"), actual, expected,
                                          (False, False, True, False)):
        _close(got, want[frag.rows] if per_query else want, device, name)


def test_one_fragment_at_the_suffix_is_the_suffix_rule():
    q_lens, k_lens = (30, 0, 70), (140, 5, 70)
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens)
    documents = torch.tensor([0, 1, 2], dtype=torch.int32)
    starts = torch.tensor([k - q for q, k in zip(q_lens, k_lens)], dtype=torch.int32)
    block_indices = testing.random_block_indices(cu_q, cu_k, KV_HEADS, TOPK, BLOCK)
    q = torch.randn(100, HEADS, DIM, dtype=torch.float64)
    k, v = torch.randn(2, 215, KV_HEADS, DIM, dtype=torch.float64)
    plain = torch_msa.sparse_attention(q, k, v, block_indices, cu_q, cu_k, block_size=BLOCK, return_lse=True)
    fragmented = torch_msa.sparse_attention(q, k, v, block_indices, cu_q, cu_k, block_size=BLOCK, return_lse=True,
                                            fragment_documents=documents, fragment_starts=starts)
    for got, want in zip(fragmented, plain):
        assert torch.equal(got, want)


@pytest.mark.parametrize("entries_per_item", [1, 7, 64])
def test_schedule_of_fragments_equals_the_python_build(entries_per_item):
    frag = testing.fragments(LENGTHS, PIECES)
    block_indices = testing.random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, KV_HEADS, TOPK, BLOCK,
                                                 None, *frag.tensors)
    schedule = build_schedule(block_indices, Documents(*frag.op_args, *frag.tensors), sum(LENGTHS), BLOCK,
                              entries_per_item)
    expected = build_schedule_python(block_indices, frag.cu_seqlens_q, frag.cu_seqlens_k, sum(LENGTHS), BLOCK,
                                     entries_per_item, *frag.tensors)
    num_buckets = int(schedule.num_buckets)
    assert num_buckets == len(expected["buckets"])
    # Fragments of one document share its key blocks: one bucket per (head, key block).
    assert len({(head, row) for head, row, _, _ in expected["buckets"]}) == num_buckets
    for b, (head, row, block, entries) in enumerate(expected["buckets"]):
        start, end = int(schedule.bucket_ptr[b]), int(schedule.bucket_ptr[b + 1])
        assert (int(schedule.bucket_head[b]), int(schedule.bucket_key_row[b]), int(schedule.bucket_block[b])) == (
            head, row, block)
        assert schedule.entry_query[start:end].tolist() == entries


def _fragment_args(**overrides):
    frag = testing.fragments(LENGTHS, PIECES)
    args = dict(fragment_documents=frag.fragment_documents, fragment_starts=frag.fragment_starts)
    args.update(overrides)
    return frag, args


@pytest.mark.parametrize("overrides, message", [
    (dict(fragment_starts=None), "fragment_starts: expected a tensor when fragment_documents is given"),
    (dict(fragment_documents=torch.zeros(7, dtype=torch.int64)), "fragment_documents: expected dtype int32"),
    (dict(fragment_starts=torch.zeros(6, dtype=torch.int32)), "fragment_starts: expected F = 7 entries"),
])
def test_fragment_metadata_errors_name_the_argument(overrides, message):
    frag, args = _fragment_args(**overrides)
    index_q = torch.randn(sum(LENGTHS), KV_HEADS, INDEX_DIM)
    with pytest.raises((ValueError, TypeError), match=message):
        torch_msa.select_blocks(index_q, index_q[:, :1], *frag.op_args, topk=TOPK, block_size=BLOCK, **args)


@pytest.mark.parametrize("documents, starts, message", [
    ([0, 0, 4, 0, 2, 3, 5], None, r"fragment_documents\[6\]: expected a document of cu_seqlens_k in \[0, 5\), got 5"),
    (None, [120, 0, 0, 100, 0, 0, -1], r"fragment_starts\[6\]: expected a document-local position >= 0"),
    (None, [121, 0, 0, 100, 0, 0, 250], r"fragment_starts\[0\]: expected fragment_starts \+ Lq <= Lk"),
])
def test_fragment_value_errors_name_the_fragment(documents, starts, message):
    overrides = {}
    if documents is not None:
        overrides["fragment_documents"] = torch.tensor(documents, dtype=torch.int32)
    if starts is not None:
        overrides["fragment_starts"] = torch.tensor(starts, dtype=torch.int32)
    frag, args = _fragment_args(**overrides)
    q = torch.randn(sum(LENGTHS), HEADS, DIM)
    k = torch.randn(sum(LENGTHS), KV_HEADS, DIM)
    with pytest.raises(ValueError, match=message):
        torch_msa.validate_inputs(q, k, k, None, *frag.op_args, **args)


def test_fragments_need_cu_seqlens():
    q = torch.randn(10, HEADS, DIM)
    k = torch.randn(10, KV_HEADS, DIM)
    block_indices = torch.zeros(KV_HEADS, 10, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected the fragments' \\[F \\+ 1\\] boundaries"):
        torch_msa.sparse_attention(q, k, k, block_indices, fragment_documents=torch.zeros(1, dtype=torch.int32),
                                   fragment_starts=torch.zeros(1, dtype=torch.int32))


def test_fragments_trace_under_compile_fullgraph():
    q, k, v, index_q, index_k, _, frag = _problem("cpu", torch.float32)
    q, index_q = q[frag.rows], index_q[frag.rows]

    def step(q, k, v, index_q, index_k, fragment_documents, fragment_starts):
        out = torch_msa.msa_attention(q, k, v, index_q, index_k, *frag.op_args, topk=TOPK, block_size=BLOCK,
                                      fragment_documents=fragment_documents, fragment_starts=fragment_starts)
        return out.sum()

    args = (q, k, v, index_q, index_k, *frag.tensors)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), step(*args))
