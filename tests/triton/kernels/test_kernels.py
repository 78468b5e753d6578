"""The Triton kernels against the reference at small shapes.

On a CUDA host these run the compiled kernels; on CPU they run under the Triton interpreter
(`TRITON_INTERPRET=1`, set by `tests/triton/test_interpret.py` for a subprocess, because the
interpreter must be chosen before triton is imported). The interpreter does not compute bf16
`tl.dot` correctly (triton 3.8), so the small cases use fp32 and fp16; bf16 is covered at M3
shapes by `tests/triton/test_cuda.py`.
"""

import os

import pytest
import torch

from tests.support import dense
from tests.support.documents import Documents, backend_arguments, documents_of
from torch_msa import reference, testing
from torch_msa.schedule import build_schedule, pack
from torch_msa.triton import (
    backward_deterministic,
    backward_deterministic_kernel,
    backward_kernel,
    common,
    forward_kernel,
    plan_kernel,
    select_kernel,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETING else "cuda"
if not INTERPRETING and not torch.cuda.is_available():
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 for the CPU interpreter", allow_module_level=True)

# (q lengths, k lengths, Hq, Hkv, D, block, topk, dtype)
ATTENTION_CASES = {
    "pack-empty-and-1-token": ([40, 0, 1, 90], [140, 5, 1, 90], 4, 2, 64, 64, 4, torch.float32),
    "one-doc-d128-b128-fp16": ([150], [150], 8, 2, 128, 128, 2, torch.float16),
    "suffix-pack-group3": ([30, 70], [140, 70], 6, 2, 64, 64, 3, torch.float32),
    "mha-topk-beyond-blocks": ([200], [200], 2, 2, 64, 64, 16, torch.float16),
}
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2}


def _layout(q_lens, k_lens):
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens, DEVICE)
    return cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]), max(q_lens), max(k_lens)


def _junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size):
    """Valid random selections with out-of-contract ids mixed in: repeats, far ids, negatives."""
    block_indices = testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    if topk > 1:
        block_indices[0, :, -1] = block_indices[0, :, 0]
        block_indices[-1, ::3, 0] = 10_000
        block_indices[-1, 1::4, 1] = -5
    return block_indices


def _close(actual, expected, tolerance, what):
    error = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.double().abs().max().item() if expected.numel() else 0.0)
    assert error <= tolerance * scale, f"{what}: max error {error:.3g} > {tolerance:.1g} x {scale:.3g}"


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_forward_and_backward_match_reference(case):
    q_lens, k_lens, num_heads, num_kv_heads, dim, block_size, topk, dtype = ATTENTION_CASES[case]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout(q_lens, k_lens)
    block_indices = _junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype)
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, dim**-0.5)
    out_ref, lse_ref = reference.forward(*backend_arguments("forward", q, k, v, *args))
    out, lse = forward_kernel.forward(*backend_arguments("forward", q, k, v, *args))
    tolerance = TOLERANCE[dtype]
    _close(out, out_ref, tolerance, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    _close(lse.nan_to_num(neginf=0), lse_ref.nan_to_num(neginf=0), tolerance, "lse")

    grad_out = torch.randn_like(q)
    grad_lse = torch.randn(num_queries, num_heads, device=DEVICE)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, grad_lse))
    actual = backward_kernel.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, grad_lse))
    for name, got, want in zip(("dq", "dk", "dv"), actual, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        _close(got, want, 4 * tolerance, name)


def test_backward_without_grad_lse_matches_reference():
    q_lens, k_lens, num_heads, num_kv_heads, dim, block_size, topk, dtype = ATTENTION_CASES["suffix-pack-group3"]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout(q_lens, k_lens)
    block_indices = testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, 0.3)
    out, lse = reference.forward(*backend_arguments("forward", q, k, v, *args))
    grad_out = torch.randn_like(q)
    for got, want in zip(backward_kernel.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args)),
                         reference.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args))):
        _close(got, want, 1e-4, "gradient")


DETERMINISTIC_CASES = ("pack-empty-and-1-token", "suffix-pack-group3")


@pytest.mark.parametrize("case", DETERMINISTIC_CASES)
def test_deterministic_backward_matches_reference_and_repeats_bitwise(case, monkeypatch):
    """Junk and repeated ids, grad_lse, a pack with an empty and a 1-token document, Lq < Lk.

    Items of one tile split every bucket the queries share, so the reduction of dK/dV sums
    several items whose last positions differ."""
    monkeypatch.setattr(backward_deterministic_kernel, "ITEM_TILES", 1)
    q_lens, k_lens, num_heads, num_kv_heads, dim, block_size, topk, dtype = ATTENTION_CASES[case]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout(q_lens, k_lens)
    block_indices = _junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    entries_per_item = common.tile_shape(num_heads, num_kv_heads,
                                         backward_kernel.DETERMINISTIC_BLOCKS_CONFIGS[0].rows)[0]
    bucket_sizes = build_schedule(block_indices, documents_of(cu_q, cu_k), num_keys, block_size,
                                  entries_per_item).bucket_ptr.diff()
    assert (bucket_sizes > entries_per_item).any(), "no bucket is split over several items"
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, dim**-0.5)
    out, lse = reference.forward(*backend_arguments("forward", q, k, v, *args))
    grad_out = torch.randn_like(q)
    grad_lse = torch.randn(num_queries, num_heads, device=DEVICE)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args, grad_lse))
    first = backward_deterministic.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args, grad_lse))
    second = backward_deterministic.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args, grad_lse))
    for name, got, again, want in zip(("dq", "dk", "dv"), first, second, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        _close(got, want, 4 * TOLERANCE[dtype], name)
        assert torch.equal(got, again), f"{name} differs between two runs"


def test_deterministic_backward_of_a_skewed_selection_without_grad_lse(monkeypatch):
    """Every query picks block 0 and its newest blocks: block 0's bucket spans many items."""
    monkeypatch.setattr(backward_deterministic_kernel, "ITEM_TILES", 1)
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout([150, 60], [300, 60])
    num_heads, num_kv_heads, dim, block_size, topk = 4, 1, 64, 64, 3
    block_indices = testing.skewed_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=torch.float16)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=torch.float16) for _ in range(2))
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, 0.3)
    out, lse = reference.forward(*backend_arguments("forward", q, k, v, *args))
    grad_out = torch.randn_like(q)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args))
    grads = backward_deterministic.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args))
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        _close(got, want, 4 * TOLERANCE[torch.float16], name)


SELECT_CASES = {
    "pack": ([40, 0, 1, 300], [140, 5, 1, 300], 2, 32, 64, 4),
    "suffix-non-pow2-dim": ([30, 170], [400, 170], 3, 48, 64, 3),
    "block128-topk-beyond": ([300], [300], 4, 128, 128, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", SELECT_CASES)
def test_selection_matches_reference(case, dtype):
    q_lens, k_lens, num_heads, index_dim, block_size, topk = SELECT_CASES[case]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout(q_lens, k_lens)
    index_q = torch.randn(num_queries, num_heads, index_dim, device=DEVICE, dtype=dtype)
    index_k = torch.randn(num_keys, 1, index_dim, device=DEVICE, dtype=dtype)
    args = (index_q, index_k, cu_q, cu_k, max_q, max_k, topk, block_size)
    chosen = select_kernel.select_blocks(*backend_arguments("select_blocks", *args))
    dense.check_selection(chosen.cpu(), index_q.cpu(), index_k.cpu(), cu_q.cpu(), cu_k.cpu(), topk, block_size)
    assert torch.equal(chosen, reference.select_blocks(*backend_arguments("select_blocks", *args)))


def test_selection_reads_strided_boundaries():
    """`cu_seqlens` views with a stride of 2 select exactly as their contiguous copies."""
    q_lens, k_lens, num_heads, index_dim, block_size, topk = SELECT_CASES["pack"]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout(q_lens, k_lens)
    index_q = torch.randn(num_queries, num_heads, index_dim, device=DEVICE)
    index_k = torch.randn(num_keys, 1, index_dim, device=DEVICE)
    strided_q, strided_k = (torch.stack((cu, -cu), 1)[:, 0] for cu in (cu_q, cu_k))
    assert strided_q.stride(0) == 2
    expected = select_kernel.select_blocks(index_q, index_k, Documents(cu_q, cu_k, max_q, max_k), topk, block_size)
    got = select_kernel.select_blocks(index_q, index_k, Documents(strided_q, strided_k, max_q, max_k), topk, block_size)
    assert torch.equal(got, expected)


def test_selection_ties_prefer_the_lower_block():
    """Integer scores tie everywhere; the contract keeps the lower ids, like the reference."""
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout([260, 200], [520, 200])
    index_q = torch.randint(-1, 2, (num_queries, 2, 16), device=DEVICE).float()
    index_k = torch.randint(-1, 2, (num_keys, 1, 16), device=DEVICE).float()
    args = (index_q, index_k, cu_q, cu_k, max_q, max_k, 3, 64)
    assert torch.equal(select_kernel.select_blocks(*backend_arguments("select_blocks", *args)),
                       reference.select_blocks(*backend_arguments("select_blocks", *args)))


# Three documents whose key ends are not block-aligned: the last block of document 0 holds the
# keys of documents 1 and 2, and document 1's only block holds keys of document 2.
POISON_LAYOUT = ([50, 40, 30], [70, 40, 30])
POISONED_DOC = 1
NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def _poison(x, rows):
    """A copy of `x` whose `rows` cycle through NaN, +Inf and -Inf."""
    x = x.clone()
    for i, row in enumerate(range(rows.start, rows.stop)):
        x[row] = NON_FINITE[i % len(NON_FINITE)]
    return x


def _doc_rows(cu):
    return [range(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]


def _assert_other_docs_unchanged(name, got, want, rows_per_doc, exact):
    for doc, rows in enumerate(rows_per_doc):
        if doc == POISONED_DOC or not rows:
            continue
        part, clean = got[rows.start:rows.stop], want[rows.start:rows.stop]
        assert part.isfinite().all(), f"{name} of document {doc} has non-finite values"
        if exact:
            assert torch.equal(part, clean), f"{name} of document {doc} changed"
        else:  # the default backward adds with atomics: order-dependent in the last bits on a GPU
            torch.testing.assert_close(part, clean, rtol=1e-5, atol=1e-5, msg=f"{name} of document {doc} changed")


@pytest.mark.parametrize("poisoned", ["q", "k", "v", "grad_out", "grad_lse"])
def test_a_non_finite_document_changes_no_other_document(poisoned):
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout(*POISON_LAYOUT)
    query_rows, key_rows = _doc_rows(cu_q), _doc_rows(cu_k)
    num_heads, num_kv_heads, dim, block_size, topk = 2, 1, 64, 64, 2
    generator = torch.Generator().manual_seed(1)
    clean = {
        "q": torch.randn(num_queries, num_heads, dim, generator=generator),
        "k": torch.randn(num_keys, num_kv_heads, dim, generator=generator),
        "v": torch.randn(num_keys, num_kv_heads, dim, generator=generator),
        "grad_out": torch.randn(num_queries, num_heads, dim, generator=generator),
        "grad_lse": torch.randn(num_queries, num_heads, generator=generator),
    }
    clean = {name: x.to(DEVICE) for name, x in clean.items()}
    rows = (key_rows if poisoned in ("k", "v") else query_rows)[POISONED_DOC]
    dirty = dict(clean, **{poisoned: _poison(clean[poisoned], rows)})
    # Every query reads every block it may (topk >= its visible blocks), so each tail block is read.
    block_indices = torch.arange(topk, dtype=torch.int32, device=DEVICE)
    block_indices = block_indices.expand(num_kv_heads, num_queries, topk).contiguous()
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, dim**-0.5)

    def run(x):
        out, lse = forward_kernel.forward(*backend_arguments("forward", x["q"], x["k"], x["v"], *args))
        backward_args = (x["grad_out"], x["q"], x["k"], x["v"], out, lse, *args, x["grad_lse"])
        grads = backward_kernel.backward(*backend_arguments("backward", *backward_args))
        deterministic = backward_deterministic.backward(*backend_arguments("backward", *backward_args))
        return {"out": out, "lse": lse, **dict(zip(("dq", "dk", "dv"), grads)),
                **dict(zip(("deterministic dq", "deterministic dk", "deterministic dv"), deterministic))}

    want, got = run(clean), run(dirty)
    for name in ("out", "lse"):
        _assert_other_docs_unchanged(name, got[name], want[name], query_rows, exact=True)
    for name, rows_per_doc in (("dq", query_rows), ("dk", key_rows), ("dv", key_rows)):
        _assert_other_docs_unchanged(name, got[name], want[name], rows_per_doc, exact=INTERPRETING)
        _assert_other_docs_unchanged(f"deterministic {name}", got[f"deterministic {name}"],
                                     want[f"deterministic {name}"], rows_per_doc, exact=True)


@pytest.mark.parametrize("poisoned", ["index_q", "index_k"])
def test_a_non_finite_document_changes_no_other_documents_selection(poisoned):
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout([50, 140, 30], [70, 140, 30])
    generator = torch.Generator().manual_seed(2)
    clean = {"index_q": torch.randn(num_queries, 2, 32, generator=generator).to(DEVICE),
             "index_k": torch.randn(num_keys, 1, 32, generator=generator).to(DEVICE)}
    rows = (_doc_rows(cu_k) if poisoned == "index_k" else _doc_rows(cu_q))[POISONED_DOC]
    dirty = dict(clean, **{poisoned: _poison(clean[poisoned], rows)})

    def run(x):
        return select_kernel.select_blocks(x["index_q"], x["index_k"], Documents(cu_q, cu_k, max_q, max_k), 3, 64)

    want, got = run(clean), run(dirty)
    for doc, rows in enumerate(_doc_rows(cu_q)):
        if doc != POISONED_DOC:
            assert torch.equal(got[:, rows.start:rows.stop], want[:, rows.start:rows.stop]), f"document {doc}"


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
    cu_q, cu_k, _, num_keys, _, _ = _layout(q_lens, k_lens)
    block_indices = _junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    expected = pack(build_schedule(block_indices, documents_of(cu_q, cu_k), num_keys, block_size, entries_per_item))
    got = plan_kernel.plan(block_indices, documents_of(cu_q, cu_k), num_keys, block_size, entries_per_item)
    assert torch.equal(got, expected)
    # Strided selections and boundaries are read through their strides.
    strided = block_indices.transpose(0, 1).contiguous().transpose(0, 1)
    cu_q_strided, cu_k_strided = (torch.stack((cu, -cu), 1)[:, 0] for cu in (cu_q, cu_k))
    assert torch.equal(
        plan_kernel.plan(strided, documents_of(cu_q_strided, cu_k_strided), num_keys, block_size, entries_per_item), expected)


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


def test_forward_and_backward_read_a_given_plan():
    """A plan of any item size (here 8, the kernels build 128 for this shape) gives the results
    of the reference."""
    q_lens, k_lens, num_heads, num_kv_heads, dim, block_size, topk, dtype = ATTENTION_CASES["pack-empty-and-1-token"]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout(q_lens, k_lens)
    block_indices = _junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype)
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, dim**-0.5)
    plan = plan_kernel.plan(block_indices, documents_of(cu_q, cu_k), num_keys, block_size, 8)
    out_ref, lse_ref = reference.forward(*backend_arguments("forward", q, k, v, *args))
    out, _ = forward_kernel.forward(*backend_arguments("forward", q, k, v, *args, plan))
    _close(out, out_ref, TOLERANCE[dtype], "out")
    grad_out = torch.randn_like(q)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args))
    actual = backward_kernel.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, None, plan))
    for name, got, want in zip(("dq", "dk", "dv"), actual, expected):
        _close(got, want, 4 * TOLERANCE[dtype], name)


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
    _close(out, out_ref, TOLERANCE[dtype], "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))  # a junk local slot leaves a query no key
    _close(lse.nan_to_num(neginf=0), lse_ref.nan_to_num(neginf=0), TOLERANCE[dtype], "lse")
    grad_out = torch.randn_like(q)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, None, None,
                                                     *fragments))
    for module in (backward_kernel, backward_deterministic):
        actual = module.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, None, None,
                                                    *fragments))
        for name, got, want in zip(("dq", "dk", "dv"), actual, expected):
            _close(got, want, 4 * TOLERANCE[dtype], f"{module.__name__} {name}")


def test_forward_in_query_windows_equals_one_call(monkeypatch):
    """The backend's forward with its partials bounded to 17 queries at a time (several windows,
    with junk ids and a pack with empty and 1-token documents) equals one kernel call."""
    import torch_msa.triton as triton_backend
    from torch_msa import query_windows

    q_lens, k_lens, num_heads, num_kv_heads, dim, block_size, topk, dtype = ATTENTION_CASES["pack-empty-and-1-token"]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = _layout(q_lens, k_lens)
    block_indices = _junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, dim**-0.5)
    expected = forward_kernel.forward(*backend_arguments("forward", q, k, v, *args))
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES", 17 * query_windows.partial_bytes_per_query(num_heads, topk, dim,
                                                                                                   dtype))
    out, lse = triton_backend.forward(*backend_arguments("forward", q, k, v, *args))
    # Each window groups other queries into a program's tile, so only the rounding may differ.
    _close(out, expected[0], 1e-5, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(expected[1]))
    _close(lse.nan_to_num(neginf=0), expected[1].nan_to_num(neginf=0), 1e-5, "lse")


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
    from torch_msa.schedule import bucket_key_count

    rows = torch.tensor([0, 128, 200, 201, 329, 457, 499, 500, 900, -3, 0, 64], dtype=torch.int32, device=DEVICE)
    for bounds in ([0, 200, 200, 201, 500], [0], [0, 300, 100, 500], [10, 20]):
        cu_k = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
        for block_size in (64, 128):
            got = plan_kernel.bucket_key_count(rows, cu_k, block_size)
            assert got.dtype == torch.int32 and torch.equal(got, bucket_key_count(rows, cu_k, block_size)), bounds
    assert plan_kernel.bucket_key_count(rows[:0], cu_k, 128).shape == (0,)
