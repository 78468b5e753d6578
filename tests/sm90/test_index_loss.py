"""The index branch's KL loss fused into the SM90 backward, on a compute capability 9.0 GPU.

The backward kernel's teacher (`emit_teacher`) against the reference's, and the fused training
step (`msa_attention(..., index_loss=True)`: `msa::forward_with_index_loss`, whose backward
writes the teacher in the attention backward and forms the loss from it) against the separate
ops, at M3 shapes: one document, a pack with empty and one-token documents, Lq < Lk, query
fragments; bitwise repeats in deterministic mode, CUDA-graph replay and `torch.compile`, and NaN
in one document. Skipped without such a GPU or the CuTe DSL.
"""

import pytest
import torch

import torch_msa
from tests.support.determinism import deterministic_algorithms
from tests.support.documents import Documents, backend_arguments
from tests.support.sm90 import BLOCK, HKV, REFERENCE_LAYOUTS, SCALE, SM90_KERNEL_MARKS, TOPK, random_problem
from torch_msa import reference, reference_index_loss
from torch_msa.testing import fragments

pytestmark = SM90_KERNEL_MARKS
INDEX_DIM = 128


def _attention(q_lens, k_lens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = random_problem(q_lens, k_lens, torch.bfloat16, generator=generator)
    documents = Documents(cu_q, cu_k, max_q, max_k)
    out, lse = reference.forward(q.float(), k.float(), v.float(), blocks, documents, BLOCK, SCALE)
    grad_out = torch.randn(q.shape, generator=generator).to("cuda", q.dtype)
    return (grad_out, q, k, v, out.to(q.dtype), lse, blocks, cu_q, cu_k, max_q, max_k), documents


@REFERENCE_LAYOUTS
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_backward_kernel_writes_the_reference_teacher(q_lens, k_lens, deterministic):
    from torch_msa.sm90 import backward_deterministic, backward_host

    args, documents = _attention(q_lens, k_lens)
    grad_out, q, k, v, out, lse, blocks = args[:7]
    host = backward_deterministic if deterministic else backward_host
    teacher = backward_host.new_teacher(q.shape[0], HKV, TOPK, q.device)
    with_teacher = host.backward(*backend_arguments("backward", *args, BLOCK, SCALE), teacher=teacher)
    want = reference_index_loss.teacher_probabilities(q.float(), k.float(), lse, blocks, documents, BLOCK, SCALE)
    assert teacher.dtype == torch.float16 and teacher.shape == want.shape
    # fp16 keeps probabilities to 2^-11 relative; P comes from bf16 q and k as in the backward.
    assert (teacher.float() - want).abs().max() < 2e-3
    assert (teacher.float() - want).norm() / want.norm() < 1e-2
    if deterministic:  # the teacher costs the gradients nothing: the same bits as without it
        without = host.backward(*backend_arguments("backward", *args, BLOCK, SCALE))
        for got, expected in zip(with_teacher, without):
            assert torch.equal(got, expected)


def _index_inputs(num_queries, num_keys, seed=1):
    generator = torch.Generator().manual_seed(seed)
    index_q = torch.randn(num_queries, HKV, INDEX_DIM, generator=generator).to("cuda", torch.bfloat16)
    index_k = torch.randn(num_keys, 1, INDEX_DIM, generator=generator).to("cuda", torch.bfloat16)
    return index_q.requires_grad_(), index_k.requires_grad_()


def _step(inputs, docs, fused, fragment_kwargs=None, index_loss_value=None):
    """One training step: `(loss value, grads of q, k, v, index_q, index_k)`; `fused`: through
    `msa_attention(index_loss=True)`, else the attention and `indexer_kl_loss` apart."""
    q, k, v, index_q, index_k = inputs
    for x in inputs:
        x.grad = None
    fragment_kwargs = fragment_kwargs or {}
    if fused:
        result = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, index_loss=True,
                                         index_loss_value=index_loss_value, **fragment_kwargs)
        assert result.kl.item() == 0  # the placeholder: the backward computes the loss
        (result.out.float().square().mean() + 0.3 * result.kl).backward()
        value = result.kl_value
    else:
        result = torch_msa.msa_attention(q, k, v, index_q.detach(), index_k.detach(), *docs, return_lse=True,
                                         return_block_indices=True, **fragment_kwargs)
        kl = torch_msa.indexer_kl_loss(q.detach(), k.detach(), result.lse.detach(), index_q, index_k,
                                       result.block_indices, *docs, **fragment_kwargs)
        (result.out.float().square().mean() + 0.3 * kl).backward()
        value = kl.detach()
    return value.clone(), [x.grad.clone() for x in inputs]


def _leaves(q_lens, k_lens, seed=0):
    q, k, v, _, cu_q, cu_k, max_q, max_k = random_problem(q_lens, k_lens, torch.bfloat16, seed=seed)
    return [x.requires_grad_() for x in (q, k, v, *_index_inputs(q.shape[0], k.shape[0]))], (cu_q, cu_k, max_q, max_k)


def _close(got, want):
    value, grads = got
    want_value, want_grads = want
    assert torch.isfinite(value) and abs(value.item() - want_value.item()) <= 5e-3 * abs(want_value.item()) + 1e-6
    for name, g, w in zip(("dq", "dk", "dv", "d index_q", "d index_k"), grads, want_grads):
        assert torch.isfinite(g).all(), name
        error = (g.float() - w.float()).norm() / w.float().norm().clamp(min=1e-12)
        assert error < 2e-2, f"{name}: relative error {error:.2e}"


@REFERENCE_LAYOUTS
def test_fused_step_matches_the_separate_ops(q_lens, k_lens):
    inputs, docs = _leaves(q_lens, k_lens)
    _close(_step(inputs, docs, fused=True), _step(inputs, docs, fused=False))


def test_fused_step_on_query_fragments():
    frag = fragments((1500, 0, 1, 700), ((3, 0, 300), (0, 200, 1500), (2, 0, 1), (0, 0, 200), (3, 300, 700)), "cuda")
    num_queries, num_keys = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(num_queries, 64, 128, generator=generator).to("cuda", torch.bfloat16)
    k, v = (torch.randn(num_keys, HKV, 128, generator=generator).to("cuda", torch.bfloat16) for _ in range(2))
    inputs = [x.requires_grad_() for x in (q, k, v, *_index_inputs(num_queries, num_keys))]
    kwargs = {"fragment_documents": frag.tensors[0], "fragment_starts": frag.tensors[1]}
    docs = frag.op_args
    _close(_step(inputs, docs, True, kwargs), _step(inputs, docs, False, kwargs))


def test_deterministic_fused_step_repeats_bitwise():
    inputs, docs = _leaves([3000, 1, 900], [3000, 1, 900])
    with deterministic_algorithms():
        first, second = _step(inputs, docs, fused=True), _step(inputs, docs, fused=True)
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)
    _close(first, _step(inputs, docs, fused=False))


def test_a_nan_document_leaves_the_others_index_gradients_alone():
    q_lens = [700, 1200]
    inputs, docs = _leaves(q_lens, q_lens)
    _, clean = _step(inputs, docs, fused=True)
    with torch.no_grad():
        inputs[0][:700, 5] = float("nan")  # a query head of document 0
    _, poisoned = _step(inputs, docs, fused=True)
    for name, position, rows in (("index_q", 3, slice(700, None)), ("index_k", 4, slice(700, None))):
        got, want = poisoned[position][rows], clean[position][rows]
        assert torch.isfinite(got).all(), name
        assert (got.float() - want.float()).norm() / want.float().norm() < 2e-2, name


def test_loss_value_after_a_cuda_graph_replay_and_a_compiled_step():
    inputs, docs = _leaves([2048], [2048])
    want, _ = _step(inputs, docs, fused=True)
    sink = torch.zeros((), device="cuda")

    def step():
        result = torch_msa.msa_attention(*inputs, *docs, index_loss=True, index_loss_value=sink)
        (result.out.float().square().mean() + 0.3 * result.kl).backward()
        return result.kl.detach()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles the kernels and fills the caches outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for x in inputs:
        x.grad = None
    with torch.cuda.graph(graph):
        step()
    sink.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert abs(sink.item() - want.item()) <= 5e-3 * want.item()

    sink.zero_()
    compiled = torch.compile(step, fullgraph=False)
    placeholder = compiled()
    assert placeholder.item() == 0  # the fused node: the value comes from the backward only
    assert abs(sink.item() - want.item()) <= 5e-3 * want.item()


def test_selection_kept_identical_so_fused_and_separate_see_one_support():
    """The fused node reads the selection `msa_attention` made: its KL equals `indexer_kl_loss` on
    that selection (a check that the fused path was taken: the separate path computes it in the
    forward, the fused one returns 0 there)."""
    inputs, docs = _leaves([1024], [1024])
    result = torch_msa.msa_attention(*inputs, *docs, index_loss=True, return_block_indices=True, return_lse=True)
    result.kl.backward()
    separate = torch_msa.indexer_kl_loss(inputs[0].detach(), inputs[1].detach(), result.lse.detach(), inputs[3],
                                         inputs[4], result.block_indices, *docs)
    assert result.kl.item() == 0
    assert abs(result.kl_value.item() - separate.item()) <= 5e-3 * separate.item()
