"""The Triton KL kernels at M3 shapes against the reference. Skipped without CUDA; run on the H200.

M3: Hq = 64, Hkv = 4, D = 128, index heads 4 x 128, block 128, topk 16, bf16 inputs. The loss is
compared relatively (both sides accumulate in fp32); the gradients by relative Frobenius error,
about 1e-3 for bf16 rounding and O(1) for any wrong row, so 1e-2 separates the two.
"""

import warnings

import pytest
import torch

import torch_msa
from tests.support.documents import backend_arguments
from torch_msa import reference_kl
from torch_msa.testing import cu_seqlens, random_block_indices, skewed_block_indices

pytestmark = pytest.mark.cuda

HEADS, KV_HEADS, DIM, INDEX_DIM, BLOCK, TOPK = 64, 4, 128, 128, 128, 16
LAYOUTS = {
    "4K": ([4096], [4096]),
    "pack": ([1000, 3000, 77, 1, 0, 2178], [1000, 3000, 77, 1, 0, 2178]),
    "suffix-pack": ([700, 129, 2000], [2600, 129, 2000]),
}


def _problem(layout, selection, seed=0):
    q_lens, k_lens = LAYOUTS[layout]
    cu_q, cu_k = cu_seqlens(q_lens, k_lens, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])

    def tensor(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    q, k, v = tensor(tq, HEADS, DIM), tensor(tk, KV_HEADS, DIM), tensor(tk, KV_HEADS, DIM)
    index_q, index_k = tensor(tq, KV_HEADS, INDEX_DIM), tensor(tk, 1, INDEX_DIM)
    docs = (cu_q, cu_k, max(q_lens), max(k_lens))
    if selection == "index":
        block_indices = torch.ops.msa.select_blocks(index_q, index_k, *docs, TOPK, BLOCK)
    elif selection == "skewed":
        block_indices = skewed_block_indices(cu_q, cu_k, KV_HEADS, TOPK, BLOCK)
    else:
        block_indices = random_block_indices(cu_q, cu_k, KV_HEADS, TOPK, BLOCK).cuda()
    _, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, BLOCK, DIM**-0.5)
    return (q, k, lse, index_q, index_k, block_indices, *docs, BLOCK, DIM**-0.5, INDEX_DIM**-0.5)


def _relative_error(got, want):
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


def test_triton_serves_the_sparse_loss_on_cuda():
    device = torch.device("cuda")
    assert torch_msa.resolve("indexer_kl", device).name == "triton"
    assert torch_msa.resolve("indexer_kl_backward", device).name == "triton"


@pytest.mark.parametrize("selection", ["index", "random", "skewed"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_m3_sparse_loss_and_gradients_match_reference(layout, selection):
    from torch_msa.triton import kl_kernel

    args = _problem(layout, selection)
    got = kl_kernel.indexer_kl(*backend_arguments("indexer_kl", *args))
    want = reference_kl.indexer_kl(*backend_arguments("indexer_kl", *args))
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=1e-5)
    assert torch.equal(got[1], want[1])
    names = ("index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    for name, a, b in zip(names, got[2:], want[2:]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        assert _relative_error(a.nan_to_num(neginf=0), b.nan_to_num(neginf=0)) < 1e-3, name

    q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, max_q, max_k, block_size, _, index_scale = args
    backward_args = (torch.tensor(1.0, device="cuda"), index_q, index_k, *want[2:], block_indices, cu_q, cu_k,
                     max_q, max_k, block_size, index_scale)
    for name, a, b in zip(("d index_q", "d index_k"), kl_kernel.indexer_kl_backward(*backend_arguments("indexer_kl_backward",
                                                                                                       *backward_args)),
                          reference_kl.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *backward_args))):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _relative_error(a, b) < 1e-2, (name, _relative_error(a, b))


def test_deterministic_mode_declines_to_the_reference():
    """Both Triton KL kernels add with atomics (the forward's teacher terms too): under
    deterministic algorithms the registry runs the reference, and twice gives equal bits."""
    from torch_msa.triton import kl_kernel

    args = _problem("suffix-pack", "random")
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(torch_msa.UnsupportedInputs, match="deterministic"):
            kl_kernel.indexer_kl(*backend_arguments("indexer_kl", *args))
        index_q = args[3].clone().requires_grad_()
        grads = []
        for _ in range(2):
            loss = torch_msa.indexer_kl_loss(*args[:3], index_q, *args[4:10], block_size=BLOCK)
            grads.append(torch.autograd.grad(loss, index_q)[0])
        assert torch.equal(grads[0], grads[1])
    finally:
        torch.use_deterministic_algorithms(deterministic)


def test_training_step_through_the_public_api():
    q, k, _, index_q, index_k, _, cu_q, cu_k, max_q, max_k, *_ = _problem("pack", "random")
    q, k, v = q.requires_grad_(), k.requires_grad_(), torch.randn_like(k).requires_grad_()
    index_q, index_k = index_q.requires_grad_(), index_k.requires_grad_()
    docs = (cu_q, cu_k, max_q, max_k)
    attn = torch_msa.msa_attention(q, k, v, index_q.detach(), index_k.detach(), *docs, return_lse=True,
                                   return_block_indices=True)
    lse, block_indices = attn.lse, attn.block_indices
    kl = torch_msa.indexer_kl_loss(q, k, lse, index_q, index_k, block_indices, *docs)
    (attn.out.float().square().mean() + kl).backward()
    assert kl.dtype == torch.float32 and torch.isfinite(kl) and kl > 0
    for x in (q, k, v, index_q, index_k):
        assert x.grad is not None and torch.isfinite(x.grad).all()
    want = reference_kl.indexer_kl(*backend_arguments(
        "indexer_kl", q.detach(), k.detach(), lse.detach(), index_q.detach(), index_k.detach(), block_indices, *docs,
        BLOCK, DIM**-0.5, INDEX_DIM**-0.5))[0]
    torch.testing.assert_close(kl.detach(), want, rtol=2e-3, atol=1e-5)


def test_dense_warm_up_is_served_by_the_triton_kernels():
    q, k, _, index_q, index_k, _, cu_q, cu_k, max_q, max_k, *_ = _problem("suffix-pack", "random")
    docs = (cu_q, cu_k, max_q, max_k)
    index_q, index_k = index_q.requires_grad_(), index_k.requires_grad_()
    assert torch_msa.resolve("indexer_kl", q.device).name == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the reference would warn
        loss = torch_msa.indexer_kl_loss_dense(q, k, index_q, index_k, *docs)
        loss.backward()
    want = reference_kl.indexer_kl(*backend_arguments("indexer_kl", q, k, None, index_q.detach(), index_k.detach(), None,
                                                      *docs, BLOCK, DIM**-0.5, INDEX_DIM**-0.5))[0]
    torch.testing.assert_close(loss.detach(), want, rtol=2e-3, atol=1e-5)
    assert torch.isfinite(index_q.grad).all() and torch.isfinite(index_k.grad).all()
