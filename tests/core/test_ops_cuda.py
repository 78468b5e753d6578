"""CUDA: the ops on a GPU through the registry (the Triton backend where it serves, else the
reference), compared with the CPU reference. Skipped without CUDA; run on the H200 before
resolving GPU work."""

import warnings

import pytest
import torch

import torch_msa
from tests.support.opcheck_samples import run, samples
from torch_msa.testing import cu_seqlens

pytestmark = pytest.mark.cuda


def _m3_inputs(device, dtype=torch.bfloat16):
    cu_q, cu_k = cu_seqlens([1500, 700, 1, 300], [2600, 700, 1, 300], device=device)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    generator = torch.Generator(device="cpu").manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    return dict(q=tensor(tq, 64, 128), k=tensor(tk, 4, 128), v=tensor(tk, 4, 128), index_q=tensor(tq, 4, 128),
                index_k=tensor(tk, 1, 128), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1500, max_seqlen_k=2600)


_DOCS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _attention(inputs, block_indices):
    """out, lse and the gradients of sum(out) with respect to q, k, v."""
    leaves = [inputs[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    out, lse = torch_msa.sparse_attention(*leaves, block_indices, *(inputs[n] for n in _DOCS), return_lse=True)
    out.float().sum().backward()
    return [out, lse] + [x.grad for x in leaves]


def test_cuda_matches_cpu_at_m3_shapes():
    gpu_inputs = _m3_inputs("cuda")
    cpu_inputs = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in gpu_inputs.items()}
    docs = [gpu_inputs[n] for n in _DOCS]
    selected_gpu = torch_msa.select_blocks(gpu_inputs["index_q"], gpu_inputs["index_k"], *docs).cpu()
    selected_cpu = torch_msa.select_blocks(cpu_inputs["index_q"], cpu_inputs["index_k"],
                                           *(cpu_inputs[n] for n in _DOCS))
    agree = (selected_gpu.sort(-1).values == selected_cpu.sort(-1).values).all(-1).float().mean()
    assert agree > 0.999, f"selections agree on only {agree:.4%} of rows"
    # Attention on one selection, so that a near-tie cannot move a whole row.
    gpu = _attention(gpu_inputs, selected_cpu.cuda())
    cpu = _attention(cpu_inputs, selected_cpu)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), gpu, cpu):
        torch.testing.assert_close(got.cpu().float(), want.float(), atol=2e-2, rtol=2e-2,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_cuda_graph_capture_without_host_sync():
    inputs = _m3_inputs("cuda")
    docs = [inputs[n] for n in _DOCS]
    q, k, v = (inputs[n] for n in ("q", "k", "v"))

    def step():
        block_indices = torch.ops.msa.select_blocks(inputs["index_q"], inputs["index_k"], *docs, 16, 128)
        out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, 128, 128**-0.5)
        grads = torch.ops.msa.backward(out, q, k, v, out, lse, block_indices, *docs, 128, 128**-0.5)
        return (block_indices, out, lse, *grads)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on a side stream, as graph capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    # Selection, out and lse are computed without atomics: bitwise equal. The gradients are
    # accumulated with atomics, which may add in another order.
    for got, want in zip(captured[:3], eager[:3]):
        assert torch.equal(got, want)
    for got, want in zip(captured[3:], eager[3:]):
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_compile_reduce_overhead():
    inputs = _m3_inputs("cuda")

    def fn(q, k, v, index_q, index_k, cu_seqlens_q, cu_seqlens_k):
        return torch_msa.msa_attention(q, k, v, index_q, index_k, cu_seqlens_q, cu_seqlens_k, 1500, 2600)

    args = [inputs[n] for n in ("q", "k", "v", "index_q", "index_k", "cu_seqlens_q", "cu_seqlens_k")]
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    expected = fn(*args)
    for _ in range(3):
        got = compiled(*args)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_compile_reduce_overhead_training_step():
    """A whole step (selection, forward, backward) through `torch.compile(mode="reduce-overhead")`:
    CUDA graphs serve the forward and the backward (no graph skipped), and the step equals eager."""
    from torch._dynamo.utils import counters

    inputs = _m3_inputs("cuda")
    weight = torch.randn(inputs["q"].shape, generator=torch.Generator().manual_seed(1)).to("cuda")

    def loss_of(q, k, v, index_q, index_k, cu_seqlens_q, cu_seqlens_k):
        out = torch_msa.msa_attention(q, k, v, index_q, index_k, cu_seqlens_q, cu_seqlens_k, 1500, 2600)
        return (out.float() * weight).sum()

    def step(fn):
        leaves = [inputs[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
        loss = fn(*leaves, *(inputs[n] for n in ("index_q", "index_k", "cu_seqlens_q", "cu_seqlens_k")))
        return [loss.detach().clone(), *(g.clone() for g in torch.autograd.grad(loss, leaves))]

    expected = step(loss_of)
    counters.clear()
    compiled = torch.compile(loss_of, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        got = step(compiled)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    torch.testing.assert_close(got[0], expected[0], atol=1e-2, rtol=1e-4)
    for g, e in zip(got[1:], expected[1:]):  # dQ, dK, dV are added with atomics
        torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2)


MATRIX = samples("cuda") if torch.cuda.is_available() else []


@pytest.mark.parametrize("sample", MATRIX, ids=[s.name for s in MATRIX])
def test_opcheck_cuda(sample):
    run(sample)


def test_deterministic_mode_gives_identical_gradients():
    """Under torch.use_deterministic_algorithms(True) the Triton backend serves the backward with
    its deterministic kernels, without a fallback warning: two training steps agree bitwise."""
    inputs = _m3_inputs("cuda")
    docs = [inputs[n] for n in _DOCS]
    block_indices = torch_msa.select_blocks(inputs["index_q"], inputs["index_k"], *docs)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch_msa.backends._warned.clear()  # a fallback warning is printed once per process
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="torch_msa")
            first = _attention(inputs, block_indices)
            second = _attention(inputs, block_indices)
    finally:
        torch.use_deterministic_algorithms(previous)
    for got, want in zip(first, second):
        assert torch.equal(got, want)
