"""The index branch's KL distillation loss (`torch_msa.indexer_kl_loss`, `indexer_kl_loss_dense`).

The oracle below is written from the definition (spec, section 6) on full `[H, Tq, Tk]` float64
tensors, with autograd for the gradients; it shares nothing with `torch_msa.reference_index_loss`.
"""

import functools
import math
import warnings

import pytest
import torch

import torch_msa
from tests.support import dense
from torch_msa import api, reference, reference_index_loss, testing
from torch_msa.documents import Documents

BLOCK = 64


def _dense_support(cu_q, cu_k, num_kv_heads, num_keys):
    """`[Hkv, Tq, Tk]` bool: every visible key of the query's document."""
    num_queries = int(cu_q[-1])
    every_block = torch.arange(math.ceil(max(1, num_keys) / BLOCK), dtype=torch.int32)
    block_indices = every_block.expand(num_kv_heads, num_queries, -1)
    return dense.allowed_keys(block_indices, cu_q, cu_k, num_keys, BLOCK)


def _oracle_terms(q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, scale, index_scale):
    """`(support, teacher, logits, student_lse)`: `[Hkv, Tq, Tk]` float64 (student_lse `[Hkv, Tq, 1]`)."""
    num_queries, num_heads, _ = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    if block_indices is None:
        support = _dense_support(cu_q, cu_k, num_kv_heads, num_keys)
    else:
        support = dense.allowed_keys(block_indices, cu_q, cu_k, num_keys, BLOCK)
    heads_support = support.repeat_interleave(group, dim=0)  # [Hq, Tq, Tk]
    scores = torch.einsum("thd,jhd->htj", q.double(), k.double().repeat_interleave(group, dim=1)) * scale
    scores = scores.masked_fill(~heads_support, -math.inf)
    if lse is None:
        lse = torch.logsumexp(scores, -1).T  # [Tq, Hq]
    shift = lse.double().T.masked_fill(torch.isinf(lse.double().T), 0)
    teacher = torch.exp(scores - shift[..., None]).view(num_kv_heads, group, num_queries, num_keys).mean(1)
    logits = torch.einsum("trd,jd->rtj", index_q.double(), index_k[:, 0].double()) * index_scale
    any_key = support.any(-1, keepdim=True)
    student_lse = torch.logsumexp(torch.where(support, logits, -math.inf).where(any_key, 0.0), -1, keepdim=True)
    return support, teacher, logits, student_lse


def oracle_kl(q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, scale, index_scale):
    """Mean over (t, r) of KL(P_teacher || P_student) on J(t, r), float64, differentiable in index_q/k."""
    _, teacher, logits, student_lse = _oracle_terms(q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, scale,
                                                    index_scale)
    positive = teacher > 0
    terms = torch.where(positive, teacher * (teacher.where(positive, 1.0).log() - (logits - student_lse)), 0.0)
    return terms.sum() / max(1, q.shape[0] * k.shape[1])


CASE = dict(q_lens=(40, 0, 1, 90, 7), k_lens=(300, 5, 1, 90, 7), heads=4, kv_heads=2, dim=64, index_dim=16, topk=2)


def _problem(q_lens, k_lens, heads, kv_heads, dim, index_dim, topk, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens)
    num_queries, num_keys = sum(q_lens), sum(k_lens)
    q = torch.randn(num_queries, heads, dim, generator=g, dtype=dtype)
    k = torch.randn(num_keys, kv_heads, dim, generator=g, dtype=dtype)
    v = torch.randn(num_keys, kv_heads, dim, generator=g, dtype=dtype)
    index_q = torch.randn(num_queries, kv_heads, index_dim, generator=g, dtype=dtype).requires_grad_()
    index_k = torch.randn(num_keys, 1, index_dim, generator=g, dtype=dtype).requires_grad_()
    block_indices = testing.random_block_indices(cu_q, cu_k, kv_heads, topk, BLOCK, generator=g)
    docs = (cu_q, cu_k, max(q_lens), max(k_lens))
    return q, k, v, index_q, index_k, block_indices, docs


def _check_against_oracle(loss, index_q, index_k, expected, tolerance):
    torch.testing.assert_close(loss.double(), expected, rtol=tolerance, atol=tolerance)
    got = torch.autograd.grad(loss, (index_q, index_k))
    want = torch.autograd.grad(expected, (index_q, index_k))
    for name, a, b in zip(("d index_q", "d index_k"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a.double(), b.double(), rtol=tolerance, atol=tolerance * b.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_sparse_loss_and_gradients_match_the_oracle():
    q, k, v, index_q, index_k, block_indices, docs = _problem(**CASE)
    block_indices[:, ::5, 0] = -1  # a -1 in a row's first slot: the local block stays, nothing else
    assert (block_indices == -1).any()
    _, lse = torch_msa.sparse_attention(q, k, v, block_indices, *docs, block_size=BLOCK, return_lse=True)
    loss = torch_msa.indexer_kl_loss(q, k, lse, index_q, index_k, block_indices, *docs, block_size=BLOCK)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and loss.item() > 0
    expected = oracle_kl(q, k, lse, index_q, index_k, block_indices, docs[0], docs[1], 64**-0.5, 16**-0.5)
    _check_against_oracle(loss, index_q, index_k, expected, 1e-5)


def test_sparse_loss_reads_block_ids_as_a_set():
    q, k, v, index_q, index_k, block_indices, docs = _problem(**CASE)
    junk = block_indices.clone()
    junk[0, :, 1] = junk[0, :, 0]  # repeats
    junk[1, ::3, 0] = 10_000  # beyond the causal horizon
    _, lse = torch_msa.sparse_attention(q, k, v, junk, *docs, block_size=BLOCK, return_lse=True)
    loss = torch_msa.indexer_kl_loss(q, k, lse, index_q, index_k, junk, *docs, block_size=BLOCK)
    expected = oracle_kl(q, k, lse, index_q, index_k, junk, docs[0], docs[1], 64**-0.5, 16**-0.5)
    _check_against_oracle(loss, index_q, index_k, expected, 1e-5)


@pytest.mark.parametrize("given_lse", [False, True])
def test_dense_loss_and_gradients_match_the_oracle(given_lse):
    q, k, _, index_q, index_k, _, docs = _problem(**CASE)
    lse = None
    if given_lse:  # an lse that is not normalised on J: the teacher's mass is not 1, the gradient stays exact
        lse = torch.randn(q.shape[:2]) + 6
    loss = torch_msa.indexer_kl_loss_dense(q, k, index_q, index_k, *docs, lse=lse, block_size=BLOCK)
    expected = oracle_kl(q, k, lse, index_q, index_k, None, docs[0], docs[1], 64**-0.5, 16**-0.5)
    _check_against_oracle(loss, index_q, index_k, expected, 1e-5)


@pytest.mark.parametrize("support", ["sparse", "dense"])
def test_the_forwards_backward_terms_match_the_oracle(support):
    """`index_lse`, `teacher_mass` and the teacher's two index reductions, from the definition."""
    q, k, v, index_q, index_k, block_indices, docs = _problem(**CASE)
    lse = None
    if support == "sparse":
        _, lse = torch_msa.sparse_attention(q, k, v, block_indices, *docs, block_size=BLOCK, return_lse=True)
    else:
        block_indices = None
    scales = (64**-0.5, 16**-0.5)
    with torch.no_grad():
        _, _, index_lse, mass, index_key_sums, index_query_sums = torch.ops.msa.indexer_kl(
            q, k, lse, index_q, index_k, block_indices, *docs, BLOCK, *scales)
        support_mask, teacher, _, student_lse = _oracle_terms(q, k, lse, index_q, index_k, block_indices, docs[0],
                                                              docs[1], *scales)
    empty = ~support_mask.any(-1)
    expected = {
        "index_lse": student_lse[..., 0].masked_fill(empty, -math.inf).T,
        "teacher_mass": teacher.sum(-1).T,
        "teacher_index_keys": torch.einsum("rtj,jd->trd", teacher, index_k[:, 0].double()),
        "teacher_index_queries": torch.einsum("rtj,trd->jd", teacher, index_q.double())[:, None],
    }
    assert (teacher.sum(-1) > 0).any()
    for name, got in zip(expected, (index_lse, mass, index_key_sums, index_query_sums)):
        want = expected[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _teacher_problem(layout):
    """`(q, k, lse, index_q, index_k, block_indices, documents)` in float64 for the teacher-given
    loss, with junk ids (repeats, ids past the horizon, -1 in a first slot): the CASE pack (an
    empty and a 1-token document, Lq < Lk), or query fragments of a pack (out of order, several
    per document, an empty and a 1-token document)."""
    if layout == "pack":
        q, k, v, index_q, index_k, block_indices, docs = _problem(**CASE, dtype=torch.float64)
        documents = Documents(*docs)
    else:
        frag = testing.fragments((150, 0, 1, 90), ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40)))
        documents = Documents(*frag.op_args, *frag.tensors)
        g = torch.Generator().manual_seed(1)
        num_queries, num_keys = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
        q, index_q = (torch.randn(num_queries, h, d, generator=g, dtype=torch.float64) for h, d in ((4, 64), (2, 16)))
        k, v = (torch.randn(num_keys, 2, 64, generator=g, dtype=torch.float64) for _ in range(2))
        index_k = torch.randn(num_keys, 1, 16, generator=g, dtype=torch.float64)
        block_indices = testing.random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, 2, 3, BLOCK, g,
                                                     *frag.tensors)
    block_indices[0, :, -1] = block_indices[0, :, 0]
    block_indices[1, ::3, 0] = 10_000
    block_indices[1, 1::5, 0] = -1
    _, lse = reference.forward(q, k, v, block_indices, documents, BLOCK, 64**-0.5, None)
    return q, k, lse, index_q.detach(), index_k.detach(), block_indices, documents


def test_teacher_probabilities_lay_out_the_definitions_teacher_per_slot():
    q, k, lse, index_q, index_k, block_indices, documents = _teacher_problem("pack")
    cu_q, cu_k = documents.cu_seqlens_q, documents.cu_seqlens_k
    teacher = reference_index_loss.teacher_probabilities(q, k, lse, block_indices, documents, BLOCK, 64**-0.5)
    num_kv_heads, num_queries, topk = block_indices.shape
    assert teacher.shape == (num_queries, num_kv_heads, topk, BLOCK) and teacher.dtype == torch.float64
    _, dense_teacher, _, _ = _oracle_terms(q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, 64**-0.5, 16**-0.5)
    key_start, position = dense.positions(cu_q, cu_k, num_queries)
    expected = torch.zeros_like(teacher)
    for r in range(num_kv_heads):
        for t in range(num_queries):
            ids = block_indices[r, t].tolist()
            for s, block in enumerate(ids):
                if block < 0 or block in ids[:s]:
                    continue
                keys = block * BLOCK + torch.arange(BLOCK)
                seen = keys <= position[t]
                rows = (key_start[t] + keys).clamp(max=k.shape[0] - 1)
                expected[t, r, s] = torch.where(seen, dense_teacher[r, t, rows], 0)
    assert expected.sum() > 0 and (expected == 0).any()
    torch.testing.assert_close(teacher, expected, rtol=1e-12, atol=1e-14)
    # Without lse the teacher is normalised on the support: the same, as lse is the attention's there.
    torch.testing.assert_close(reference_index_loss.teacher_probabilities(q, k, None, block_indices, documents, BLOCK, 64**-0.5),
                               teacher, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layout", ["pack", "fragments"])
def test_index_loss_from_teacher_is_indexer_kl_and_its_backward(layout):
    """The teacher-given loss on `teacher_probabilities` gives `indexer_kl`'s loss and
    `indexer_kl_backward`'s gradients; what the teacher holds outside the support is not read."""
    q, k, lse, index_q, index_k, block_indices, documents = _teacher_problem(layout)
    scales = (64**-0.5, 16**-0.5)
    grad_loss = torch.tensor(1.7, dtype=torch.float64)
    loss, _, *kept = reference_index_loss.indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, BLOCK, *scales)
    want = reference_index_loss.indexer_kl_backward(grad_loss, index_q, index_k, *kept, block_indices, documents, BLOCK,
                                                    scales[1])
    teacher = reference_index_loss.teacher_probabilities(q, k, lse, block_indices, documents, BLOCK, scales[0])
    # Inside the support every teacher probability is positive: poison everything else.
    poisoned = teacher.masked_fill(teacher == 0, math.nan)
    for given in (teacher, poisoned):
        got_loss, *got = reference_index_loss.index_loss_from_teacher(given, grad_loss, index_q, index_k, block_indices,
                                                              documents, BLOCK, scales[1])
        assert got_loss.dtype == torch.float64 and got_loss.dim() == 0 and loss > 0
        torch.testing.assert_close(got_loss, loss, rtol=1e-12, atol=1e-14)
        for name, a, b in zip(("d index_q", "d index_k"), got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype and b.abs().max() > 0, name
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12 * b.abs().max().item(),
                                       msg=lambda m, name=name: f"{name}: {m}")
    loss_only = reference_index_loss.index_loss_from_teacher(teacher.half(), None, index_q.float(), index_k.float(),
                                                     block_indices, documents, BLOCK, scales[1])
    assert loss_only[1:] == (None, None) and loss_only[0].dtype == torch.float32
    torch.testing.assert_close(loss_only[0].double(), loss, rtol=2e-3, atol=1e-6)


def test_index_loss_from_teacher_without_queries_is_zero():
    q, k, v, index_q, index_k, block_indices, docs = _problem((0,), (9,), 4, 2, 64, 16, 2)
    documents = Documents(*docs)
    teacher = reference_index_loss.teacher_probabilities(q, k, torch.zeros(0, 4), block_indices, documents, BLOCK, 0.125)
    assert teacher.shape == (0, 2, 2, BLOCK)
    loss, d_index_q, d_index_k = reference_index_loss.index_loss_from_teacher(teacher, torch.tensor(1.0), index_q, index_k,
                                                                      block_indices, documents, BLOCK, 0.25)
    assert loss.item() == 0 and d_index_q.shape == index_q.shape and d_index_k.shape == index_k.shape
    assert not d_index_k.any()


def test_dense_loss_spans_keys_with_bounded_memory(monkeypatch):
    """A small budget and short key spans force many chunks of a few queries and several spans per
    chunk; each holds at most the budget, and the loss and gradients are unchanged."""
    q, k, _, index_q, index_k, _, docs = _problem(**CASE)
    whole = torch_msa.indexer_kl_loss_dense(q, k, index_q, index_k, *docs, block_size=BLOCK)
    whole_grads = torch.autograd.grad(whole, (index_q, index_k))
    budget, span_keys = 64 << 10, 100
    monkeypatch.setattr(reference, "_CHUNK_BYTES_CPU", budget)
    monkeypatch.setattr(reference_index_loss, "_DENSE_SPAN_KEYS", span_keys)
    shapes = []
    original = reference_index_loss._dense_spans

    def recording(*args):
        for span in original(*args):
            shapes.append(tuple(span.valid.shape))
            yield span

    monkeypatch.setattr(reference_index_loss, "_dense_spans", recording)
    split = torch_msa.indexer_kl_loss_dense(q, k, index_q, index_k, *docs, block_size=BLOCK)
    forward_shapes = list(shapes)
    shapes.clear()
    split_grads = torch.autograd.grad(split, (index_q, index_k))
    spans_per_chunk = math.ceil(k.shape[0] / span_keys)
    # The forward holds the teacher's scores too; the backward recomputes only the student.
    for pass_shapes, pair_bytes in ((forward_shapes, 16 * q.shape[1] + 32 * k.shape[1]), (shapes, 32 * k.shape[1])):
        assert len(pass_shapes) > 2 * spans_per_chunk
        assert all(queries * keys * pair_bytes <= budget for _, queries, keys in pass_shapes)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(split_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_gradcheck_fp64():
    q, k, v, index_q, index_k, block_indices, docs = _problem(
        q_lens=(2, 0, 1, 20), k_lens=(70, 3, 1, 20), heads=4, kv_heads=2, dim=64, index_dim=4, topk=2,
        dtype=torch.float64)
    _, lse = torch_msa.sparse_attention(q, k, v, block_indices, *docs, block_size=BLOCK, return_lse=True)
    assert lse.dtype == torch.float64

    def sparse(iq, ik):
        return torch_msa.indexer_kl_loss(q, k, lse, iq, ik, block_indices, *docs, block_size=BLOCK)

    def dense_with_perturbed_lse(iq, ik):
        return torch_msa.indexer_kl_loss_dense(q, k, iq, ik, *docs, lse=lse + 0.3, block_size=BLOCK)

    assert sparse(index_q, index_k).dtype == torch.float64
    assert torch.autograd.gradcheck(sparse, (index_q, index_k))
    assert torch.autograd.gradcheck(dense_with_perturbed_lse, (index_q, index_k))


def test_only_the_index_inputs_get_gradients():
    q, k, v, index_q, index_k, block_indices, docs = _problem(**CASE)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    _, lse = torch_msa.sparse_attention(q, k, v, block_indices, *docs, block_size=BLOCK, return_lse=True)
    torch_msa.indexer_kl_loss(q, k, lse, index_q, index_k, block_indices, *docs, block_size=BLOCK).backward()
    assert q.grad is None and k.grad is None and v.grad is None
    assert index_q.grad is not None and index_k.grad is not None


def test_nan_in_one_document_stays_there():
    q, k, v, index_q, index_k, block_indices, docs = _problem(**CASE)
    cu_q, cu_k = docs[0], docs[1]
    with torch.no_grad():
        index_q[: int(cu_q[1])] = math.nan  # document 0's index queries
    _, lse = torch_msa.sparse_attention(q, k, v, block_indices, *docs, block_size=BLOCK, return_lse=True)
    args = (block_indices, *docs, BLOCK, 64**-0.5, 16**-0.5)
    loss, _, index_lse, *teacher_terms = torch.ops.msa.indexer_kl(q, k, lse, index_q, index_k, *args)
    first_doc_queries, first_doc_keys = int(cu_q[1]), int(cu_k[1])
    assert loss.isnan() and index_lse[:first_doc_queries].isnan().all()
    assert not index_lse[first_doc_queries:].isnan().any()
    assert not teacher_terms[1][first_doc_queries:].isnan().any()
    assert not teacher_terms[2][first_doc_keys:].isnan().any()
    d_index_q, d_index_k = torch.ops.msa.indexer_kl_backward(torch.tensor(1.0), index_q, index_k, index_lse,
                                                             *teacher_terms, *args[:-2], args[-1])
    assert d_index_q[:first_doc_queries].isnan().any()
    assert not d_index_q[first_doc_queries:].isnan().any() and not d_index_k[first_doc_keys:].isnan().any()

    # The dense support multiplies whole spans of packed keys: NaN keys and index keys of document
    # 0 must not reach the others either.
    with torch.no_grad():
        k[:first_doc_keys] = math.nan
        index_k[:first_doc_keys] = math.nan
    dense_args = (None, *docs, BLOCK, 64**-0.5, 16**-0.5)
    loss, teacher_lse, index_lse, *teacher_terms = torch.ops.msa.indexer_kl(q, k, None, index_q, index_k, *dense_args)
    assert not index_lse[first_doc_queries:].isnan().any() and not teacher_lse[first_doc_queries:].isnan().any()
    assert not teacher_terms[1][first_doc_queries:].isnan().any()
    assert not teacher_terms[2][first_doc_keys:].isnan().any()
    d_index_q, d_index_k = torch.ops.msa.indexer_kl_backward(torch.tensor(1.0), index_q, index_k, index_lse,
                                                             *teacher_terms, *dense_args[:-2], dense_args[-1])
    assert not d_index_q[first_doc_queries:].isnan().any() and not d_index_k[first_doc_keys:].isnan().any()


def test_no_queries_gives_zero():
    q, k, v, index_q, index_k, block_indices, docs = _problem((0,), (9,), 4, 2, 64, 16, 2)
    loss = torch_msa.indexer_kl_loss(q, k, torch.zeros(0, 4), index_q, index_k, block_indices, *docs, block_size=BLOCK)
    assert loss.item() == 0.0


def test_bad_inputs_name_the_argument():
    q, k, v, index_q, index_k, block_indices, docs = _problem(**CASE)
    _, lse = torch_msa.sparse_attention(q, k, v, block_indices, *docs, block_size=BLOCK, return_lse=True)
    with pytest.raises(ValueError, match="lse: expected shape"):
        torch_msa.indexer_kl_loss(q, k, lse[:, :2], index_q, index_k, block_indices, *docs, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"index_q: expected \[Tq, Hi\]"):
        torch_msa.indexer_kl_loss(q, k, lse, index_q[:, :1], index_k, block_indices, *docs, block_size=BLOCK)
    with pytest.raises(ValueError, match="index_k: expected Tk"):
        torch_msa.indexer_kl_loss(q, k, lse, index_q, index_k[:-1], block_indices, *docs, block_size=BLOCK)
    with pytest.raises(TypeError, match="lse: expected dtype torch.float32"):
        torch_msa.indexer_kl_loss(q, k, lse.double(), index_q, index_k, block_indices, *docs, block_size=BLOCK)
    with pytest.raises(ValueError, match="index_softmax_scale: expected a finite float"):
        torch_msa.indexer_kl_loss(q, k, lse, index_q, index_k, block_indices, *docs, block_size=BLOCK,
                                  index_softmax_scale=math.inf)


def test_bad_backward_inputs_name_the_argument():
    q, k, v, index_q, index_k, block_indices, docs = _problem(**CASE)
    _, lse = torch_msa.sparse_attention(q, k, v, block_indices, *docs, block_size=BLOCK, return_lse=True)
    with torch.no_grad():
        _, _, *kept = torch.ops.msa.indexer_kl(q, k, lse, index_q, index_k, block_indices, *docs, BLOCK, 64**-0.5,
                                               16**-0.5)
    index_lse, mass, index_key_sums, index_query_sums = kept

    def backward(*kept, ids=block_indices):
        return torch.ops.msa.indexer_kl_backward(torch.tensor(1.0), index_q, index_k, *kept, ids, *docs, BLOCK,
                                                 16**-0.5)

    assert [g.shape for g in backward(*kept)] == [index_q.shape, index_k.shape]
    with pytest.raises(ValueError,
                       match=r"teacher_index_keys: expected shape \[138, 2, 16\] \(\[Tq, Hi, Di\] of index_q"):
        backward(index_lse, mass, index_key_sums[:, :1], index_query_sums)
    with pytest.raises(ValueError, match=r"teacher_index_queries: expected shape \[403, 1, 16\]"):
        backward(index_lse, mass, index_key_sums, index_query_sums[:-1])
    with pytest.raises(TypeError, match="teacher_index_queries: expected dtype torch.float32"):
        backward(index_lse, mass, index_key_sums, index_query_sums.double())
    with pytest.raises(ValueError, match="teacher_mass: expected a 2-D tensor"):
        backward(index_lse, mass[..., None], index_key_sums, index_query_sums)
    with pytest.raises(ValueError, match="block_indices: expected shape"):
        backward(*kept, ids=block_indices[:1])


def test_msa_attention_returns_what_the_loss_needs_and_warns_once(monkeypatch):
    q, k, v, index_q, index_k, _, docs = _problem(**CASE)
    monkeypatch.setattr(api, "_warned_untrained_index", False)
    with pytest.warns(UserWarning, match="indexer_kl_loss"):
        attn = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, return_lse=True,
                                       return_block_indices=True)
    out, lse, block_indices = attn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out_only = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK)
    assert torch.equal(out, out_only)
    assert torch.equal(block_indices, torch_msa.select_blocks(index_q, index_k, *docs, topk=2, block_size=BLOCK))
    _, expected_lse = torch_msa.sparse_attention(q, k, v, block_indices, *docs, block_size=BLOCK, return_lse=True)
    assert torch.equal(lse, expected_lse)
    only_ids = torch_msa.msa_attention(q, k, v, index_q.detach(), index_k.detach(), *docs, topk=2, block_size=BLOCK,
                                       return_block_indices=True)
    assert torch.equal(only_ids.block_indices, block_indices) and torch.equal(only_ids.out, out)
    only_lse = torch_msa.msa_attention(q, k, v, index_q.detach(), index_k.detach(), *docs, topk=2, block_size=BLOCK,
                                       return_lse=True)
    assert torch.equal(only_lse.lse, lse) and torch.equal(only_lse.out, out)


_FULL_RESULT = dict(return_lse=True, return_block_indices=True, index_loss=True)


# (flags, the result's type, its fields in order): every combination of msa_attention's flags.
_RESULTS = [
    (dict(return_lse=True), torch_msa.AttentionOutput, ("out", "lse")),
    (dict(return_block_indices=True), torch_msa.MSABlocksOutput, ("out", "block_indices")),
    (dict(return_lse=True, return_block_indices=True), torch_msa.MSALseBlocksOutput, ("out", "lse", "block_indices")),
    (dict(index_loss=True), torch_msa.MSAIndexLossOutput, ("out", "kl", "kl_value")),
    (dict(return_lse=True, index_loss=True), torch_msa.MSALseIndexLossOutput, ("out", "lse", "kl", "kl_value")),
    (dict(return_block_indices=True, index_loss=True), torch_msa.MSABlocksIndexLossOutput,
     ("out", "block_indices", "kl", "kl_value")),
    (_FULL_RESULT, torch_msa.MSAAttentionOutput, ("out", "lse", "block_indices", "kl", "kl_value")),
]


@pytest.mark.parametrize("flags, result_type, fields", _RESULTS, ids=[t.__name__ for _, t, _ in _RESULTS])
def test_msa_attention_returns_exactly_the_fields_asked_for_in_order(flags, result_type, fields):
    """`out`, then `lse`, `block_indices`, `kl` and `kl_value` as their flags ask: the result
    unpacks positionally into exactly those and reads them by name, with the full result's values."""
    q, k, v, index_q, index_k, _, docs = _problem(**CASE)
    index_q, index_k = index_q.detach(), index_k.detach()
    call = functools.partial(torch_msa.msa_attention, q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK)
    with torch.no_grad():  # the loss computed in the forward: kl and kl_value hold it at once
        result, full = call(**flags), call(**_FULL_RESULT)
    assert type(result) is result_type and result._fields == fields and len(result) == len(fields)
    assert isinstance(result, torch_msa.MSAResult)
    for name, value in zip(fields, result, strict=True):
        assert value is getattr(result, name)
        assert torch.equal(value, getattr(full, name)), name


def test_msa_attention_unpacks_as_flash_attention_does():
    q, k, v, index_q, index_k, _, docs = _problem(**CASE)
    index_q, index_k = index_q.detach(), index_k.detach()
    call = functools.partial(torch_msa.msa_attention, q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK)
    with torch.no_grad():
        plain = call()
        out, lse = call(return_lse=True)
        out_too, block_indices = call(return_block_indices=True)
        out_again, kl, kl_value = call(index_loss=True)
        *_, expected_kl, _ = call(**_FULL_RESULT)
    assert type(plain) is torch.Tensor and plain.shape == q.shape
    assert torch.equal(out, plain) and torch.equal(out_too, plain) and torch.equal(out_again, plain)
    _, expected_lse = torch_msa.sparse_attention(q, k, v, block_indices, *docs, block_size=BLOCK, return_lse=True)
    assert torch.equal(lse, expected_lse)
    assert torch.equal(block_indices, torch_msa.select_blocks(index_q, index_k, *docs, topk=2, block_size=BLOCK))
    assert kl.item() > 0 and torch.equal(kl, kl_value) and torch.equal(kl, expected_kl)


def test_msa_attention_index_loss_is_the_kl_of_its_own_selection_and_lse(monkeypatch):
    """In training the loss is computed by the backward (`msa::forward_with_index_loss`): `kl` is a
    placeholder of value 0, and `kl_value` holds the KL of the call's own selection and lse once the
    backward has run; the gradients are the separate loss's."""
    q, k, v, index_q, index_k, _, docs = _problem(**CASE)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    monkeypatch.setattr(api, "_warned_untrained_index", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the index inputs get a gradient: no warning
        attn = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, index_loss=True)
    assert type(attn) is torch_msa.MSAIndexLossOutput
    assert attn.kl.dim() == 0 and attn.kl.dtype == torch.float32 and attn.kl.item() == 0
    assert attn.kl_value.dim() == 0 and not attn.kl_value.requires_grad and attn.kl_value.item() == 0
    with torch.no_grad():
        full = torch_msa.msa_attention(q, k, v, index_q.detach(), index_k.detach(), *docs, topk=2, block_size=BLOCK,
                                       return_lse=True, return_block_indices=True)
    assert torch.equal(attn.out, full.out)
    expected = torch_msa.indexer_kl_loss(q, k, full.lse, index_q, index_k, full.block_indices, *docs, block_size=BLOCK)
    assert expected.item() > 0
    got = torch.autograd.grad(attn.kl, (index_q, index_k), retain_graph=True)
    assert torch.equal(attn.kl_value, expected)
    want = torch.autograd.grad(expected, (index_q, index_k))
    for a, b in zip(got, want):
        assert a.abs().sum() > 0 and torch.equal(a, b)

    # The teacher is detached: the KL adds nothing to q, k, v, and the task loss nothing to the index inputs.
    task = attn.out.square().mean()
    (task + 0.5 * attn.kl).backward()
    attention_grads = [x.grad.clone() for x in (q, k, v)]
    index_grads = [index_q.grad.clone(), index_k.grad.clone()]
    for x in (q, k, v, index_q, index_k):
        x.grad = None
    again = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, index_loss=True)
    again.out.square().mean().backward(retain_graph=True)
    assert index_q.grad is None and index_k.grad is None
    assert again.kl_value.item() == 0  # no gradient reached the loss term: its value was not computed
    for a, b in zip(attention_grads, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, b)
    for x in (q, k, v):
        x.grad = None
    (0.5 * again.kl).backward()
    assert q.grad is None and k.grad is None and v.grad is None
    assert torch.equal(again.kl_value, expected)
    for a, b in zip(index_grads, (index_q.grad, index_k.grad)):
        assert torch.equal(a, b)


def test_msa_attention_index_loss_under_torch_func_matches_the_fused_gradient():
    """torch.func takes the loss computed in the forward: its value and gradient are the fused
    node's, and a value sink it cannot serve is refused by name."""
    q, k, v, index_q, index_k, _, docs = _problem(**CASE)

    def kl(index_q, index_k):
        return torch_msa.msa_attention(q.detach(), k.detach(), v.detach(), index_q, index_k, *docs, topk=2,
                                       block_size=BLOCK, index_loss=True).kl

    leaves = [x.detach().clone().requires_grad_() for x in (index_q, index_k)]
    fused = torch_msa.msa_attention(q.detach(), k.detach(), v.detach(), *leaves, *docs, topk=2, block_size=BLOCK,
                                    index_loss=True)
    assert fused.kl.item() == 0  # the fused node's placeholder
    fused.kl.backward()
    grads, value = torch.func.grad_and_value(kl, argnums=(0, 1))(index_q.detach(), index_k.detach())
    torch.testing.assert_close(value, fused.kl_value, rtol=1e-6, atol=0)
    for got, want in zip(grads, (leaves[0].grad, leaves[1].grad), strict=True):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="index_loss_value: not served under torch.func"):
        torch.func.grad(lambda iq: torch_msa.msa_attention(
            q.detach(), k.detach(), v.detach(), iq, index_k.detach(), *docs, topk=2, block_size=BLOCK,
            index_loss=True, index_loss_value=torch.zeros((), dtype=value.dtype)).kl)(index_q.detach())


def test_msa_attention_index_loss_with_the_other_fields_and_without_queries():
    """Outside training (no grad) the loss is computed in the forward: `kl` and `kl_value` hold it
    at once, and a given `index_loss_value` receives it."""
    q, k, v, index_q, index_k, _, docs = _problem(**CASE)
    sink = torch.full((), -1.0)
    with torch.no_grad():
        attn = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, return_lse=True,
                                       return_block_indices=True, index_loss=True, index_loss_value=sink)
    expected = torch_msa.indexer_kl_loss(q, k, attn.lse, index_q, index_k, attn.block_indices, *docs, block_size=BLOCK)
    assert torch.equal(attn.kl, expected) and attn.kl_value is sink and torch.equal(sink, expected)
    with pytest.raises(ValueError, match="index_loss_value: given without index_loss=True"):
        torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, index_loss_value=sink)
    with pytest.raises(TypeError, match="index_loss_value"):
        torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, index_loss=True,
                                index_loss_value=1.0)
    with pytest.raises(TypeError, match="loss_value: expected dtype torch.float32"):
        torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, index_loss=True,
                                index_loss_value=torch.zeros((), dtype=torch.float64))
    with torch.no_grad(), pytest.raises(ValueError, match="index_loss_value: expected a 0-D tensor"):
        # Checked on the path that computes the loss in the forward too.
        torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, index_loss=True,
                                index_loss_value=torch.zeros(2))
    without_kl = torch_msa.msa_attention(q, k, v, index_q.detach(), index_k.detach(), *docs, topk=2, block_size=BLOCK,
                                         return_lse=True)
    assert "kl" not in without_kl._fields

    q, k, v, index_q, index_k, _, docs = _problem((0,), (9,), 4, 2, 64, 16, 2, dtype=torch.float64)
    empty = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, index_loss=True)
    assert empty.kl.item() == 0.0 and empty.kl.dtype == torch.float64


def test_msa_attention_index_loss_bad_input_names_the_argument():
    q, k, v, index_q, index_k, _, docs = _problem(**CASE)
    with pytest.raises(TypeError, match="index_loss: expected a bool, got str 'dense'"):
        torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, index_loss="dense")
    with pytest.raises(TypeError, match=r"index_q: expected a torch.Tensor \[Tq, Hi, Di\], got NoneType"):
        torch_msa.msa_attention(q, k, v, None, index_k, *docs, topk=2, block_size=BLOCK, index_loss=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'block_indices'"):  # its own selection only
        torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, index_loss=True,
                                block_indices=torch.zeros(2, q.shape[0], 2, dtype=torch.int32))


def test_compiled_select_attention_loss_and_backward_match_eager():
    q, k, v, index_q, index_k, _, docs = _problem(**CASE)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def step(q, k, v, index_q, index_k):
        attn = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=BLOCK, return_lse=True,
                                       return_block_indices=True)
        kl = torch_msa.indexer_kl_loss(q, k, attn.lse, index_q, index_k, attn.block_indices, *docs, block_size=BLOCK)
        return attn.out.square().mean() + kl

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    leaves = (q, k, v, index_q, index_k)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch.autograd.grad(step(*leaves), leaves)
        got = torch.autograd.grad(compiled(*leaves), leaves)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def _teacher_top_blocks(q, k, topk):
    """Per (KV head, query): the `topk - 1` non-local blocks with the largest summed teacher
    probability under full causal attention (one document), as a bool `[Hkv, T, nb]` mask."""
    num_queries, num_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    scores = torch.einsum("thd,jhd->htj", q.double(), k.double().repeat_interleave(group, 1)) * dim**-0.5
    causal = torch.ones(num_queries, num_queries, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, -math.inf).softmax(-1).view(num_kv_heads, group, num_queries, -1).mean(1)
    block_mass = probs.view(num_kv_heads, num_queries, -1, BLOCK).sum(-1)
    local = torch.arange(num_queries) // BLOCK
    block_mass = block_mass.masked_fill(torch.arange(block_mass.shape[-1]) >= local[:, None], -1)
    top = block_mass.topk(topk - 1, -1).indices
    return torch.zeros_like(block_mass, dtype=torch.bool).scatter_(-1, top, True)


def _overlap(block_indices, teacher_top, first_query):
    """Fraction of the teacher's top non-local blocks that the selection holds (queries that must choose)."""
    chosen = torch.zeros_like(teacher_top)
    ids = block_indices.long()
    chosen.scatter_(-1, ids.clamp(min=0), ids >= 0)
    hits = (chosen & teacher_top)[:, first_query:].sum()
    return (hits / teacher_top[:, first_query:].sum()).item()


def test_training_the_index_branch_lowers_the_loss_and_finds_the_teacher_blocks():
    """A tiny index branch (linear maps of fixed features) trained with the dense warm-up then the
    sparse loss learns to select the blocks the main attention puts its mass on."""
    tokens, topk, features, index_dim = 384, 3, 16, 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, features, generator=g)
    # The teacher: one head's attention between fixed projections of the same features.
    q = (x @ torch.randn(features, 64, generator=g)).view(tokens, 1, 64) * 0.6
    k = (x @ torch.randn(features, 64, generator=g)).view(tokens, 1, 64) * 0.6
    v = torch.randn(tokens, 1, 64, generator=g)
    project_q = torch.nn.Linear(features, index_dim, bias=False)
    project_k = torch.nn.Linear(features, index_dim, bias=False)
    with torch.no_grad():
        for weight in (project_q.weight, project_k.weight):
            weight.copy_(torch.randn(weight.shape, generator=g) * 0.1)
    optimizer = torch.optim.Adam([*project_q.parameters(), *project_k.parameters()], lr=0.1)

    def index_inputs():
        return project_q(x).view(tokens, 1, index_dim), project_k(x).view(tokens, 1, index_dim)

    teacher_top = _teacher_top_blocks(q, k, topk)
    first_query = topk * BLOCK  # queries with more candidate blocks than slots

    def overlap():
        with torch.no_grad():
            selected = torch_msa.select_blocks(*index_inputs(), topk=topk, block_size=BLOCK)
            return _overlap(selected, teacher_top, first_query)

    def dense_loss():
        return torch_msa.indexer_kl_loss_dense(q, k, *index_inputs(), block_size=BLOCK)

    def sparse_loss():
        index_q, index_k = index_inputs()
        attn = torch_msa.msa_attention(q, k, v, index_q.detach(), index_k.detach(), topk=topk, block_size=BLOCK,
                                       return_lse=True, return_block_indices=True)
        return torch_msa.indexer_kl_loss(q, k, attn.lse, index_q, index_k, attn.block_indices, block_size=BLOCK)

    overlap_before = overlap()
    dense_before, sparse_before = dense_loss().item(), sparse_loss().item()
    for stage_loss in (dense_loss,) * 16 + (sparse_loss,) * 8:
        optimizer.zero_grad()
        stage_loss().backward()
        optimizer.step()
    overlap_after = overlap()
    dense_after, sparse_after = dense_loss().item(), sparse_loss().item()
    assert dense_after < 0.3 * dense_before, (dense_before, dense_after)
    assert sparse_after < 0.3 * sparse_before, (sparse_before, sparse_after)
    assert overlap_after > max(0.75, overlap_before + 0.15), (overlap_before, overlap_after)


def test_kl_timing_rows_run_on_cpu():
    from benchmarks.kl import DENSE_ROWS, SPARSE_ROWS, measure_kl
    from torch_msa.contract import Shape

    shape = Shape(query_heads=4, kv_heads=2, head_dim=64, index_dim=16, block_size=BLOCK, topk=2)
    results = measure_kl(256, shape, "cpu", torch.float32, dense=True, warmup=0, iters=1)
    assert set(results) == {"attention step", "sparse KL fwd+bwd", "sparse KL fwd", "step with KL",
                            "step with KL, deterministic", "dense SDPA fwd+bwd", "dense KL fwd+bwd",
                            "dense KL fwd+bwd, lse given"} == set(SPARSE_ROWS + DENSE_ROWS)
    assert all(ms > 0 for ms in results.values())
    packed = measure_kl(256, shape, "cpu", torch.float32, warmup=0, iters=1, documents=2)
    assert set(packed) == set(SPARSE_ROWS)
    with pytest.raises(ValueError, match="multiple of documents"):
        measure_kl(256, shape, "cpu", torch.float32, documents=3)
