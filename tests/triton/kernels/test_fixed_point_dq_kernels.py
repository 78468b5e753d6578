"""The stages of a dQ added in fixed point: each row's scale against a plain-torch oracle of its
bound (every document's own keys, fragments, poison in one document), the bound against the
reference's dQ, and the final cast.

Where and how they run: `tests/support/triton_kernels.py`.
"""

import pytest
import torch

from tests.support.documents import Documents, documents_of
from tests.support.triton_kernels import DEVICE, layout, require_a_device
from torch_msa import reference, testing
from torch_msa.documents import locate_queries
from torch_msa.stages.dq import ungroup_dq
from torch_msa.stages.fixed_point_dq import MAX_EXPONENT, bound_bits, dq_scales, share_cap

require_a_device()

HQ, HKV, D, BLOCK, TOPK = 4, 2, 32, 16, 4
SCALE = D**-0.5


def _problem(q_lens, k_lens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    cu_q, cu_k, tq, tk, max_q, max_k = layout(q_lens, k_lens)
    q = torch.randn(tq, HQ, D, generator=generator).to(DEVICE)
    k, v = (torch.randn(tk, HKV, D, generator=generator).to(DEVICE) for _ in range(2))
    grad_out = torch.randn(tq, HQ, D, generator=generator).to(DEVICE)
    delta = torch.randn(tq, HQ, generator=generator).to(DEVICE)
    return q, k, v, grad_out, delta, Documents(cu_q, cu_k, max_q, max_k)


def _finite_norm(x):
    x = torch.where(x.isfinite(), x, 0).double()
    return x.norm(dim=-1)


def _oracle_bound(grad_out, delta, k, v, documents):
    """fp64 `[Tq, Hq]`: `2 (||dO|| max ||V|| + |delta|) max |K|` over the finite values of each row's
    document (0 for a row no document covers)."""
    num_queries = grad_out.shape[0]
    located = locate_queries(documents.cu_seqlens_q.cpu(), documents.cu_seqlens_k.cpu(), num_queries, k.shape[0],
                             *(None if x is None else x.cpu() for x in documents.fragments))
    cu_k = documents.cu_seqlens_k.tolist()
    key_doc = {}
    for doc in range(len(cu_k) - 1):
        rows = slice(cu_k[doc], cu_k[doc + 1])
        keys = k[rows].cpu().double()
        key_max = torch.where(keys.isfinite(), keys.abs(), 0).amax(dim=(0, 2)) if keys.numel() else torch.zeros(HKV)
        value_norm = _finite_norm(v[rows].cpu()).amax(dim=0) if keys.numel() else torch.zeros(HKV)
        key_doc[cu_k[doc]] = (key_max, value_norm)
    bound = torch.zeros(num_queries, HQ, dtype=torch.float64)
    norms = _finite_norm(grad_out.cpu())
    heads_per_kv = HQ // HKV
    for token in range(num_queries):
        if int(located.position[token]) < 0:
            continue
        key_max, value_norm = key_doc[int(located.key_start[token])]
        for head in range(HQ):
            kv = head // heads_per_kv
            bound[token, head] = 2 * (norms[token, head] * value_norm[kv] + abs(float(delta[token, head]))) * key_max[kv]
    return bound


def _check_scales(scales, bound, topk=TOPK):
    """Each scale is a power of two that puts its row's bound in `[2**(bits - 1), 2**bits)` (fp32's
    rounding of the bound aside); the largest for a bound too small, and for one past fp32's range
    `2**(bits - 129)`, under which every finite share fits."""
    bits = bound_bits(topk)
    scales = scales.cpu().double()
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all(), "a scale is not a power of two"
    assert ((scales >= 2.0**-MAX_EXPONENT) & (scales <= 2.0**MAX_EXPONENT)).all()
    scaled = bound * scales
    tiny = bound * 2.0**MAX_EXPONENT < 2.0 ** (bits - 1)
    huge = bound > torch.finfo(torch.float32).max
    assert torch.equal(scales[tiny], torch.full_like(scales[tiny], 2.0**MAX_EXPONENT))
    assert torch.equal(scales[huge], torch.full_like(scales[huge], 2.0 ** (bits - 129)))
    usual = ~tiny & ~huge
    assert usual.sum() > 0
    assert (scaled[usual] < 2.0**bits * (1 + 1e-6)).all()
    assert (scaled[usual] >= 2.0 ** (bits - 1) * (1 - 1e-6)).all()


def test_row_scales_follow_each_documents_own_bound():
    """A pack with an empty, a one-token and an `Lq < Lk` document."""
    q, k, v, grad_out, delta, documents = _problem([40, 0, 1, 30], [70, 5, 1, 90])
    scales = dq_scales(grad_out, delta, k, v, documents, TOPK, (DEVICE, torch.float32, "scales"))
    assert scales.shape == delta.shape and scales.dtype == torch.float32
    _check_scales(scales, _oracle_bound(grad_out, delta, k, v, documents))


def test_row_scales_of_fragments_read_their_documents_keys():
    frag = testing.fragments((50, 30, 1), ((0, 10, 20), (1, 0, 30), (0, 30, 20), (2, 0, 1)), DEVICE)
    generator = torch.Generator().manual_seed(3)
    tq, tk = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
    k, v = (torch.randn(tk, HKV, D, generator=generator).to(DEVICE) for _ in range(2))
    k[50:80] *= 64  # the second document's keys stand out
    grad_out = torch.randn(tq, HQ, D, generator=generator).to(DEVICE)
    delta = torch.randn(tq, HQ, generator=generator).to(DEVICE)
    documents = documents_of(frag.cu_seqlens_q, frag.cu_seqlens_k, *frag.tensors)
    scales = dq_scales(grad_out, delta, k, v, documents, TOPK, (DEVICE, torch.float32, "fragments"))
    _check_scales(scales, _oracle_bound(grad_out, delta, k, v, documents))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e30])
def test_one_documents_keys_move_no_other_documents_scales(poison):
    """Non-finite keys are left out of their own document's bound too: the rows that see them get
    non-finite shares, which the kernel marks; the rows before them keep a useful scale."""
    q, k, v, grad_out, delta, documents = _problem([60, 50, 40], [60, 50, 40], seed=1)
    key = (DEVICE, torch.float32, "poison")
    clean = dq_scales(grad_out, delta, k, v, documents, TOPK, key)
    k[80:90], v[85:95] = poison, poison
    poisoned = dq_scales(grad_out, delta, k, v, documents, TOPK, key)
    others = torch.cat([torch.arange(0, 60), torch.arange(110, 150)]).to(DEVICE)
    assert torch.equal(poisoned[others], clean[others])
    _check_scales(poisoned, _oracle_bound(grad_out, delta, k, v, documents))


def test_rows_with_a_non_finite_bound_take_a_scale_every_finite_share_fits():
    q, k, v, grad_out, delta, documents = _problem([20], [20], seed=2)
    delta[3, 1] = float("nan")
    grad_out[5, 2, 0] = float("inf")  # left out of the norm: the shares carry it
    delta[7, 0] = 3e38
    scales = dq_scales(grad_out, delta, k, v, documents, TOPK, (DEVICE, torch.float32, "rows"))
    smallest = 2.0 ** (bound_bits(TOPK) - 129)
    assert float(scales[3, 1]) == float(scales[7, 0]) == smallest
    assert float(scales[5, 2]) > smallest
    assert torch.finfo(torch.float32).max * smallest < share_cap(TOPK)


def test_the_bound_covers_the_references_dq():
    """Each row's scaled `|dQ| / softmax_scale`, the sum of its shares, stays below half the
    scaled bound, so that `topk` shares rounded to integers cannot pass `share_cap`."""
    q_lens = [100, 37]
    q, k, v, grad_out, _, documents = _problem(q_lens, q_lens, seed=4)
    block_indices = testing.random_block_indices(documents.cu_seqlens_q, documents.cu_seqlens_k, HKV, TOPK, BLOCK)
    out, lse = reference.forward(q, k, v, block_indices, documents, BLOCK, SCALE)
    delta = (grad_out * out).sum(-1)
    dq, _, _ = reference.backward(grad_out, q, k, v, out, lse, block_indices, documents, BLOCK, SCALE)
    scales = dq_scales(grad_out, delta, k, v, documents, TOPK, (DEVICE, torch.float32, "covers"))
    scaled = (dq / SCALE).abs().amax(dim=-1) * scales
    assert (scaled <= 2.0 ** (bound_bits(TOPK) - 1)).all()
    assert (scaled > 2.0 ** (bound_bits(TOPK) - 12)).any(), "the bound is needlessly loose"
    assert TOPK * 2.0 ** bound_bits(TOPK) <= 2.0**30 and share_cap(TOPK) == 2.0**30 / TOPK


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_fixed_point_cast_divides_each_rows_scale_out(dtype):
    """Grouped int32 sums `[D / 8, 16, 8]` per 16-head block, each row's power-of-two scale divided
    out exactly; a marked row (NaN scale) comes out NaN."""
    num_queries, num_heads, dim, block_heads, width = 3, 32, 128, 16, 8
    generator = torch.Generator().manual_seed(5)
    natural = torch.randint(-(2**26), 2**26, (num_queries, num_heads, dim), generator=generator, dtype=torch.int32)
    exponents = torch.randint(-40, 40, (num_queries, num_heads), generator=generator)
    scales = torch.ldexp(torch.ones(num_queries, num_heads), exponents).float()
    scales[1, 17] = float("nan")
    grouped = natural.view(num_queries, num_heads // block_heads, block_heads, dim // width, width).transpose(2, 3)
    dq = torch.zeros(num_queries, num_heads, dim, dtype=dtype, device=DEVICE)
    ungroup_dq(grouped.contiguous().view_as(natural).to(DEVICE), dq, block_heads, width, (DEVICE, dtype, dim, "fixed"),
               scales.to(DEVICE), SCALE)
    want = (natural.float() / scales[..., None] * SCALE).to(dtype)
    assert torch.isnan(dq[1, 17]).all()
    assert torch.equal(dq.cpu().nan_to_num(0.0), want.nan_to_num(0.0))
