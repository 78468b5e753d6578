"""The SM90 CuTe DSL backward against the reference, on a compute capability 9.0 GPU.

M3 shapes (Hq = 64, Hkv = 4, D = 128, block 128, top-16): a 1K document, a pack with empty and
one-token documents, an Lq < Lk pack, a skewed selection (hot blocks split over items), junk ids,
NaN in one document, grad_lse, bf16 and fp16, query fragments, given plans of any item size, a
16K document against the Triton backward, CUDA-graph replay, a whole training step under
`torch.compile(fullgraph=True)`, `torch.library.opcheck`, dispatch through `torch.ops.msa.backward`,
bitwise-reproducible deterministic mode (its fixed-point dQ against the reference on the same
layouts, on any grid, exactly scaled with the output gradient, NaN kept in its document and in
one row, as precise as the default beside an outlier key, replayed from a CUDA graph) and its
batch invariance (a document alone and packed). Skipped without such a GPU or the CuTe DSL.
"""

import math

import pytest
import torch

from tests.support.documents import Documents, backend_arguments, documents_of
from tests.support.sm90 import (
    BLOCK,
    HKV,
    HQ,
    REFERENCE_LAYOUTS,
    SCALE,
    SM90_KERNEL_MARKS,
    TOPK,
    D,
    random_problem,
    with_junk_ids,
)
from torch_msa import reference
from torch_msa.testing import fragments, random_block_indices

pytestmark = SM90_KERNEL_MARKS


def _problem(q_lens, k_lens, dtype=torch.bfloat16, selection="random", seed=0, with_grad_lse=False):
    """Inputs of `msa::backward`: `(grad_out, q, k, v, out, lse, blocks, cu_q, cu_k, max_q, max_k)`
    and `grad_lse` (or None); `out` and `lse` from the reference forward."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v, blocks, cu_q, cu_k, max_q, max_k = random_problem(q_lens, k_lens, dtype, selection, generator=generator)
    out, lse = reference.forward(q.float(), k.float(), v.float(), blocks, Documents(cu_q, cu_k, max_q, max_k), BLOCK, SCALE)
    grad_out = torch.randn(q.shape, generator=generator).to("cuda", dtype)
    grad_lse = torch.randn(q.shape[:2], generator=generator).cuda() if with_grad_lse else None
    return (grad_out, q, k, v, out.to(dtype), lse, blocks, cu_q, cu_k, max_q, max_k), grad_lse


def _sm90(args, grad_lse=None, plan=None, *fragment_tensors, deterministic=False):
    from torch_msa.sm90 import backward_deterministic, backward_host

    host = backward_deterministic if deterministic else backward_host
    return host.backward(*backend_arguments("backward", *args, BLOCK, SCALE, grad_lse, plan, *fragment_tensors))


def _reference(args, grad_lse=None, *fragment_tensors):
    grad_out, q, k, v, out, lse, *rest = args
    grads = reference.backward(*backend_arguments("backward", grad_out.float(), q.float(), k.float(), v.float(), out.float(),
                                                  lse, *rest, BLOCK, SCALE, grad_lse, None, *fragment_tensors))
    return tuple(g.to(q.dtype) for g in grads)


def _check(got, want, rows=None):
    """Relative errors of dq (restricted to `rows` when given), dk and dv."""
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        if rows is not None:
            g, w = g[rows[name]], w[rows[name]]
        assert torch.isfinite(g).all(), f"{name} holds non-finite values"
        error = (g.float() - w.float()).norm() / w.float().norm().clamp(min=1e-6)
        # P and dS enter the tensor cores rounded to 16 bits: errors of about 2^-8 relative; a
        # key block missed or counted twice moves a gradient by percents.
        assert error < 2e-2, f"{name}: relative error {error:.2e}"


DETERMINISTIC = pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])


@DETERMINISTIC
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@REFERENCE_LAYOUTS
def test_matches_reference(q_lens, k_lens, dtype, deterministic):
    args, _ = _problem(q_lens, k_lens, dtype)
    _check(_sm90(args, deterministic=deterministic), _reference(args))


def test_grad_lse_enters_delta():
    args, grad_lse = _problem([900, 600], [900, 600], seed=1, with_grad_lse=True)
    _check(_sm90(args, grad_lse), _reference(args, grad_lse))


def test_skewed_selection_splits_hot_blocks():
    """Every query reads block 0: its bucket is split over many items, whose dK/dV add up."""
    args, _ = _problem([3000, 2100], [3000, 2100], selection="skewed", seed=2)
    _check(_sm90(args), _reference(args))


def test_junk_ids_are_ignored():
    """Negative, beyond-horizon, huge and repeated ids add nothing and touch nothing out of bounds."""
    args, _ = _problem([700, 513], [700, 513], seed=5)
    blocks = args[6]
    blocks = with_junk_ids(blocks)
    args = (*args[:6], blocks, *args[7:])
    _check(_sm90(args), _reference(args))


@DETERMINISTIC
def test_nan_in_one_document_stays_there(deterministic):
    """A NaN document's neighbours, whose last key blocks run into its keys, stay finite and exact."""
    lens = [200, 300, 333]
    args, _ = _problem(lens, lens, seed=3)
    want = _reference(args)
    for x in args[:4]:
        x[200:500] = math.nan
    got = _sm90(args, deterministic=deterministic)
    clean = torch.cat([torch.arange(0, 200), torch.arange(500, 833)]).cuda()
    _check(got, want, rows={"dq": clean, "dk": clean, "dv": clean})
    assert torch.isnan(got[0][200:500]).all()


@DETERMINISTIC
def test_nan_in_one_output_gradient_row_stays_in_its_dq_row(deterministic):
    """NaN in dO at one (query, head) makes that row of dQ NaN and no other: the fixed-point
    variant refuses the row through its scale, leaving the rows it shares tiles and key blocks
    with exact; the other document's dK and dV stay finite."""
    args, _ = _problem([600, 500], [600, 500], seed=15)
    grad_out, *rest = args
    token, head = 450, 21
    grad_out[token, head, 7] = math.nan
    got = _sm90((grad_out, *rest), deterministic=deterministic)
    want = _reference((grad_out, *rest))
    nan_rows = torch.isnan(got[0]).any(dim=-1)
    assert torch.isnan(got[0][token, head]).all()
    assert nan_rows.sum().item() == 1, f"{nan_rows.sum().item()} rows of dq hold NaN, expected 1"
    clean = ~nan_rows
    error = (got[0][clean].float() - want[0][clean].float()).norm() / want[0][clean].float().norm()
    assert error < 2e-2, f"dq: relative error {error:.2e}"
    for name, grad in zip(("dk", "dv"), got[1:]):
        assert torch.isfinite(grad[600:]).all(), f"{name} of the other document holds non-finite values"


def test_deterministic_dq_keeps_its_precision_beside_an_outlier_key():
    """A key 1000x the others in K and V widens the fixed-point bound of the rows that select its
    block a millionfold: those rows, too coarse in fixed point, are recomputed query-outer, and the
    others keep theirs (their bounds do not see the block). Either way each row's dQ lies as close
    to fp32's as the default backward's."""
    args, _ = _problem([1500, 600], [1500, 600], seed=16)
    grad_out, q, k, v, out, lse, blocks, *documents = args
    outlier, outlier_block = 1500 + 300, 300 // BLOCK  # in the second document
    k, v = k.clone(), v.clone()
    k[outlier] *= 1000
    v[outlier] *= 1000
    want_out, want_lse = reference.forward(q.float(), k.float(), v.float(), blocks, Documents(*documents), BLOCK,
                                           SCALE)
    args = (grad_out, q, k, v, want_out.to(q.dtype), want_lse, blocks, *documents)
    fp32 = reference.backward(*backend_arguments("backward", grad_out.float(), q.float(), k.float(), v.float(),
                                                 want_out, want_lse, blocks, *documents, BLOCK, SCALE, None, None))[0]
    # Rows of the second document that select the outlier's block on their KV head (by its
    # document-local id: rows of the first document with that id read their own block).
    tokens = torch.arange(q.shape[0], device="cuda")
    selects = (blocks == outlier_block).any(dim=-1).T.repeat_interleave(HQ // HKV, dim=1)  # [T, Hq]
    selects &= (tokens >= 1500)[:, None]
    row_scale = fp32.abs().amax(dim=-1)
    counted = row_scale > row_scale.median() / 1000
    assert (selects & counted).sum() > 1000 and (~selects & counted).sum() > q.shape[0] * HQ // 2

    def row_errors(deterministic):
        dq = _sm90(args, deterministic=deterministic)[0]
        assert torch.isfinite(dq).all()
        return (dq.float() - fp32).abs().amax(dim=-1) / row_scale

    default, deterministic = row_errors(False), row_errors(True)
    away, near = ~selects & counted, selects & counted
    assert deterministic[away].max() <= 2 * default[away].max(), (deterministic[away].max(), default[away].max())
    assert deterministic[near].median() <= 2 * default[near].median(), (deterministic[near].median(),
                                                                        default[near].median())


@pytest.mark.parametrize("entries", [7, 128])
def test_given_plans_of_any_item_size(entries):
    from torch_msa.plan import kernels as plan_kernel

    args, _ = _problem([1000, 1500], [1000, 1500], seed=7)
    plan = plan_kernel.plan(args[6], documents_of(args[7], args[8]), args[2].shape[0], BLOCK, entries)
    _check(_sm90(args, None, plan), _reference(args))


def test_fragments_match_reference():
    """A context-parallel rank's share: chunks of documents as query fragments over their keys."""
    frag = fragments((4096, 2048, 1), ((0, 0, 1024), (0, 3072, 1024), (1, 500, 700), (2, 0, 1)), "cuda")
    generator = torch.Generator().manual_seed(8)
    tq, tk = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to("cuda", torch.bfloat16)

    q, k, v, grad_out = tensor(tq, HQ, D), tensor(tk, HKV, D), tensor(tk, HKV, D), tensor(tq, HQ, D)
    blocks = random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, HKV, TOPK, BLOCK, generator,
                                  *frag.tensors).cuda()
    out, lse = reference.forward(*backend_arguments("forward", q.float(), k.float(), v.float(), blocks, *frag.op_args, BLOCK,
                                                    SCALE, None, *frag.tensors))
    args = (grad_out, q, k, v, out.to(q.dtype), lse, blocks, *frag.op_args)
    _check(_sm90(args, None, None, *frag.tensors), _reference(args, None, *frag.tensors))


def test_long_document_matches_triton():
    """16K queries: the reference would gather too much, so the Triton backward is the oracle."""
    from torch_msa.triton.backward import backward as triton_backward

    generator = torch.Generator().manual_seed(6)
    n = 16384
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    q, grad_out = (torch.randn(n, HQ, D, generator=generator).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(n, HKV, D, generator=generator).to("cuda", torch.bfloat16) for _ in range(2))
    blocks = random_block_indices(cu, cu, HKV, TOPK, BLOCK, generator=generator).cuda()
    from torch_msa.triton.forward import forward as triton_forward

    out, lse = triton_forward(q, k, v, blocks, Documents(cu, cu, n, n), BLOCK, SCALE)
    args = (grad_out, q, k, v, out, lse, blocks, cu, cu, n, n)
    _check(_sm90(args), triton_backward(*backend_arguments("backward", *args, BLOCK, SCALE)))


@DETERMINISTIC
def test_cuda_graph_replay_matches_eager(deterministic):
    """No host sync: delta, the row scales, the schedule, the blocks kernel and the casts replay
    from a CUDA graph. Atomics make the default's last bits order-dependent, so its replay is
    compared with a tolerance; the deterministic variant's replay is the eager bits."""
    args, _ = _problem([900, 400], [900, 400], seed=4)
    eager = _sm90(args, deterministic=deterministic)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _sm90(args, deterministic=deterministic)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        if deterministic:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_sm90_serves_backward_by_default(monkeypatch):
    import torch_msa

    cuda = torch.device("cuda")
    monkeypatch.delenv(torch_msa.BACKEND_ENV, raising=False)
    assert torch_msa.resolve("backward", cuda).name == "sm90"
    args, _ = _problem([1500], [1500], seed=11)
    got = torch.ops.msa.backward(*args, BLOCK, SCALE, None)
    _check(got, _reference(args))


def test_deterministic_gradients_of_a_document_are_bitwise_the_same_alone_and_packed(monkeypatch):
    """Batch invariance in deterministic mode: a document's dq, dk and dv do not depend on the
    documents packed beside it (each bucket holds one document's queries, summed in item order)."""
    import torch_msa

    monkeypatch.delenv(torch_msa.BACKEND_ENV, raising=False)
    lens = [700, 1500, 129, 1000]
    (grad_out, q, k, v, out, lse, blocks, cu_q, cu_k, max_q, max_k), _ = _problem(lens, lens, selection="skewed",
                                                                                  seed=4)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        packed = torch.ops.msa.backward(grad_out, q, k, v, out, lse, blocks, cu_q, cu_k, max_q, max_k, BLOCK, SCALE,
                                        None)
        for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            cu = torch.tensor([0, end - start], dtype=torch.int32, device="cuda")
            rows = slice(start, end)
            alone = torch.ops.msa.backward(grad_out[rows], q[rows], k[rows], v[rows], out[rows], lse[rows],
                                           blocks[:, rows].contiguous(), cu, cu, end - start, end - start, BLOCK,
                                           SCALE, None)
            for name, a, b in zip(("dq", "dk", "dv"), alone, packed):
                assert torch.equal(a, b[rows]), (name, start, end)
    finally:
        torch.use_deterministic_algorithms(was)


def test_deterministic_mode_is_bitwise_reproducible(monkeypatch):
    """Under `torch.use_deterministic_algorithms(True)` the backend serves its deterministic variant
    (the kernel adding dQ in fixed point and storing dK/dV per item, the Triton reduction and cast):
    two runs agree bit for bit, and with the reference; the skewed selection splits hot blocks."""
    import torch_msa

    monkeypatch.delenv(torch_msa.BACKEND_ENV, raising=False)
    args, _ = _problem([2000, 1100], [2000, 1100], selection="skewed", seed=12)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = torch.ops.msa.backward(*args, BLOCK, SCALE, None)
        second = torch.ops.msa.backward(*args, BLOCK, SCALE, None)
    finally:
        torch.use_deterministic_algorithms(was)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    _check(first, _reference(args))


def test_deterministic_bits_do_not_depend_on_the_grid(monkeypatch):
    """Three CTAs walk the items in another order and interleaving than one per SM: the fixed-point
    dQ sums and the item-ordered dK/dV come out the same."""
    from torch_msa.sm90 import backward_host

    args, _ = _problem([1500, 700], [1500, 700], selection="skewed", seed=13)
    full = _sm90(args, deterministic=True)
    monkeypatch.setattr(backward_host, "sm_count", lambda device: 3)
    few = _sm90(args, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), full, few):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("exponent", [40, -40])
def test_deterministic_gradients_scale_exactly_with_the_output_gradient(exponent):
    """The row scales follow the output gradient by its power of two, so the fixed-point sums are
    the same integers and every gradient scales exactly."""
    args, _ = _problem([1100, 300], [1100, 300], seed=14)
    grad_out, *rest = args
    base = _sm90(args, deterministic=True)
    scaled = _sm90((grad_out * 2.0**exponent, *rest), deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), base, scaled):
        assert torch.isfinite(a).all() and torch.equal(a * 2.0**exponent, b), name


def test_training_step_compiles_into_one_graph(monkeypatch):
    """Selection-free training step (forward + backward through autograd) under
    `torch.compile(fullgraph=True)`, with the SM90 kernels serving both directions."""
    import torch_msa

    monkeypatch.delenv(torch_msa.BACKEND_ENV, raising=False)
    args, _ = _problem([1200, 800], [1200, 800], seed=9)
    grad_out, q, k, v, _, _, blocks, cu_q, cu_k, max_q, max_k = args

    def step(q, k, v):
        out, _ = torch.ops.msa.forward(q, k, v, blocks, cu_q, cu_k, max_q, max_k, BLOCK, SCALE)
        return (out.float() * grad_out.float()).sum()

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(*leaves).backward()
    _check(tuple(x.grad for x in leaves), _reference(args))


def test_opcheck_through_the_sm90_kernel(monkeypatch):
    """Schema, fake kernel (shapes and strides) and AOT dispatch agree with the kernel's outputs."""
    import torch_msa

    monkeypatch.setenv(torch_msa.BACKEND_ENV, "sm90")
    args, _ = _problem([300, 1, 200], [300, 1, 200], seed=10)
    # Atomics reorder the last bits between the runs opcheck compares; its default tolerances
    # for bf16 cover that.
    torch.library.opcheck(torch.ops.msa.backward.default, (*args, BLOCK, SCALE, None))
