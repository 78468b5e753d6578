"""The stages of a dQ added in fixed point: each row's scale against a plain-torch oracle of its
bound (the blocks it selects, each within its own document; fragments; poison in one block), the
bound against the reference's dQ, the final cast and its flags of the rows to recompute, and the
query-outer dQ kernel recomputing only those.

Where and how they run: `tests/support/triton_kernels.py`.
"""

import pytest
import torch

from tests.support.documents import Documents, documents_of
from tests.support.triton_kernels import DEVICE, layout, require_a_device
from torch_msa import reference, testing
from torch_msa.documents import locate_queries
from torch_msa.stages.deterministic import query_dq
from torch_msa.stages.dq import ungroup_dq
from torch_msa.stages.fixed_point_dq import MAX_EXPONENT, bound_bits, dq_scales, recompute_below, share_cap

require_a_device()

HQ, HKV, D, BLOCK, TOPK = 4, 2, 32, 16, 4
SCALE = D**-0.5


def _problem(q_lens, k_lens, seed=0):
    generator = torch.Generator().manual_seed(seed)
    cu_q, cu_k, tq, tk, max_q, max_k = layout(q_lens, k_lens)
    k, v = (torch.randn(tk, HKV, D, generator=generator).to(DEVICE) for _ in range(2))
    grad_out = torch.randn(tq, HQ, D, generator=generator).to(DEVICE)
    delta = torch.randn(tq, HQ, generator=generator).to(DEVICE)
    block_indices = testing.random_block_indices(cu_q, cu_k, HKV, TOPK, BLOCK, generator).to(DEVICE)
    return k, v, grad_out, delta, block_indices, Documents(cu_q, cu_k, max_q, max_k)


def _scales(grad_out, delta, k, v, block_indices, documents, key="scales"):
    return dq_scales(grad_out, delta, k, v, block_indices, documents, BLOCK, (DEVICE, torch.float32, key))


def _finite(x):
    return torch.where(x.isfinite(), x, 0).double()


def _oracle_bound(grad_out, delta, k, v, block_indices, documents):
    """fp64 `[Tq, Hq]`: `2 (||dO|| max ||V|| + |delta|) max |K|`, the maxima over the finite values
    of the blocks the row's selection holds and the row sees, each cut to the row's document (0 for
    a row that sees none)."""
    num_queries = grad_out.shape[0]
    located = locate_queries(documents.cu_seqlens_q.cpu(), documents.cu_seqlens_k.cpu(), num_queries, k.shape[0],
                             *(None if x is None else x.cpu() for x in documents.fragments))
    cu_k = documents.cu_seqlens_k.tolist()
    k, v, ids = _finite(k.cpu()), _finite(v.cpu()), block_indices.cpu()
    norms = _finite(grad_out.cpu()).norm(dim=-1)
    bound = torch.zeros(num_queries, HQ, dtype=torch.float64)
    for token in range(num_queries):
        position, start = int(located.position[token]), int(located.key_start[token])
        if position < 0:
            continue
        end = min(cu_k[i + 1] for i in range(len(cu_k) - 1) if cu_k[i] == start)
        for kv in range(HKV):
            blocks = {int(b) for b in ids[kv, token] if 0 <= int(b) <= position // BLOCK}
            rows = [r for b in blocks for r in range(start + b * BLOCK, min(start + (b + 1) * BLOCK, end))]
            if not rows:
                continue
            key_max = k[rows, kv].abs().max()
            value_norm = v[rows, kv].norm(dim=-1).max()
            for head in range(kv * (HQ // HKV), (kv + 1) * (HQ // HKV)):
                bound[token, head] = 2 * (norms[token, head] * value_norm + abs(float(delta[token, head]))) * key_max
    return bound


def _check_scales(scales, bound, topk=TOPK):
    """Each scale is a power of two that puts its row's bound in `[2**(bits - 1), 2**bits)`
    (fp32's rounding of the maxima aside); the largest for a bound too small for that; NaN for one
    that no scale serves."""
    bits = bound_bits(topk)
    scales = scales.cpu().double()
    refused = bound >= 2.0 ** (bits + MAX_EXPONENT)
    assert torch.isnan(scales[refused]).all() and not torch.isnan(scales[~refused]).any()
    scales, bound = scales[~refused], bound[~refused]
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all(), "a scale is not a power of two"
    assert ((scales >= 2.0**-MAX_EXPONENT) & (scales <= 2.0**MAX_EXPONENT)).all()
    scaled = bound * scales
    tiny = bound * 2.0**MAX_EXPONENT < 2.0 ** (bits - 1)
    assert torch.equal(scales[tiny], torch.full_like(scales[tiny], 2.0**MAX_EXPONENT))
    assert (~tiny).sum() > 0
    assert (scaled[~tiny] < 2.0**bits * (1 + 1e-6)).all()
    assert (scaled[~tiny] >= 2.0 ** (bits - 1) * (1 - 1e-6)).all()


def test_row_scales_follow_the_bound_of_the_blocks_each_row_selects():
    """A pack with an empty, a one-token and an `Lq < Lk` document, and junk ids."""
    k, v, grad_out, delta, block_indices, documents = _problem([40, 0, 1, 30], [70, 5, 1, 90])
    block_indices[0, ::3, -1] = 1000
    block_indices[1, 1::4, 0] = -7
    scales = _scales(grad_out, delta, k, v, block_indices, documents)
    assert scales.shape == delta.shape and scales.dtype == torch.float32
    _check_scales(scales, _oracle_bound(grad_out, delta, k, v, block_indices, documents))


def test_row_scales_of_fragments_read_their_documents_blocks():
    frag = testing.fragments((50, 30, 1), ((0, 10, 20), (1, 0, 30), (0, 30, 20), (2, 0, 1)), DEVICE)
    generator = torch.Generator().manual_seed(3)
    tq, tk = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
    k, v = (torch.randn(tk, HKV, D, generator=generator).to(DEVICE) for _ in range(2))
    k[50:80] *= 64  # the second document's keys stand out
    grad_out = torch.randn(tq, HQ, D, generator=generator).to(DEVICE)
    delta = torch.randn(tq, HQ, generator=generator).to(DEVICE)
    block_indices = testing.random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, HKV, TOPK, BLOCK, generator,
                                                 *frag.tensors).to(DEVICE)
    documents = documents_of(frag.cu_seqlens_q, frag.cu_seqlens_k, *frag.tensors)
    scales = _scales(grad_out, delta, k, v, block_indices, documents, "fragments")
    _check_scales(scales, _oracle_bound(grad_out, delta, k, v, block_indices, documents))


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 100.0, 1e30])
def test_one_blocks_keys_move_only_the_rows_that_select_it(poison):
    """Keys of block 1 of the second document made non-finite or outliers: the scales of every
    other document, and of the rows of that document that do not select the block, stay as they
    were. Non-finite values are left out of the bound (the rows that see them get non-finite
    shares, which the kernel marks); an outlier of 1e30 leaves a bound no scale serves."""
    k, v, grad_out, delta, block_indices, documents = _problem([60, 50, 40], [60, 50, 40], seed=1)
    clean = _scales(grad_out, delta, k, v, block_indices, documents, "poison")
    poisoned_keys = slice(60 + BLOCK + 2, 60 + BLOCK + 8)  # inside block 1 of the second document
    k[poisoned_keys] *= poison
    v[poisoned_keys] *= poison
    poisoned = _scales(grad_out, delta, k, v, block_indices, documents, "poison")
    selects = (block_indices.cpu() == 1).any(dim=-1).T.repeat_interleave(HQ // HKV, dim=1)  # [Tq, Hq]
    selects[:60] = selects[110:] = False
    assert torch.equal(poisoned[~selects.to(DEVICE)], clean[~selects.to(DEVICE)])
    assert selects.any()
    if poison == 100.0:  # the outlier loosens the bound of the rows that select its block
        assert (poisoned[selects.to(DEVICE)] < clean[selects.to(DEVICE)]).all()
    _check_scales(poisoned, _oracle_bound(grad_out, delta, k, v, block_indices, documents))


def test_a_non_finite_bound_refuses_its_row():
    k, v, grad_out, delta, block_indices, documents = _problem([20], [20], seed=2)
    delta[3, 1] = float("nan")
    delta[4, 1] = float("inf")
    grad_out[5, 2, 0] = float("inf")  # left out of the norm: the shares carry it, and the kernel marks them
    delta[7, 0] = 3e38  # beyond fp32's product of the maxima, within fp64's: served
    scales = _scales(grad_out, delta, k, v, block_indices, documents, "rows")
    assert torch.isnan(scales[3, 1]) and torch.isnan(scales[4, 1])
    assert not torch.isnan(scales[5, 2]) and 0 < float(scales[7, 0]) < 2.0**-100
    assert torch.isfinite(scales[:3]).all()


def test_the_bound_covers_the_references_dq():
    """Each row's scaled `|dQ| / softmax_scale`, the sum of its shares, stays below half the
    scaled bound, so that `topk` shares rounded to integers cannot pass `share_cap`."""
    q_lens = [100, 37]
    k, v, grad_out, _, block_indices, documents = _problem(q_lens, q_lens, seed=4)
    q = torch.randn(grad_out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    out, lse = reference.forward(q, k, v, block_indices, documents, BLOCK, SCALE)
    delta = (grad_out * out).sum(-1)
    dq, _, _ = reference.backward(grad_out, q, k, v, out, lse, block_indices, documents, BLOCK, SCALE)
    scales = _scales(grad_out, delta, k, v, block_indices, documents, "covers")
    scaled = (dq / SCALE).abs().amax(dim=-1) * scales
    assert (scaled <= 2.0 ** (bound_bits(TOPK) - 1)).all()
    assert (scaled > 2.0 ** (bound_bits(TOPK) - 10)).any(), "the bound is needlessly loose"
    assert TOPK * 2.0 ** bound_bits(TOPK) <= 2.0**30 and share_cap(TOPK) == 2.0**30 / TOPK


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_fixed_point_cast_divides_each_rows_scale_out_and_flags_coarse_rows(dtype):
    """Grouped int32 sums `[D / 8, 16, 8]` per 16-head block, each row's power-of-two scale divided
    out exactly; a marked row (NaN scale) comes out NaN. Rows whose largest |sum| lies below
    `recompute_below(topk)` units (one just below it, one of zeros, one whose only large sum is
    negative and just at it) are flagged, unless marked NaN or at the clamp scale of a vanishing
    bound (a zero dO's row)."""
    num_queries, num_heads, dim, block_heads, width = 3, 32, 128, 16, 8
    generator = torch.Generator().manual_seed(5)
    natural = torch.randint(-(2**26), 2**26, (num_queries, num_heads, dim), generator=generator, dtype=torch.int32)
    floor = recompute_below(16)
    natural[0, 3] = torch.randint(-floor + 1, floor, (dim,), generator=generator)
    natural[2, 30] = 0
    natural[1, 17] = 0  # marked NaN below: refused, not recomputed
    natural[2, 5] = torch.randint(-floor + 1, floor, (dim,), generator=generator)
    natural[2, 5, 100] = -floor
    exponents = torch.randint(-40, 40, (num_queries, num_heads), generator=generator)
    scales = torch.ldexp(torch.ones(num_queries, num_heads), exponents).float()
    scales[1, 17] = float("nan")
    natural[0, 20] = 0
    natural[1, 9, :4] = 3
    scales[0, 20] = scales[1, 9] = 2.0**MAX_EXPONENT  # the clamp: no bound, or one below 2**-100
    grouped = natural.view(num_queries, num_heads // block_heads, block_heads, dim // width, width).transpose(2, 3)
    dq = torch.zeros(num_queries, num_heads, dim, dtype=dtype, device=DEVICE)
    redo = torch.full((num_queries, num_heads), 7, dtype=torch.int8, device=DEVICE)
    ungroup_dq(grouped.contiguous().view_as(natural).to(DEVICE), dq, block_heads, width, (DEVICE, dtype, dim, "fixed"),
               scales.to(DEVICE), SCALE, redo, floor)
    want = (natural.float() / scales[..., None] * SCALE).to(dtype)
    assert torch.isnan(dq[1, 17]).all()
    assert torch.equal(dq.cpu().nan_to_num(0.0), want.nan_to_num(0.0))
    want_redo = torch.zeros(num_queries, num_heads, dtype=torch.int8)
    want_redo[0, 3] = want_redo[2, 30] = 1
    assert torch.equal(redo.cpu(), want_redo)
    with pytest.raises(ValueError, match=r"redo_below: expected a positive count of units with row_scale, got 0"):
        ungroup_dq(grouped.contiguous().view_as(natural).to(DEVICE), dq, block_heads, width,
                   (DEVICE, dtype, dim, "fixed"), scales.to(DEVICE), SCALE, redo, 0)


def test_the_query_outer_dq_kernel_writes_only_the_flagged_rows():
    """With `row_redo`, the query-outer dQ kernel writes the flagged rows as its full run does and
    leaves every other row as it was, programs without a flagged row included."""
    q_lens = [70, 45]
    k, v, grad_out, _, block_indices, documents = _problem(q_lens, q_lens, seed=9)
    q = torch.randn(grad_out.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    out, lse = reference.forward(q, k, v, block_indices, documents, BLOCK, SCALE)
    delta = (grad_out * out).sum(-1)
    full = torch.empty_like(q)
    query_dq(q, k, v, grad_out, lse, delta, full, block_indices, documents, BLOCK, SCALE, (DEVICE, "full"))
    redo = torch.zeros(q.shape[:2], dtype=torch.int8)
    redo[[0, 3, 69, 70, 114], [1, 0, 3, 2, 3]] = 1
    sentinel = torch.full_like(q, 123.0)
    query_dq(q, k, v, grad_out, lse, delta, sentinel, block_indices, documents, BLOCK, SCALE, (DEVICE, "redo"),
             redo.to(DEVICE))
    flagged = redo.bool().to(DEVICE)
    assert torch.equal(sentinel[flagged], full[flagged])
    assert (sentinel[~flagged] == 123.0).all()
