"""torch.compile: one graph, no graph break, no recompile across sequence lengths; same numbers."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import torch_msa
from torch_msa.testing import cu_seqlens


def _loss(q, k, v, index_q, index_k, cu_q, cu_k, max_q, max_k):
    out, lse = torch_msa.sparse_attention(
        q, k, v, torch_msa.select_blocks(index_q, index_k, cu_q, cu_k, max_q, max_k, topk=2, block_size=64),
        cu_q, cu_k, max_q, max_k, block_size=64, return_lse=True,
    )
    return (out.float() ** 2).sum() + lse.sum()


def _inputs(q_lens, k_lens):
    cu_q, cu_k = cu_seqlens(q_lens, k_lens)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    tensors = [torch.randn(tq, 4, 64), torch.randn(tk, 2, 64), torch.randn(tk, 2, 64)]
    leaves = [t.requires_grad_() for t in tensors]
    return [*leaves, torch.randn(tq, 2, 32), torch.randn(tk, 1, 32), cu_q, cu_k, max(q_lens), max(k_lens)]


def _value_and_grads(fn, inputs):
    inputs = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
    loss = fn(*inputs)
    loss.backward()
    return [loss.detach()] + [x.grad for x in inputs[:3]]


PACKS = [([120, 80], [150, 80]), ([90, 0, 243], [150, 7, 243]), ([1, 400, 116], [1, 400, 130])]


def test_one_graph_no_recompile_across_lengths():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss, backend=counter, fullgraph=True, dynamic=True)
    for q_lens, k_lens in PACKS:
        inputs = _inputs(q_lens, k_lens)
        for got, want in zip(_value_and_grads(compiled, inputs), _value_and_grads(_loss, inputs)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(PACKS)} sequence lengths"
    targets = " ".join(str(node.target) for node in counter.graphs[0].graph.nodes if node.op == "call_function")
    assert "msa.select_blocks" in targets and "msa.forward" in targets


def _loss_from_named_fields(q, k, v, index_q, index_k, cu_q, cu_k, max_q, max_k):
    docs = (cu_q, cu_k, max_q, max_k)
    attn = torch_msa.msa_attention(q, k, v, index_q, index_k, *docs, topk=2, block_size=64, return_lse=True,
                                   return_block_indices=True)
    again = torch_msa.sparse_attention(q, k, v, attn.block_indices, *docs, block_size=64, return_lse=True)
    kl = torch_msa.indexer_kl_loss(q, k, attn.lse, index_q, index_k, attn.block_indices, *docs, block_size=64)
    return (attn.out.float() ** 2).sum() + attn.lse.sum() + (again.out.float() - again.lse[..., None]).sum() + kl


def test_named_output_fields_trace_in_one_graph():
    """msa_attention's and sparse_attention's named fields feed the loss inside one fullgraph graph."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss_from_named_fields, backend=counter, fullgraph=True, dynamic=True)
    for q_lens, k_lens in PACKS[:2]:
        inputs = _inputs(q_lens, k_lens)
        for got, want in zip(_value_and_grads(compiled, inputs), _value_and_grads(_loss_from_named_fields, inputs)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1


def _loss_with_index_loss(q, k, v, index_q, index_k, cu_q, cu_k, max_q, max_k, loss_value=None):
    attn = torch_msa.msa_attention(q, k, v, index_q, index_k, cu_q, cu_k, max_q, max_k, topk=2, block_size=64,
                                   index_loss=True, index_loss_value=loss_value)
    return (attn.out.float() ** 2).sum() + 0.5 * attn.kl


@pytest.mark.parametrize("fused", [True, False], ids=["loss-value-given", "no-loss-value"])
def test_index_loss_traces_in_one_graph_with_the_same_gradients(fused):
    """msa_attention(..., index_loss=True): select, attention and KL in one fullgraph graph; the
    task loss and the KL reach q, k, v and the index inputs as eagerly. With a loss value tensor
    from outside the compiled function the graph holds the fused node, whose backward writes the
    loss into it as the eager call's does; without one, the separate loss."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_loss_with_index_loss, backend=counter, fullgraph=True, dynamic=True)
    for q_lens, k_lens in PACKS[:2]:
        inputs = _inputs(q_lens, k_lens)
        inputs[3].requires_grad_()
        inputs[4].requires_grad_()
        results, values = [], []
        # The eager call always takes the fused node (a sink given, to read its value).
        for fn, loss_value in ((compiled, torch.zeros(()) if fused else None), (_loss_with_index_loss, torch.zeros(()))):
            leaves = [x.detach().clone().requires_grad_() for x in inputs[:5]]
            loss = fn(*leaves, *inputs[5:], loss_value)
            grads = torch.autograd.grad(loss, leaves)
            # A fused node's loss holds the placeholder 0; the backward writes the value.
            total = loss.detach() if loss_value is None else loss.detach() + 0.5 * loss_value
            results.append([total, *grads])
            values.append(loss_value)
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert results[1][4].abs().sum() > 0 and results[1][5].abs().sum() > 0  # the index inputs' gradients
        assert values[1].item() > 0
        if fused:
            torch.testing.assert_close(values[0], values[1], rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1
    targets = " ".join(str(node.target) for node in counter.graphs[0].graph.nodes if node.op == "call_function")
    assert ("msa.forward_with_index_loss" if fused else "msa.indexer_kl") in targets


def test_a_compiled_function_unpacks_and_returns_the_results_as_asked():
    """Inside one fullgraph graph a result unpacks into the fields asked for, and a compiled
    function returns the eager call's named tuples, of the same types, field for field."""

    def attention(q, k, v, index_q, index_k):
        out, lse = torch_msa.msa_attention(q, k, v, index_q, index_k, topk=2, block_size=64, return_lse=True)
        with_loss = torch_msa.msa_attention(q, k, v, index_q, index_k, topk=2, block_size=64,
                                            return_block_indices=True, index_loss=True)
        return out * 2, lse, with_loss

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    args = [x.detach() for x in _inputs([300], [300])[:5]]
    got = torch.compile(attention, backend=counter, fullgraph=True)(*args)
    want = attention(*args)
    assert [type(x) for x in got] == [torch.Tensor, torch.Tensor, torch_msa.MSABlocksIndexLossOutput]
    for got_field, want_field in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want),
                                     strict=True):
        torch.testing.assert_close(got_field, want_field, rtol=0, atol=0)
    assert got[2].kl.item() > 0 and counter.frame_count == 1


def test_one_document_defaults_trace_symbolically():
    """No cu_seqlens: the API builds [0, T] from the symbolic length without a recompile."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def fn(q, k, v, iq, ik):
        return torch_msa.msa_attention(q, k, v, iq, ik, topk=2, block_size=64)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for length in (130, 257, 400):
        args = (torch.randn(length, 4, 64), torch.randn(length, 2, 64), torch.randn(length, 2, 64),
                torch.randn(length, 2, 32), torch.randn(length, 1, 32))
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=0, atol=0)
    assert counter.frame_count == 1


@pytest.mark.slow
def test_inductor_matches_eager():
    torch._dynamo.reset()
    inputs = _inputs([90, 0, 243], [150, 7, 243])
    compiled = torch.compile(_loss, fullgraph=True, dynamic=True)
    for got, want in zip(_value_and_grads(compiled, inputs), _value_and_grads(_loss, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_backend_resolution_happens_at_run_time(monkeypatch):
    """The backend is chosen when the op runs, so the env var takes effect without recompiling."""
    calls = []
    original = torch_msa.backends._BACKENDS["reference"]

    def counting_forward(*args):
        calls.append("spy")
        return original.ops["forward"](*args)

    spy = torch_msa.Backend("spy", {"forward": counting_forward}, priority=-1)
    torch_msa.register_backend(spy)
    try:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")

        def fn(q, k, v, block_indices):
            return torch_msa.sparse_attention(q, k, v, block_indices, block_size=64)

        compiled = torch.compile(fn, backend=counter, fullgraph=True)
        args = (torch.randn(100, 2, 64), torch.randn(100, 1, 64), torch.randn(100, 1, 64),
                torch.zeros(1, 100, 1, dtype=torch.int32))
        compiled(*args)
        assert calls == []
        monkeypatch.setenv(torch_msa.BACKEND_ENV, "spy")
        compiled(*args)
        assert calls == ["spy"] and counter.frame_count == 1
    finally:
        torch_msa.backends.unregister_backend("spy")


def _compile_error(fn, *args) -> str:
    """The message of the error that compiling `fn` on `args` raises."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    try:
        compiled(*args)
    except Exception as error:  # noqa: BLE001  (Dynamo wraps the op's ValueError in its own types)
        return str(error)
    raise AssertionError("no error")


def test_bad_shapes_under_dynamic_shapes_show_concrete_values():
    def attention(q, k, v, block_indices):
        return torch_msa.sparse_attention(q, k, v, block_indices, block_size=64)

    message = _compile_error(attention, torch.randn(120, 4, 96), torch.randn(120, 2, 96), torch.randn(120, 2, 96),
                             torch.zeros(2, 120, 1, dtype=torch.int32))
    assert "q: expected head dim D in (64, 128), got 96 (shape [120, 4, 96])" in message, message

    def msa(q, k, v, index_q, index_k):
        return torch_msa.msa_attention(q, k, v, index_q, index_k, topk=2, block_size=64)

    message = _compile_error(msa, torch.randn(110, 4, 64), torch.randn(110, 2, 64), torch.randn(110, 2, 64),
                             torch.randn(110, 2, 16), torch.randn(109, 1, 16))
    assert "index_k: expected Tk = 110 rows (the rows of k), got 109 (shape [109, 1, 16])" in message, message


def test_max_seqlen_from_item_inside_the_compiled_region():
    """A data-dependent max_seqlen is accepted (checked when the graph runs, not guarded on)."""

    def fn(q, k, v, index_q, index_k, cu_q, cu_k):
        max_q = (cu_q[1:] - cu_q[:-1]).max().item()
        max_k = (cu_k[1:] - cu_k[:-1]).max().item()
        return torch_msa.msa_attention(q, k, v, index_q, index_k, cu_q, cu_k, max_q, max_k, topk=2, block_size=64)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    inputs = _inputs([90, 0, 243], [150, 7, 243])
    args = [x.detach() for x in inputs[:5]] + inputs[5:7]
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)(*args)
    torch.testing.assert_close(got, fn(*args), rtol=0, atol=0)
    assert counter.frame_count == 1
