"""The Triton dense-support KL kernels (`torch_msa/index_loss/dense.py`) at small shapes.

Against a float64 computation of the loss written here from the math (dense `[Tq, Tk]` masks,
fine at these sizes), with the index gradients taken by autograd through it, and against
`torch_msa.reference_index_loss` for the outputs it has. Run natively on a CUDA host, or on CPU under the
Triton interpreter by `tests/triton/test_interpret.py`; fp32 and fp16 only (the interpreter's
bf16 `tl.dot` is wrong, see `tests/support/triton_kernels.py`).
"""


import pytest
import torch

from tests.support.documents import Documents, backend_arguments
from tests.support.triton_kernels import DEVICE, require_a_device
from torch_msa import reference_index_loss, testing
from torch_msa.backends import UnsupportedInputs
from torch_msa.index_loss import dense as kl_dense_kernel

require_a_device()

# (q lengths, k lengths, Hq, Hkv, D, Di, dtype, strided inputs)
CASES = {
    # An empty document (Lq = 0 < Lk), a 1-token one, Lq < Lk, a query tile split over documents.
    "pack-empty-1-token-suffix": ([40, 0, 1, 90], [140, 5, 1, 90], 4, 2, 64, 16, torch.float32, False),
    # Several query and key tiles, key tiles every query of a tile sees entirely (no mask).
    "long-suffix-fp16-d16": ([100, 230], [260, 230], 4, 2, 16, 32, torch.float16, False),
    "group3-d128-strided": ([70, 20], [200, 20], 6, 2, 128, 16, torch.float32, True),
    "mha": ([65], [65], 2, 2, 64, 16, torch.float32, False),
}


def _dense_mask(q_lens, k_lens):
    """`[Tq, Tk]` bool: key j is in query t's document and at most at its position."""
    mask = torch.zeros(sum(q_lens), sum(k_lens), dtype=torch.bool)
    q0 = k0 = 0
    for lq, lk in zip(q_lens, k_lens):
        for t in range(lq):
            mask[q0 + t, k0:k0 + lk - lq + t + 1] = True
        q0, k0 = q0 + lq, k0 + lk
    return mask


def oracle(q, k, lse, index_q, index_k, q_lens, k_lens, scale, index_scale):
    """The loss and its terms in float64 from the math: `(loss, teacher_lse, index_lse, mass,
    teacher_index_keys, teacher_index_queries)`, with the graph to `index_q`, `index_k` kept."""
    mask = _dense_mask(q_lens, k_lens).to(q.device)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    keys = k.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,jhd->htj", q.double(), keys) * scale
    scores = scores.masked_fill(~mask, -torch.inf)
    teacher_lse = torch.logsumexp(scores, -1).t() if lse is None else lse.double()
    shift = teacher_lse.t().masked_fill(torch.isinf(teacher_lse.t()), 0)
    probs = torch.where(mask, (scores - shift[..., None]).exp(), 0)
    teacher = probs.view(num_kv_heads, group, *mask.shape).mean(1)  # [Hi, Tq, Tk]

    logits = torch.einsum("trd,jd->rtj", index_q, index_k[:, 0]) * index_scale
    any_key = mask.any(-1)
    # Rows with no key get a finite stand-in so that autograd stays finite; their lse is -inf.
    safe = torch.where(mask, logits, torch.where(any_key[:, None], -torch.inf, 0.0))
    index_lse = torch.where(any_key, torch.logsumexp(safe, -1), -torch.inf)
    mass = teacher.sum(-1)
    positive = teacher > 0
    weighted = torch.where(positive, teacher * (torch.where(positive, teacher, 1).log() - torch.where(mask, logits, 0)),
                           0).sum(-1)
    divergence = weighted + torch.where(mass > 0, mass * torch.where(any_key, index_lse, 0), 0)
    loss = divergence.sum() / (q.shape[0] * num_kv_heads)
    teacher_index_keys = torch.einsum("rtj,jd->trd", teacher, index_k[:, 0].detach())
    teacher_index_queries = torch.einsum("rtj,trd->jd", teacher, index_q.detach())[:, None]
    return loss, teacher_lse, index_lse.t(), mass.t(), teacher_index_keys, teacher_index_queries


def _close(actual, expected, tolerance, what):
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), f"{what}: infinities differ"
    actual, expected = actual.double().nan_to_num(neginf=0), expected.double().nan_to_num(neginf=0)
    error = (actual - expected).abs().max().item() if actual.numel() else 0.0
    # Relative to the largest expected value: the gradients are small (they carry 1 / (Tq Hi)).
    scale = max(1e-30, expected.abs().max().item() if expected.numel() else 0.0)
    assert error <= tolerance * scale, f"{what}: max error {error:.3g} > {tolerance:.1g} x {scale:.3g}"


def _inputs(q_lens, k_lens, num_heads, num_kv_heads, dim, index_dim, dtype, strided, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(q_lens), sum(k_lens)

    def randn(*shape):
        x = torch.randn(*shape, generator=g)
        if strided:  # every other row and head of a larger tensor, head dim still unit-stride
            big = torch.randn(2 * shape[0], 2 * shape[1], shape[2], generator=g)
            big[::2, ::2] = x
            x = big[::2, ::2]
        return x.to(DEVICE, dtype)

    return (randn(tq, num_heads, dim), randn(tk, num_kv_heads, dim), randn(tq, num_kv_heads, index_dim),
            randn(tk, 1, index_dim))


@pytest.mark.parametrize("with_lse", [False, True], ids=["lse-computed", "lse-given"])
@pytest.mark.parametrize("case", CASES)
def test_dense_loss_and_gradients_match_float64(case, with_lse):
    q_lens, k_lens, num_heads, num_kv_heads, dim, index_dim, dtype, strided = CASES[case]
    q, k, index_q, index_k = _inputs(q_lens, k_lens, num_heads, num_kv_heads, dim, index_dim, dtype, strided)
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens, DEVICE)
    docs = (cu_q, cu_k, max(q_lens), max(k_lens))
    scales = (dim**-0.5, index_dim**-0.5)
    lse = None
    if with_lse:  # an lse off the true one, so the teacher's mass is not 1
        lse = oracle(q, k, None, index_q.double(), index_k.double(), q_lens, k_lens, *scales)[1].float()
        lse = lse + 0.3 * torch.randn(lse.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    got = kl_dense_kernel.indexer_kl_dense(q, k, lse, index_q, index_k, Documents(*docs), *scales)
    leaf_q = index_q.double().requires_grad_()
    leaf_k = index_k.double().requires_grad_()
    want = oracle(q, k, lse, leaf_q, leaf_k, q_lens, k_lens, *scales)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-3
    names = ("loss", "teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    for name, a, b in zip(names, got, want):
        assert a.dtype == torch.float32, name
        _close(a, b.detach(), tolerance, name)
    if with_lse:
        assert torch.equal(got[1], lse)

    # The outputs the reference has agree with it too.
    expected = reference_index_loss.indexer_kl(
        *backend_arguments("indexer_kl", q, k, lse, index_q, index_k, None, *docs, 128, *scales))
    for name, a, b in zip(names, got, expected):
        _close(a, b, tolerance, f"{name} vs reference")

    grad_loss = torch.tensor(1.7, device=DEVICE)
    d_index_q, d_index_k = torch.autograd.grad(want[0] * 1.7, (leaf_q, leaf_k))
    _, _, index_lse, mass, teacher_keys, teacher_queries = got
    grads = kl_dense_kernel.indexer_kl_dense_backward(grad_loss, index_q, index_k, index_lse, mass, teacher_keys,
                                                      teacher_queries, Documents(*docs), scales[1])
    for name, a, b in zip(("d index_q", "d index_k"), grads, (d_index_q, d_index_k)):
        assert a.dtype == dtype and a.shape == b.shape, name
        _close(a, b, 4 * tolerance, name)


def test_kernels_decline_what_they_do_not_serve():
    q, k = torch.zeros(4, 2, 64, device=DEVICE), torch.zeros(4, 1, 64, device=DEVICE)
    index_q = torch.zeros(4, 1, 16, device=DEVICE)
    with pytest.raises(UnsupportedInputs, match="index head dim 24"):
        kl_dense_kernel.check_inputs(q, k, torch.zeros(4, 1, 24, device=DEVICE))
    with pytest.raises(UnsupportedInputs, match="head dim 48"):
        kl_dense_kernel.check_inputs(torch.zeros(4, 2, 48, device=DEVICE), k, index_q)
    with pytest.raises(UnsupportedInputs, match="float64"):
        kl_dense_kernel.check_inputs(q.double(), k.double(), index_q)


@pytest.mark.parametrize("with_lse", [False, True], ids=["lse-computed", "lse-given"])
@pytest.mark.parametrize("case", ["pack-empty-1-token-suffix", "long-suffix-fp16-d16", "group3-d128-strided"])
def test_deterministic_dense_forward_matches_float64_and_repeats_bitwise(case, with_lse, deterministic_algorithms):
    """Under deterministic algorithms the teacher's index queries come from the key-tile-outer
    kernel, without atomics: every output as accurate as the default forward's, and equal bits
    on a second call."""
    q_lens, k_lens, num_heads, num_kv_heads, dim, index_dim, dtype, strided = CASES[case]
    q, k, index_q, index_k = _inputs(q_lens, k_lens, num_heads, num_kv_heads, dim, index_dim, dtype, strided)
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens, DEVICE)
    docs = (cu_q, cu_k, max(q_lens), max(k_lens))
    scales = (dim**-0.5, index_dim**-0.5)
    want = oracle(q, k, None, index_q.double(), index_k.double(), q_lens, k_lens, *scales)
    lse = want[1].float() if with_lse else None
    got = kl_dense_kernel.indexer_kl_dense(q, k, lse, index_q, index_k, Documents(*docs), *scales)
    tolerance = 2e-5 if dtype == torch.float32 else 3e-3
    names = ("loss", "teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    assert want[5].abs().sum() > 0
    for name, a, b in zip(names, got, want, strict=True):
        _close(a, b.detach(), tolerance, name)
    for name, a, b in zip(names, got, kl_dense_kernel.indexer_kl_dense(q, k, lse, index_q, index_k, Documents(*docs), *scales),
                          strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("poisoned", ["q", "k", "index_q", "index_k"])
def test_a_non_finite_document_changes_no_other_documents_outputs_or_gradients(poisoned, deterministic, request):
    """NaN/Inf in document 1 of three (50, 40 and 30 tokens, so documents end inside every key
    tile) leaves every per-query and per-key output and gradient of documents 0 and 2 finite and
    equal to a clean run's, with the default forward and the deterministic one."""
    if deterministic:
        request.getfixturevalue("deterministic_algorithms")
    lengths = [50, 40, 30]
    cu_q, cu_k = testing.cu_seqlens(lengths, lengths, DEVICE)
    docs = (cu_q, cu_k, max(lengths), max(lengths))
    clean = dict(zip(("q", "k", "index_q", "index_k"), _inputs(lengths, lengths, 4, 2, 64, 16, torch.float32, False)))
    dirty = dict(clean)
    dirty[poisoned] = clean[poisoned].clone()
    dirty[poisoned][50:90:2] = float("nan")
    dirty[poisoned][51:90:2] = float("inf")

    def run(x):
        loss, *outputs = kl_dense_kernel.indexer_kl_dense(x["q"], x["k"], None, x["index_q"], x["index_k"],
                                                          Documents(*docs), 64**-0.5, 16**-0.5)
        grads = kl_dense_kernel.indexer_kl_dense_backward(torch.tensor(1.0, device=DEVICE), x["index_q"],
                                                          x["index_k"], *outputs[1:], Documents(*docs), 16**-0.5)
        return (*outputs, *grads)

    names = ("teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries",
             "d index_q", "d index_k")
    for name, a, b in zip(names, run(dirty), run(clean)):
        for rows in (slice(0, 50), slice(90, 120)):
            assert a[rows].isfinite().all(), f"{name} rows {rows} are not finite"
            torch.testing.assert_close(a[rows], b[rows], rtol=1e-6, atol=1e-7,
                                       msg=lambda m, name=name, rows=rows: f"{name} {rows}: {m}")


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_fragments_match_the_reference_forward_and_backward(deterministic, request):
    """Query fragments out of document order, several sharing one document's keys (and an empty
    and a 1-token one): the forward's outputs and both index gradients against the reference,
    with the default forward and the deterministic one (key-tile-outer teacher pass), which also
    repeats bitwise."""
    if deterministic:
        request.getfixturevalue("deterministic_algorithms")
    frag = testing.fragments((150, 0, 1, 90), ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 110, 40), (3, 0, 40),
                                                (0, 60, 50), (1, 0, 0)), DEVICE)
    num_queries, num_keys = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(num_queries, 4, 64, generator=g).to(DEVICE)
    k = torch.randn(num_keys, 2, 64, generator=g).to(DEVICE)
    index_q = torch.randn(num_queries, 2, 16, generator=g).to(DEVICE)
    index_k = torch.randn(num_keys, 1, 16, generator=g).to(DEVICE)
    args = (q, k, None, index_q, index_k)
    documents = Documents(*frag.op_args, *frag.tensors)

    def run():
        forward = kl_dense_kernel.indexer_kl_dense(*args, documents, 0.125, 0.25)
        grads = kl_dense_kernel.indexer_kl_dense_backward(torch.ones((), device=DEVICE), index_q, index_k,
                                                          *forward[2:], documents, 0.25)
        return (*forward, *grads)

    got = run()
    want = reference_index_loss.indexer_kl(
        *backend_arguments("indexer_kl", *args, None, *frag.op_args, 64, 0.125, 0.25, *frag.tensors))
    want_grads = reference_index_loss.indexer_kl_backward(
        *backend_arguments("indexer_kl_backward", torch.ones((), device=DEVICE), index_q, index_k, *want[2:], None,
                           *frag.op_args, 64, 0.25, *frag.tensors))
    names = ("loss", "teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries",
             "d index_q", "d index_k")
    assert want[5].abs().sum() > 0 and want_grads[1].abs().sum() > 0
    for name, actual, expected in zip(names, got, (*want, *want_grads), strict=True):
        _close(actual, expected.reshape(actual.shape), 2e-4, name)
    if deterministic:
        for name, a, b in zip(names, got, run(), strict=True):
            assert torch.equal(a, b), name
