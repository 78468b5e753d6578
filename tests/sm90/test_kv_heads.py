"""The SM90 kernels at 16 query heads per KV head with 1 and 2 KV heads (a small model's shapes).

Forward and backward against the reference, and the training step with the fused index loss
(`msa_attention(..., index_loss=True)`, served by the sm90 backward with no fallback) against the
same step on the reference backend, on a pack with empty and one-token documents past the dense
prefix. Skipped without a compute capability 9.0 GPU or the CuTe DSL.
"""

import warnings

import pytest
import torch

import torch_msa
from tests.support.documents import Documents, backend_arguments
from tests.support.sm90 import BLOCK, SCALE, SM90_KERNEL_MARKS, random_problem

pytestmark = SM90_KERNEL_MARKS
LENGTHS = [3000, 0, 1, 2200, 129]
KV_HEADS = pytest.mark.parametrize("kv_heads", [1, 2])


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-6))


@KV_HEADS
def test_forward_and_backward_match_reference(kv_heads):
    from torch_msa import reference
    from torch_msa.sm90.backward_host import backward
    from torch_msa.sm90.forward_host import forward

    generator = torch.Generator().manual_seed(kv_heads)
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = random_problem(LENGTHS, LENGTHS, torch.bfloat16, generator=generator,
                                                                kv_heads=kv_heads)
    assert q.shape[1] == 16 * kv_heads
    documents = Documents(cu_q, cu_k, max_q, max_k)
    out, lse = forward(*backend_arguments("forward", q, k, v, blocks, cu_q, cu_k, max_q, max_k, BLOCK, SCALE))
    want_out, want_lse = reference.forward(q.float(), k.float(), v.float(), blocks, documents, BLOCK, SCALE)
    assert _relative(out, want_out) < 1e-2
    torch.testing.assert_close(lse, want_lse.float(), atol=2e-3, rtol=1e-4)

    grad_out = torch.randn(q.shape, generator=generator).to("cuda", q.dtype)
    args = (grad_out, q, k, v, want_out.to(q.dtype), want_lse, blocks, cu_q, cu_k, max_q, max_k)
    grads = backward(*backend_arguments("backward", *args, BLOCK, SCALE, None, None))
    want = reference.backward(*backend_arguments("backward", grad_out.float(), q.float(), k.float(), v.float(),
                                                 want_out, want_lse, blocks, cu_q, cu_k, max_q, max_k, BLOCK, SCALE,
                                                 None, None))
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert _relative(g, w) < 2e-2, name


def _fused_step(leaves, docs):
    q, k, v, index_q, index_k = leaves
    result = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, index_loss=True)
    (result.out.float().square().mean() + 0.5 * result.kl).backward()
    return result.kl_value.clone(), [x.grad.clone() for x in leaves]


@KV_HEADS
def test_fused_index_loss_step_matches_reference(kv_heads, monkeypatch):
    generator = torch.Generator().manual_seed(10 + kv_heads)
    q, k, v, _, cu_q, cu_k, max_q, max_k = random_problem(LENGTHS, LENGTHS, torch.bfloat16, generator=generator,
                                                          kv_heads=kv_heads)
    index_q = torch.randn(q.shape[0], kv_heads, 128, generator=generator).to("cuda", torch.bfloat16)
    index_k = torch.randn(k.shape[0], 1, 128, generator=generator).to("cuda", torch.bfloat16)
    docs = (cu_q, cu_k, max_q, max_k)
    assert torch_msa.resolve("backward_with_index_loss", q.device).name == "sm90"
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, index_q, index_k)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch_msa.TorchMSAWarning)  # a fallback would warn
        value, grads = _fused_step(leaves, docs)

    monkeypatch.setenv("TORCH_MSA_BACKEND", "reference")
    reference_leaves = [x.detach().float().requires_grad_() for x in (q, k, v, index_q, index_k)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch_msa.TorchMSAWarning)  # the reference on CUDA warns it is slow
        want_value, want_grads = _fused_step(reference_leaves, docs)
    assert abs(value.item() - want_value.item()) <= 5e-3 * abs(want_value.item()) + 1e-6
    for name, g, w in zip(("dq", "dk", "dv", "d index_q", "d index_k"), grads, want_grads):
        assert _relative(g, w) < 2e-2, name
