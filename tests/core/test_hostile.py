"""Hostile but realistic use, on every device present (the reference on CPU; on CUDA the backend
that serves, the Triton path on an H200): non-finite values, autocast, torch.func, strided views."""

import functools

import pytest
import torch

import torch_msa
from torch_msa.testing import cu_seqlens, random_block_indices

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HQ, HKV, D, DI, BLOCK, TOPK = 4, 2, 64, 32, 64, 2
# Three documents; the first has fewer queries than keys.
Q_LENS, K_LENS = [100, 80, 70], [130, 80, 70]
DOCS = (*cu_seqlens(Q_LENS, K_LENS), max(Q_LENS), max(K_LENS))


def _rows(lengths, doc):
    start = sum(lengths[:doc])
    return slice(start, start + lengths[doc])


def _others(lengths, doc):
    """Boolean row mask of every document but `doc`."""
    mask = torch.ones(sum(lengths), dtype=torch.bool)
    mask[_rows(lengths, doc)] = False
    return mask


def _docs(device):
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in DOCS)


def _problem(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(Q_LENS), sum(K_LENS)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return dict(q=randn(tq, HQ, D), k=randn(tk, HKV, D), v=randn(tk, HKV, D), grad_out=randn(tq, HQ, D),
                grad_lse=torch.randn(tq, HQ, generator=g).to(device),
                block_indices=random_block_indices(*DOCS[:2], HKV, TOPK, BLOCK, generator=g).to(device),
                index_q=randn(tq, HKV, DI), index_k=randn(tk, 1, DI))


def _attention(p, device):
    """out, lse and the gradients of `<out, grad_out> + <lse, grad_lse>` wrt q, k, v."""
    leaves = [p[name].detach().clone().requires_grad_() for name in ("q", "k", "v")]
    out, lse = torch_msa.sparse_attention(*leaves, p["block_indices"], *_docs(device), block_size=BLOCK,
                                          return_lse=True)
    grads = torch.autograd.grad((out, lse), leaves, (p["grad_out"], p["grad_lse"]))
    return dict(out=out.detach(), lse=lse.detach(), dq=grads[0], dk=grads[1], dv=grads[2])


@functools.cache
def _clean_attention(device):
    return _attention(_problem(device), device)


def _assert_same(got, want, device, what, same_layout=True):
    """Finite and equal up to rounding: within 1e-6 on the CPU reference for the same inputs in the
    same layout (`same_layout`; the CPU BLAS may take another path for a buffer of another
    alignment), otherwise within the rounding of another summation order (atomics, BLAS paths)."""
    assert torch.isfinite(got).all(), f"{what} is not finite"
    tolerance = (1e-6 if same_layout else 1e-5) if device == "cpu" else 2e-3
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance, msg=lambda m: f"{what}: {m}")


# Document 0 holds row 0, which invalid slots of the other documents used to read; poisoning
# document 1 checks that nothing is scattered into another document's rows.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("doc", [0, 1])
@pytest.mark.parametrize("poisoned", ["q", "k", "v", "grad_out", "grad_lse"])
def test_a_non_finite_value_stays_in_its_document(poisoned, doc, value, device):
    clean = _problem(device)
    expected = _clean_attention(device)
    hostile = dict(clean)
    hostile[poisoned] = clean[poisoned].clone()
    hostile[poisoned][_rows(K_LENS if poisoned in ("k", "v") else Q_LENS, doc)] = value
    got = _attention(hostile, device)
    queries, keys = _others(Q_LENS, doc).to(device), _others(K_LENS, doc).to(device)
    for name in ("out", "lse", "dq"):
        _assert_same(got[name][queries], expected[name][queries], device, f"{name} of the other documents")
    for name in ("dk", "dv"):
        _assert_same(got[name][keys], expected[name][keys], device, f"{name} of the other documents")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("doc", [0, 1])
@pytest.mark.parametrize("poisoned", ["index_q", "index_k"])
def test_a_non_finite_index_input_stays_in_its_document(poisoned, doc, value, device):
    clean = _problem(device)

    def select(p):
        return torch_msa.select_blocks(p["index_q"], p["index_k"], *_docs(device), topk=TOPK, block_size=BLOCK)

    hostile = dict(clean)
    hostile[poisoned] = clean[poisoned].clone()
    hostile[poisoned][_rows(K_LENS if poisoned == "index_k" else Q_LENS, doc)] = value
    queries = _others(Q_LENS, doc).to(device)
    assert torch.equal(select(hostile)[:, queries], select(clean)[:, queries])


# Autocast: the attention forward runs in the autocast dtype like scaled_dot_product_attention;
# selection and backward run with autocast off (fp32 scores, lse and grad_lse).
AUTOCAST = {"cpu": torch.bfloat16, "cuda": torch.float16}


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_the_forward_in_the_autocast_dtype(device):
    dtype = AUTOCAST[device]
    p = _problem(device)
    leaves = [p[name].detach().clone().requires_grad_() for name in ("q", "k", "v")]
    with torch.autocast(device, dtype):
        out, lse = torch_msa.sparse_attention(*leaves, p["block_indices"], *_docs(device), block_size=BLOCK,
                                              return_lse=True)
        assert out.dtype == dtype and lse.dtype == torch.float32
        # A backward inside the region runs with autocast off.
        grads = torch.autograd.grad((out, lse), leaves, (p["grad_out"].to(dtype), p["grad_lse"]))
    assert all(g.dtype == torch.float32 for g in grads)
    # The same as casting the inputs by hand outside autocast.
    cast = [p[name].detach().to(dtype).requires_grad_() for name in ("q", "k", "v")]
    out_cast, lse_cast = torch_msa.sparse_attention(*cast, p["block_indices"], *_docs(device), block_size=BLOCK,
                                                    return_lse=True)
    grads_cast = torch.autograd.grad((out_cast, lse_cast), cast, (p["grad_out"].to(dtype), p["grad_lse"]))
    pairs = [("out", out, out_cast), ("lse", lse, lse_cast)] + list(zip(("dq", "dk", "dv"), grads, grads_cast))
    for name, got, want in pairs:
        _assert_same(got, want.to(got.dtype), device, name)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_leaves_selection_in_fp32(device):
    """Selection scores stay fp32 inside autocast: the same blocks as outside, over many
    candidate blocks where bf16/fp16 scores would reorder some."""
    g = torch.Generator().manual_seed(1)
    cu_q, cu_k = cu_seqlens([1024], device=device)
    index_q = torch.randn(1024, HKV, DI, generator=g).to(device)
    index_k = torch.randn(1024, 1, DI, generator=g).to(device)
    expected = torch_msa.select_blocks(index_q, index_k, cu_q, cu_k, 1024, 1024, topk=4, block_size=BLOCK)
    with torch.autocast(device, AUTOCAST[device]):
        got = torch_msa.select_blocks(index_q, index_k, cu_q, cu_k, 1024, 1024, topk=4, block_size=BLOCK)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_msa_attention_and_fp64(device):
    p = _problem(device)
    args = (p["q"], p["k"], p["v"], p["index_q"], p["index_k"], *_docs(device))
    expected = torch_msa.msa_attention(p["q"].to(AUTOCAST[device]), p["k"].to(AUTOCAST[device]),
                                       p["v"].to(AUTOCAST[device]), *args[3:], topk=TOPK, block_size=BLOCK)
    with torch.autocast(device, AUTOCAST[device]):
        got = torch_msa.msa_attention(*args, topk=TOPK, block_size=BLOCK)
        # fp64 is not an autocast dtype: it runs in fp64, as matmul does.
        fp64 = torch_msa.sparse_attention(p["q"].double(), p["k"].double(), p["v"].double(), p["block_indices"],
                                          *_docs(device), block_size=BLOCK)
    _assert_same(got, expected, device, "out")
    assert fp64.dtype == torch.float64


def test_autocast_under_torch_compile():
    p = _problem("cpu")

    def fn(q, k, v):
        with torch.autocast("cpu", torch.bfloat16):
            return torch_msa.sparse_attention(q, k, v, p["block_indices"], *DOCS, block_size=BLOCK)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = compiled(p["q"], p["k"], p["v"])
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, fn(p["q"], p["k"], p["v"]))


# torch.func: reverse mode works, forward mode raises (never a silent zero tangent).
def _func_problem(device):
    p = _problem(device, dtype=torch.float64 if device == "cpu" else torch.float32)

    def loss(q, k, v):
        out, lse = torch_msa.sparse_attention(q, k, v, p["block_indices"], *_docs(device), block_size=BLOCK,
                                              return_lse=True)
        return (out * p["grad_out"].to(out.dtype)).sum() + (lse * p["grad_lse"].to(lse.dtype)).sum()

    return p, loss


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_grad_and_vjp_match_backward(device):
    p, loss = _func_problem(device)
    leaves = [p[name].detach().clone().requires_grad_() for name in ("q", "k", "v")]
    expected = torch.autograd.grad(loss(*leaves), leaves)
    got_grad = torch.func.grad(loss, argnums=(0, 1, 2))(p["q"], p["k"], p["v"])
    value, vjp_fn = torch.func.vjp(loss, p["q"], p["k"], p["v"])
    got_vjp = vjp_fn(torch.ones_like(value))
    for got in (got_grad, got_vjp):
        for g, e in zip(got, expected):
            _assert_same(g, e, device, "gradient")


def test_torch_func_jacrev_matches_backward():
    p, loss = _func_problem("cpu")
    jacobian = torch.func.jacrev(loss)(p["q"], p["k"], p["v"])
    q = p["q"].detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(q, p["k"], p["v"]), q)
    assert torch.equal(jacobian, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_mode_ad_raises_instead_of_a_zero_tangent(device):
    p, loss = _func_problem(device)
    primals = (p["q"], p["k"], p["v"])
    with pytest.raises(NotImplementedError, match="torch_msa: msa::forward does not support forward-mode AD"):
        torch.func.jvp(loss, primals, tuple(torch.ones_like(x) for x in primals))
    import torch.autograd.forward_ad as fwad
    with fwad.dual_level(), pytest.raises(NotImplementedError, match="torch_msa: msa::forward"):
        loss(fwad.make_dual(p["q"], torch.ones_like(p["q"])), p["k"], p["v"])


def test_nested_torch_func_transforms_raise_or_match():
    """Nested transforms reach the outer levels: a second derivative raises (no silent zero),
    vmap over grad matches the plain gradient."""
    p, loss = _func_problem("cpu")
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.func.grad(lambda q: torch.func.grad(loss)(q, p["k"], p["v"]).sum())(p["q"])
    with pytest.raises(NotImplementedError, match="torch_msa: msa::forward does not support forward-mode AD"):
        torch.func.jvp(lambda q: torch.func.grad(loss)(q, p["k"], p["v"]), (p["q"],), (torch.ones_like(p["q"]),))
    q = p["q"].detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(q, p["k"], p["v"]), q)
    batched_grad = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None, None))
    batched = batched_grad(torch.stack([p["q"], p["q"]]), p["k"], p["v"])
    assert torch.equal(batched[0], expected) and torch.equal(batched[1], expected)


# The index branch's KL losses under torch.func: reverse mode equals backward(), forward mode raises.
def _kl_losses(p, device):
    lse = torch_msa.sparse_attention(p["q"], p["k"], p["v"], p["block_indices"], *_docs(device), block_size=BLOCK,
                                     return_lse=True)[1]

    def sparse(index_q, index_k):
        return torch_msa.indexer_kl_loss(p["q"], p["k"], lse, index_q, index_k, p["block_indices"], *_docs(device),
                                         block_size=BLOCK)

    def dense(index_q, index_k):
        return torch_msa.indexer_kl_loss_dense(p["q"], p["k"], index_q, index_k, *_docs(device), block_size=BLOCK)

    return {"indexer_kl_loss": sparse, "indexer_kl_loss_dense": dense}


@pytest.mark.parametrize("loss_name", ["indexer_kl_loss", "indexer_kl_loss_dense"])
@pytest.mark.parametrize("device", DEVICES)
def test_kl_losses_under_torch_func(device, loss_name):
    p = _problem(device, dtype=torch.float64 if device == "cpu" else torch.float32)
    loss = _kl_losses(p, device)[loss_name]
    leaves = [p[name].detach().clone().requires_grad_() for name in ("index_q", "index_k")]
    expected = torch.autograd.grad(loss(*leaves), leaves)
    got_grad = torch.func.grad(loss, argnums=(0, 1))(p["index_q"], p["index_k"])
    value, vjp_fn = torch.func.vjp(loss, p["index_q"], p["index_k"])
    for got in (got_grad, vjp_fn(torch.ones_like(value))):
        for g, e in zip(got, expected):
            _assert_same(g, e, device, "index gradient")
    primals = (p["index_q"], p["index_k"])
    with pytest.raises(NotImplementedError, match="torch_msa: msa::indexer_kl does not support forward-mode AD"):
        torch.func.jvp(loss, primals, tuple(torch.ones_like(x) for x in primals))
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.func.grad(lambda q: torch.func.grad(loss)(q, p["index_k"]).sum())(p["index_q"])


# Any strides: every tensor argument as a permuted, sliced or expanded view.
def _strided(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "permuted":  # same values, storage in another dimension order
        order = list(range(x.dim()))[::-1]
        inverse = [order.index(i) for i in range(x.dim())]
        return x.permute(order).contiguous().permute(inverse)
    # sliced: every other element of a buffer twice as long in the last dimension
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return wide[..., ::2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["permuted", "sliced"])
def test_every_argument_may_have_any_strides(kind, device):
    p = _problem(device)
    cu_q, cu_k, max_q, max_k = _docs(device)
    expected = _attention(p, device)
    expected_select = torch_msa.select_blocks(p["index_q"], p["index_k"], cu_q, cu_k, max_q, max_k, topk=TOPK,
                                              block_size=BLOCK)
    strided = {name: _strided(x, kind) for name, x in p.items()}
    assert not any(x.is_contiguous() for x in strided.values())
    # The case: block_indices [Hkv, Tq, topk] stored as [Tq, Hkv, topk].
    strided_ids = p["block_indices"].transpose(0, 1).contiguous().transpose(0, 1)
    assert strided_ids.stride() == (TOPK, HKV * TOPK, 1)
    for ids in (strided["block_indices"], strided_ids):
        got = _attention({**strided, "block_indices": ids}, device)
        for name in expected:
            _assert_same(got[name], expected[name], device, name, same_layout=False)
    cu = [_strided(x, "sliced") for x in (cu_q, cu_k)]
    got_select = torch_msa.select_blocks(strided["index_q"], strided["index_k"], *cu, max_q, max_k, topk=TOPK,
                                         block_size=BLOCK)
    assert torch.equal(got_select, expected_select)
    out = torch_msa.msa_attention(strided["q"], strided["k"], strided["v"], strided["index_q"], strided["index_k"],
                                  *cu, max_q, max_k, topk=TOPK, block_size=BLOCK)
    expected_out = torch_msa.sparse_attention(p["q"], p["k"], p["v"], expected_select, cu_q, cu_k, max_q, max_k,
                                              block_size=BLOCK)
    _assert_same(out, expected_out, device, "msa_attention out", same_layout=False)
    # The backward op itself, with strided out / lse and an expanded (zero-stride) grad_out.
    scale = D**-0.5
    out, lse = torch.ops.msa.forward(p["q"], p["k"], p["v"], p["block_indices"], cu_q, cu_k, max_q, max_k, BLOCK, scale)
    ones = torch.ones(1, 1, 1, device=device).expand_as(out)
    want = torch.ops.msa.backward(ones.contiguous(), p["q"], p["k"], p["v"], out, lse, p["block_indices"], cu_q, cu_k,
                                  max_q, max_k, BLOCK, scale, p["grad_lse"])
    got = torch.ops.msa.backward(ones, strided["q"], strided["k"], strided["v"], _strided(out, kind),
                                 _strided(lse, kind), strided_ids, *cu, max_q, max_k, BLOCK, scale,
                                 strided["grad_lse"])
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _assert_same(g, w, device, name, same_layout=False)
