"""The reference forward/backward against a dense masked-softmax computation in float64."""

import pytest
import torch

import torch_msa
from tests.support import dense
from torch_msa.testing import cu_seqlens, random_block_indices

# (q_lens, k_lens): one document, a pack with empty and 1-token documents, shorter than a block,
# partial last blocks, and queries that are a strict suffix of their keys (Lq < Lk).
LAYOUTS = {
    "one_doc": ([300], None),
    "pack": ([70, 0, 200, 1, 129], None),
    "short": ([5, 17], None),
    "suffix": ([50, 0, 130, 3], [200, 10, 130, 260]),
}
CONFIGS = [
    # Hq, Hkv, D, block_size, topk
    (2, 2, 64, 64, 2),
    (4, 1, 64, 64, 3),
    (8, 2, 128, 128, 2),
    (6, 3, 64, 64, 1),
    (4, 2, 128, 64, 16),
]


def _inputs(layout, num_heads, num_kv_heads, dim, block_size, topk, dtype):
    q_lens, k_lens = LAYOUTS[layout]
    cu_q, cu_k = cu_seqlens(q_lens, k_lens)
    num_queries, num_keys = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(num_queries, num_heads, dim, dtype=dtype)
    k = torch.randn(num_keys, num_kv_heads, dim, dtype=dtype)
    v = torch.randn(num_keys, num_kv_heads, dim, dtype=dtype)
    block_indices = random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    return q, k, v, block_indices, cu_q, cu_k


def _compare(q, k, v, block_indices, cu_q, cu_k, block_size, atol, rtol, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = torch_msa.sparse_attention(*leaves, block_indices, cu_q, cu_k, block_size=block_size,
                                          softmax_scale=scale, return_lse=True)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    out_ref, lse_ref = dense.attention(*exact, block_indices, cu_q, cu_k, block_size, scale)
    grad_out = torch.randn_like(out_ref)
    grad_lse = torch.randn_like(lse_ref)
    # Both outputs feed the loss, so the lse gradient is checked too.
    ((out.double() * grad_out).sum() + (lse.double() * grad_lse).sum()).backward()
    ((out_ref * grad_out).sum() + (lse_ref * grad_lse).sum()).backward()
    torch.testing.assert_close(out.double(), out_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double(), lse_ref, atol=atol, rtol=rtol)
    for name, got, want in zip("qkv", leaves, exact):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "hq{}-hkv{}-d{}-bs{}-top{}".format(*c))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_dense_float64(layout, config):
    num_heads, num_kv_heads, dim, block_size, topk = config
    inputs = _inputs(layout, num_heads, num_kv_heads, dim, block_size, topk, torch.float64)
    _compare(*inputs, block_size, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_low_precision_inputs(dtype, tol):
    inputs = _inputs("pack", 8, 2, 64, 64, 3, dtype)
    _compare(*inputs, 64, atol=tol, rtol=tol)


def test_custom_scale():
    inputs = _inputs("pack", 4, 2, 64, 64, 2, torch.float64)
    _compare(*inputs, 64, atol=1e-10, rtol=1e-10, scale=0.3)


@pytest.mark.slow
def test_m3_topology_with_selection():
    """M3 heads and blocks (64/4/128, block 128, top-16) where selection bites (> 2048 keys)."""
    cu_q, cu_k = cu_seqlens([96, 32], [2300, 32])
    iq = torch.randn(128, 4, 128)
    ik = torch.randn(2332, 1, 128)
    block_indices = torch_msa.select_blocks(iq, ik, cu_q, cu_k, 96, 2300)
    assert (block_indices[:, :96] >= 0).sum(-1).eq(16).all()  # 18 visible blocks: 15 best + local
    q = torch.randn(128, 64, 128)
    k = torch.randn(2332, 4, 128)
    v = torch.randn(2332, 4, 128)
    _compare(q, k, v, block_indices, cu_q, cu_k, 128, atol=5e-5, rtol=5e-5)


def test_non_contiguous_inputs():
    """Strided views, as produced by projections and transposes, give the contiguous results."""
    q, k, v, block_indices, cu_q, cu_k = _inputs("pack", 4, 2, 64, 64, 3, torch.float64)
    strided = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v)]
    assert not any(x.is_contiguous() for x in strided)
    _compare(*strided, block_indices, cu_q, cu_k, 64, atol=1e-10, rtol=1e-10)


def test_empty_input():
    q = torch.randn(0, 4, 64, requires_grad=True)
    k = torch.randn(0, 2, 64, requires_grad=True)
    v = torch.randn(0, 2, 64, requires_grad=True)
    block_indices = torch.empty(2, 0, 16, dtype=torch.int32)
    out, lse = torch_msa.sparse_attention(q, k, v, block_indices, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_out_of_contract_ids_never_read_out_of_bounds():
    """Garbage ids (huge, negative, repeated, beyond the causal horizon) read nothing outside
    the tensors and are treated as a set: the result equals the dense oracle's set semantics."""
    cu_q, cu_k = cu_seqlens([100, 60], [100, 60])
    q = torch.randn(160, 4, 64, dtype=torch.float64)
    k = torch.randn(160, 2, 64, dtype=torch.float64)
    v = torch.randn(160, 2, 64, dtype=torch.float64)
    block_indices = torch.randint(-5, 4, (2, 160, 4), dtype=torch.int32)
    block_indices[:, ::7, 0] = 2**31 - 1
    block_indices[:, ::5, 1] = -(2**31)
    block_indices[:, :, 3] = block_indices[:, :, 2]  # repeats
    out, lse = torch_msa.sparse_attention(q, k, v, block_indices, cu_q, cu_k, block_size=64, return_lse=True)
    out_ref, lse_ref = dense.attention(q, k, v, block_indices, cu_q, cu_k, 64, 64**-0.5)
    empty = torch.isinf(lse_ref)
    assert empty.any() and (~empty).any()
    torch.testing.assert_close(out, out_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, lse_ref, atol=1e-10, rtol=1e-10)
    assert torch.isneginf(lse[empty]).all() and (out[empty.any(1)].isfinite()).all()


def test_gradcheck_float64():
    """torch.autograd.gradcheck through the public API, out and lse, two documents."""
    cu_q, cu_k = cu_seqlens([70, 40], [90, 40])
    q = torch.randn(110, 2, 64, dtype=torch.float64, requires_grad=True)
    k = torch.randn(130, 1, 64, dtype=torch.float64, requires_grad=True)
    v = torch.randn(130, 1, 64, dtype=torch.float64, requires_grad=True)
    block_indices = random_block_indices(cu_q, cu_k, 1, 2, 64)

    def fn(q, k, v):
        return torch_msa.sparse_attention(q, k, v, block_indices, cu_q, cu_k, block_size=64, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_msa_attention_composes_selection_and_attention():
    cu_q, cu_k = cu_seqlens([150, 90])
    q = torch.randn(240, 4, 64, requires_grad=True)
    k = torch.randn(240, 2, 64, requires_grad=True)
    v = torch.randn(240, 2, 64, requires_grad=True)
    iq = torch.randn(240, 2, 32, requires_grad=True)
    ik = torch.randn(240, 1, 32, requires_grad=True)
    out = torch_msa.msa_attention(q, k, v, iq, ik, cu_q, cu_k, 150, 150, topk=2, block_size=64)
    block_indices = torch_msa.select_blocks(iq, ik, cu_q, cu_k, 150, 150, topk=2, block_size=64)
    expected = torch_msa.sparse_attention(q, k, v, block_indices, cu_q, cu_k, 150, 150, block_size=64)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    assert iq.grad is None and ik.grad is None  # selection is not differentiable
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0


def test_chunking_does_not_change_results(monkeypatch):
    """Many tiny chunks and one big chunk give the same numbers."""
    from torch_msa import reference

    inputs = _inputs("pack", 4, 2, 64, 64, 3, torch.float64)
    full = torch_msa.sparse_attention(*inputs[:4], *inputs[4:], block_size=64, return_lse=True)
    monkeypatch.setattr(reference, "_CHUNK_BYTES_CPU", 1)
    tiny = torch_msa.sparse_attention(*inputs[:4], *inputs[4:], block_size=64, return_lse=True)
    for a, b in zip(full, tiny):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_gradient_through_lse_alone():
    """A loss on lse only (out unused) still gets its gradient: grad_out arrives as None."""
    q, k, v, block_indices, cu_q, cu_k = _inputs("pack", 4, 2, 64, 64, 3, torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    _, lse = torch_msa.sparse_attention(*leaves, block_indices, cu_q, cu_k, block_size=64, return_lse=True)
    lse.sum().backward()
    exact = [x.clone().requires_grad_() for x in (q, k, v)]
    dense.attention(*exact, block_indices, cu_q, cu_k, 64, 64**-0.5)[1].sum().backward()
    for got, want in zip(leaves[:2], exact[:2]):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-10, rtol=1e-10)
    assert exact[2].grad is None and not leaves[2].grad.any()  # lse does not depend on v


@pytest.mark.parametrize("seed", range(12))
def test_random_configurations(seed):
    """Random head layouts, block sizes, topk and packs (empty, 1-token, suffix documents)."""
    generator = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=generator))]

    num_kv_heads, group = pick([1, 2, 3]), pick([1, 2, 4])
    dim, block_size, topk = pick([64, 128]), pick([64, 128]), pick([1, 2, 3, 5])
    num_docs = int(torch.randint(1, 5, (1,), generator=generator))
    k_lens = torch.randint(0, 330, (num_docs,), generator=generator).tolist()
    q_lens = [int(torch.randint(0, n + 1, (1,), generator=generator)) if pick([True, False]) else n for n in k_lens]
    cu_q, cu_k = cu_seqlens(q_lens, k_lens)
    tq, tk = sum(q_lens), sum(k_lens)
    q = torch.randn(tq, num_kv_heads * group, dim, dtype=torch.float64, generator=generator)
    k = torch.randn(tk, num_kv_heads, dim, dtype=torch.float64, generator=generator)
    v = torch.randn(tk, num_kv_heads, dim, dtype=torch.float64, generator=generator)
    if pick([True, False]):
        index_q = torch.randn(tq, num_kv_heads, 16, generator=generator)
        index_k = torch.randn(tk, 1, 16, generator=generator)
        block_indices = torch_msa.select_blocks(index_q, index_k, cu_q, cu_k, topk=topk, block_size=block_size)
        dense.check_selection(block_indices, index_q, index_k, cu_q, cu_k, topk, block_size)
    else:
        block_indices = random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size, generator=generator)
    _compare(q, k, v, block_indices, cu_q, cu_k, block_size, atol=1e-10, rtol=1e-10)
