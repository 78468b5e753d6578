"""The Triton backend at M3 shapes against the reference. Skipped without CUDA; run on
the H200 before resolving kernel work.

Tolerances: bf16 inputs, fp32 accumulation on both sides; outputs and gradients are compared by
relative Frobenius error (`||got - want|| / ||want||`), which is about 1e-3 for bf16 rounding and
grows to O(1) for any wrong row, so 1e-2 separates the two.
"""

import contextlib
import warnings

import pytest
import torch

import torch_msa
from benchmarks.problems import tile_shared
from tests.support.determinism import deterministic_algorithms
from tests.support.documents import backend_arguments
from torch_msa import backends, reference
from torch_msa.plan.schedule import entries_per_item
from torch_msa.settings import QUERY_OUTER_ENV
from torch_msa.testing import cu_seqlens, fragments, random_block_indices, skewed_block_indices

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("junk_in_uninitialized_buffers")]

M3 = dict(num_heads=64, num_kv_heads=4, dim=128, block_size=128, topk=16)
LAYOUTS = {
    "1K": ([1024], [1024]),
    "4K": ([4096], [4096]),
    "16K": ([16384], [16384]),
    "pack": ([1000, 3000, 77, 1, 2178], [1000, 3000, 77, 1, 2178]),
    "suffix-pack": ([700, 129, 2000], [2600, 129, 2000]),
}


def _inputs(layout, seed=0):
    q_lens, k_lens = LAYOUTS[layout]
    cu_q, cu_k = cu_seqlens(q_lens, k_lens, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])

    def tensor(*shape):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    h, hkv, d = M3["num_heads"], M3["num_kv_heads"], M3["dim"]
    return dict(q=tensor(tq, h, d), k=tensor(tk, hkv, d), v=tensor(tk, hkv, d), index_q=tensor(tq, hkv, 128),
                index_k=tensor(tk, 1, 128), docs=(cu_q, cu_k, max(q_lens), max(k_lens)))


def _relative_error(got, want):
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


def _selections(layout, inputs, kind):
    cu_q, cu_k = inputs["docs"][:2]
    if kind == "index":
        return torch.ops.msa.select_blocks(inputs["index_q"], inputs["index_k"], *inputs["docs"], 16, 128)
    if kind == "skewed":
        return skewed_block_indices(cu_q, cu_k, 4, 16, 128)
    return random_block_indices(cu_q, cu_k, 4, 16, 128).cuda()


def test_the_triton_backend_serves_cuda():
    """Every op but those the SM90 CuTe kernels serve where they are available."""
    from torch_msa import sm90

    cuda = torch.device("cuda")
    for op in backends.OPS:
        want = "sm90" if op in sm90.BACKEND.ops and sm90.available(cuda) else "triton"
        assert torch_msa.resolve(op, cuda).name == want


@pytest.mark.parametrize("layout", ["1K", "4K", "16K", "pack", "suffix-pack"])
def test_selection_matches_reference(layout):
    inputs = _inputs(layout)
    args = (inputs["index_q"], inputs["index_k"], *inputs["docs"], 16, 128)
    got = torch.ops.msa.select_blocks(*args)
    want = reference.select_blocks(*backend_arguments("select_blocks", *args))
    # Valid ids form a prefix and the contract fixes their count and the local block exactly.
    assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1))
    same_set = (got.sort(-1).values == want.sort(-1).values).all(-1)
    assert same_set.float().mean() > 0.999, f"only {same_set.float().mean():.4%} of rows agree"


@pytest.mark.parametrize("kind", ["index", "random", "skewed"])
@pytest.mark.parametrize("layout", ["1K", "4K", "16K", "pack", "suffix-pack"])
def test_attention_matches_reference(layout, kind):
    inputs = _inputs(layout)
    block_indices = _selections(layout, inputs, kind)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    args = (block_indices, *inputs["docs"], 128, 128**-0.5)
    out, lse = torch.ops.msa.forward(q, k, v, *args)
    out_ref, lse_ref = reference.forward(*backend_arguments("forward", q, k, v, *args))
    assert _relative_error(out, out_ref) < 1e-2
    assert (lse - lse_ref).abs().max().item() < 1e-3
    grad_out = torch.randn_like(q)
    grad_lse = torch.randn_like(lse)
    got = torch.ops.msa.backward(grad_out, q, k, v, out_ref, lse_ref, *args, grad_lse)
    want = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, grad_lse))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        error = _relative_error(g, w)
        assert error < 1e-2, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("kind", ["index", "skewed", "tiled"])
@pytest.mark.parametrize("layout", ["4K", "pack", "suffix-pack"])
def test_the_query_outer_forward_matches_reference(layout, kind, monkeypatch):
    """`TORCH_MSA_QUERY_OUTER=1`: the Triton forward runs the blocks its query groups share
    query-outer, the rest KV-outer: in a plan of its own (4K) or in the given plan restricted to
    them (the packs)."""
    import torch_msa
    import torch_msa.triton.interface as triton_backend
    from torch_msa.stages import query_outer

    inputs = _inputs(layout)
    block_indices = _selections(layout, inputs, "index" if kind == "tiled" else kind)
    if kind == "tiled":
        block_indices = tile_shared(block_indices, inputs["docs"][0], M3["block_size"])
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    plan = None if layout == "4K" else torch_msa.build_plan(block_indices, *inputs["docs"], num_keys=k.shape[0],
                                                            num_heads=q.shape[1], block_size=128)
    args = backend_arguments("forward", q, k, v, block_indices, *inputs["docs"], 128, 128**-0.5, plan)
    monkeypatch.setenv(QUERY_OUTER_ENV, "1")
    kv_outer = query_outer.split_forward(q, block_indices, args[4], k.shape[0], 128, None)[0]
    share = ((kv_outer < 0) & (block_indices >= 0)).sum().item() / max(1, (block_indices >= 0).sum().item())
    assert share > (0.5 if kind == "tiled" else 0.0), share
    out, lse = triton_backend.forward(*args)
    out_ref, lse_ref = reference.forward(*args)
    assert _relative_error(out, out_ref) < 1e-2
    assert (lse - lse_ref).abs().max().item() < 1e-3


def test_out_of_contract_ids_read_nothing_out_of_bounds():
    inputs = _inputs("pack")
    block_indices = _selections("pack", inputs, "random")
    block_indices[0, :, 3] = 1 << 30
    block_indices[1, :, 2] = -(1 << 30)
    block_indices[2, :, 1] = block_indices[2, :, 0]
    args = (block_indices, *inputs["docs"], 128, 128**-0.5)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    out, lse = torch.ops.msa.forward(q, k, v, *args)
    out_ref, lse_ref = reference.forward(*backend_arguments("forward", q, k, v, *args))
    torch.cuda.synchronize()
    assert _relative_error(out, out_ref) < 1e-2 and (lse - lse_ref).abs().max().item() < 1e-3


def test_unserved_dtype_falls_back_to_the_reference_with_a_warning():
    inputs = _inputs("1K")
    q, k, v = (inputs[n].double() for n in ("q", "k", "v"))
    block_indices = _selections("1K", inputs, "random")
    backends._warned.clear()
    with pytest.warns(UserWarning, match="falling back to 'reference'"):
        out, _ = torch.ops.msa.forward(q, k, v, block_indices, *inputs["docs"], 128, 128**-0.5)
    assert out.dtype == torch.float64


def test_compile_fullgraph_and_cuda_graphs_match_eager():
    inputs = _inputs("pack")

    def step(q, k, v, index_q, index_k):
        out = torch_msa.msa_attention(q, k, v, index_q, index_k, *inputs["docs"])
        return out

    args = [inputs[n] for n in ("q", "k", "v", "index_q", "index_k")]
    expected = step(*args)
    for mode in ("default", "reduce-overhead"):
        compiled = torch.compile(step, mode=mode, fullgraph=True)
        for _ in range(3):
            got = compiled(*args)
        assert torch.equal(got, expected), mode


def test_training_step_under_compile_matches_eager():
    inputs = _inputs("pack")
    leaves = [inputs[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]

    def loss(q, k, v):
        out = torch_msa.msa_attention(q, k, v, inputs["index_q"], inputs["index_k"], *inputs["docs"])
        return out.float().square().mean()

    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*leaves), leaves)
    for g, w in zip(compiled, eager):
        assert _relative_error(g, w) < 1e-3


def test_kernels_run_on_the_current_stream():
    inputs = _inputs("4K")
    block_indices = _selections("4K", inputs, "random")
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    args = (block_indices, *inputs["docs"], 128, 128**-0.5)
    expected, _ = torch.ops.msa.forward(q, k, v, *args)
    late_q = torch.zeros_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # q arrives late on this stream: a kernel launched on any other stream would read zeros.
        torch.cuda._sleep(100_000_000)
        late_q.copy_(q)
        got, _ = torch.ops.msa.forward(late_q, k, v, *args)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("deterministic", [False, True])
def test_memory_stays_linear_in_tokens(deterministic):
    """Forward + backward at 32K: the extra memory is O(T) (no T x T buffer would fit in 2 GB),
    also for the deterministic backward's dK/dV workspace."""
    cu_q, cu_k = cu_seqlens([32768], [32768], "cuda")
    tq = 32768
    q = torch.randn(tq, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(tq, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    block_indices = skewed_block_indices(cu_q, cu_k, 4, 16, 128)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with deterministic_algorithms() if deterministic else contextlib.nullcontext():
        out = torch_msa.sparse_attention(q, k, v, block_indices, cu_q, cu_k, tq, tq)
        out.float().sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    per_token = extra / tq
    # partial outputs (topk x Hq x D bf16 = 256 KiB) dominate; T x T fp32 would be 128 KiB x T per token.
    assert per_token < 600 * 1024, f"{per_token / 1024:.0f} KiB per token"


def test_no_host_sync_inside_the_ops():
    inputs = _inputs("suffix-pack")
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block_indices = torch.ops.msa.select_blocks(inputs["index_q"], inputs["index_k"], *inputs["docs"], 16, 128)
        out, lse = torch.ops.msa.forward(q, k, v, block_indices, *inputs["docs"], 128, 128**-0.5)
        torch.ops.msa.backward(out, q, k, v, out, lse, block_indices, *inputs["docs"], 128, 128**-0.5)
        plan = torch.ops.msa.plan(block_indices, *inputs["docs"], k.shape[0], 128, entries_per_item(64, 4))
        out, lse = torch.ops.msa.forward(q, k, v, block_indices, *inputs["docs"], 128, 128**-0.5, plan)
        torch.ops.msa.backward(out, q, k, v, out, lse, block_indices, *inputs["docs"], 128, 128**-0.5, None, plan)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("poisoned", ["q", "k", "v", "grad_out"])
def test_a_non_finite_document_changes_no_other_document_at_m3_shapes(poisoned):
    """NaN/Inf in one document of the "pack" layout (whose documents end mid-block) leaves every
    other document's outputs and gradients finite and equal to a clean run's (gradients within
    the atomics' reordering)."""
    inputs = _inputs("pack")
    cu_q, cu_k = inputs["docs"][:2]
    block_indices = _selections("pack", inputs, "random")
    args = (block_indices, *inputs["docs"], 128, 128**-0.5)
    poisoned_doc = 1
    clean = dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], grad_out=torch.randn_like(inputs["q"]))
    bounds = (cu_k if poisoned in ("k", "v") else cu_q).tolist()
    dirty = dict(clean)
    dirty[poisoned] = clean[poisoned].clone()
    dirty[poisoned][bounds[poisoned_doc]:bounds[poisoned_doc + 1]:2] = float("nan")
    dirty[poisoned][bounds[poisoned_doc] + 1:bounds[poisoned_doc + 1]:2] = float("inf")

    def run(x):
        out, lse = torch.ops.msa.forward(x["q"], x["k"], x["v"], *args)
        grads = torch.ops.msa.backward(x["grad_out"], x["q"], x["k"], x["v"], out, lse, *args)
        return dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])

    want, got = run(clean), run(dirty)
    query_bounds, key_bounds = cu_q.tolist(), cu_k.tolist()
    for name in want:
        bounds = key_bounds if name in ("dk", "dv") else query_bounds
        for doc in range(len(bounds) - 1):
            if doc == poisoned_doc:
                continue
            part, reference_part = (x[name][bounds[doc]:bounds[doc + 1]].float() for x in (got, want))
            assert part.isfinite().all(), f"{name} of document {doc} is not finite"
            if name in ("out", "lse"):
                assert torch.equal(part, reference_part), f"{name} of document {doc} changed"
            else:
                torch.testing.assert_close(part, reference_part, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["random", "skewed"])
@pytest.mark.parametrize("layout", ["16K", "pack", "suffix-pack"])
def test_plan_equals_the_reference_build(layout, kind):
    """The Triton `msa::plan` writes exactly the pure-PyTorch build's tables, unused rows included."""
    inputs = _inputs(layout)
    block_indices = _selections(layout, inputs, kind)
    block_indices[0, ::5, 3] = block_indices[0, ::5, 0]  # junk: a repeat, a far id, a negative id
    block_indices[1, ::7, 2] = 1 << 30
    block_indices[2, ::3, 1] = -4
    num_keys = inputs["k"].shape[0]
    for items in (8, entries_per_item(64, 4)):
        args = (block_indices, *inputs["docs"], num_keys, 128, items)
        assert torch.equal(torch.ops.msa.plan(*args), reference.plan(*backend_arguments("plan", *args)))


def test_sparse_attention_with_a_shared_plan_matches_reference():
    inputs = _inputs("pack")
    q, k, v = (inputs[name].requires_grad_() for name in ("q", "k", "v"))
    block_indices = _selections("pack", inputs, "index")
    plan = torch_msa.build_plan(block_indices, *inputs["docs"], num_keys=k.shape[0], num_heads=64)
    outs = [torch_msa.sparse_attention(q, k, v, block_indices, *inputs["docs"], plan=plan) for _ in range(2)]
    want = reference.forward(*backend_arguments("forward", q.detach(), k.detach(), v.detach(), block_indices, *inputs["docs"],
                                                128, 128**-0.5))[0]
    for out in outs:
        assert _relative_error(out, want) < 1e-2
    sum(out.float().square().sum() for out in outs).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def _backward_inputs(layout, kind):
    inputs = _inputs(layout)
    block_indices = _selections(layout, inputs, kind)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    args = (block_indices, *inputs["docs"], 128, 128**-0.5)
    out, lse = reference.forward(*backend_arguments("forward", q, k, v, *args))
    generator = torch.Generator(device="cuda").manual_seed(1)
    grad_out = torch.randn(q.shape, generator=generator, device="cuda", dtype=q.dtype)
    grad_lse = torch.randn(lse.shape, generator=generator, device="cuda")
    return [grad_out, q, k, v, out, lse, *args, grad_lse]


def _assert_matches_reference(got, args):
    # The reference runs outside deterministic mode: its cuBLAS GEMMs would need CUBLAS_WORKSPACE_CONFIG.
    for name, g, w in zip(("dq", "dk", "dv"), got, reference.backward(*backend_arguments("backward", *args))):
        error = _relative_error(g, w)
        assert error < 1e-2, f"{name}: relative error {error:.3g}"


@pytest.mark.parametrize("backend", ["triton", "sm90"])
@pytest.mark.parametrize("kind", ["index", "random", "skewed"])
@pytest.mark.parametrize("layout", ["4K", "pack", "suffix-pack"])
def test_deterministic_backward_matches_reference_and_repeats_bitwise(layout, kind, backend, monkeypatch):
    """Under torch.use_deterministic_algorithms(True) the Triton backend serves the backward with
    its deterministic kernels, and the SM90 backend with its deterministic variant (the SM90 kernel
    for dK/dV and the fixed-point dQ, the Triton reduction and cast); no fallback warning: close to
    the reference, and bitwise equal over repeated runs (the skewed selection splits block 0 of
    every document over many items)."""
    from torch_msa import sm90

    cuda = torch.device("cuda")
    if backend == "sm90" and torch.cuda.get_device_capability(cuda) != (9, 0):
        pytest.skip("needs a GPU of compute capability 9.0 (H100 / H200) for the sm90 backend")
    if backend == "sm90" and not sm90.available(cuda):
        pytest.skip(f"the sm90 backend is unavailable: {sm90.unavailable_reason(cuda)}")  # names the install command
    monkeypatch.setenv(torch_msa.BACKEND_ENV, backend)
    args = _backward_inputs(layout, kind)
    assert torch_msa.resolve("backward", cuda).name == backend
    backends._warned.clear()
    with deterministic_algorithms(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch_msa")  # a fallback would warn
        runs = [torch.ops.msa.backward(*args) for _ in range(4)]
    _assert_matches_reference(runs[0], args)
    for again in runs[1:]:
        for name, got, repeated in zip(("dq", "dk", "dv"), runs[0], again):
            assert torch.equal(got, repeated), f"{name} differs between runs"


def test_deterministic_backward_skips_out_of_contract_ids():
    args = _backward_inputs("pack", "random")
    block_indices = args[6].clone()
    block_indices[0, :, 3] = 1 << 30
    block_indices[1, :, 2] = -(1 << 30)
    block_indices[2, :, 1] = block_indices[2, :, 0]
    args[6] = block_indices
    with deterministic_algorithms():
        got = torch.ops.msa.backward(*args)
    torch.cuda.synchronize()
    _assert_matches_reference(got, args)


# A context-parallel rank's share: chunks 0 and 3 of a 8K document, chunks 1 and 2 of a 3K one
# (2 ranks, 4 chunks per document), a 1-token document and the middle of a 2K one.
FRAGMENT_LENGTHS = (8192, 3000, 1, 2048)
FRAGMENT_PIECES = ((0, 0, 2048), (0, 6144, 2048), (1, 750, 1500), (2, 0, 1), (3, 700, 600))


@pytest.mark.parametrize("kind", ["index", "random"])
def test_fragments_match_reference_at_m3_shapes(kind):
    frag = fragments(FRAGMENT_LENGTHS, FRAGMENT_PIECES, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    tq, tk = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])

    def tensor(*shape):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=torch.bfloat16)

    q, k, v = tensor(tq, 64, 128), tensor(tk, 4, 128), tensor(tk, 4, 128)
    index_q, index_k = tensor(tq, 4, 128), tensor(tk, 1, 128)
    select_args = (index_q, index_k, *frag.op_args, 16, 128, *frag.tensors)
    selected = torch.ops.msa.select_blocks(*select_args)
    same_set = (selected.sort(-1).values == reference.select_blocks(*backend_arguments("select_blocks",
                                                                                       *select_args)).sort(-1).values).all(-1)
    assert same_set.float().mean() > 0.999, f"only {same_set.float().mean():.4%} of rows agree"
    block_indices = selected if kind == "index" else random_block_indices(
        frag.cu_seqlens_q, frag.cu_seqlens_k, 4, 16, 128, None, *frag.tensors)
    args = (block_indices, *frag.op_args, 128, 128**-0.5)
    out, lse = torch.ops.msa.forward(q, k, v, *args, None, *frag.tensors)
    out_ref, lse_ref = reference.forward(*backend_arguments("forward", q, k, v, *args, None, *frag.tensors))
    assert _relative_error(out, out_ref) < 1e-2
    assert (lse - lse_ref).abs().max().item() < 1e-3
    grad_out, grad_lse = torch.randn_like(q), torch.randn_like(lse)
    want = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out_ref, lse_ref, *args, grad_lse, None,
                                                 *frag.tensors))
    for mode in (contextlib.nullcontext, deterministic_algorithms):
        with mode():
            got = torch.ops.msa.backward(grad_out, q, k, v, out_ref, lse_ref, *args, grad_lse, None, *frag.tensors)
        for name, g, w in zip(("dq", "dk", "dv"), got, want):
            error = _relative_error(g, w)
            assert error < 1e-2, f"{mode.__name__} {name}: relative error {error:.3g}"
