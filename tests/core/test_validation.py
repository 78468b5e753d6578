"""Bad input raises ValueError/TypeError naming the argument, what was expected and what was given."""

import pytest
import torch

import torch_msa
from tests.support.documents import Documents, documents_of
from torch_msa.testing import cu_seqlens, random_block_indices

T = 150


def _good():
    cu_q, cu_k = cu_seqlens([100, 50])
    return dict(
        q=torch.randn(T, 4, 64), k=torch.randn(T, 2, 64), v=torch.randn(T, 2, 64),
        block_indices=random_block_indices(cu_q, cu_k, 2, 2, 64),
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=100, max_seqlen_k=100,
    )


def _attention(**changes):
    block_size = changes.pop("block_size", 64)
    return torch_msa.sparse_attention(**{**_good(), **changes}, block_size=block_size)


def _select(**changes):
    good = _good()
    args = dict(index_q=torch.randn(T, 2, 32), index_k=torch.randn(T, 1, 32), cu_seqlens_q=good["cu_seqlens_q"],
                cu_seqlens_k=good["cu_seqlens_k"], max_seqlen_q=100, max_seqlen_k=100)
    options = {"topk": changes.pop("topk", 2), "block_size": changes.pop("block_size", 64)}
    return torch_msa.select_blocks(**{**args, **changes}, **options)


ATTENTION_CASES = [
    # (changes, error, message fragments)
    (dict(q=torch.randn(T, 4)), ValueError, ["q:", "3-D", "[150, 4]"]),
    (dict(q=[1, 2]), TypeError, ["q:", "torch.Tensor", "list"]),
    (dict(q=torch.randint(0, 3, (T, 4, 64))), TypeError, ["q:", "bfloat16", "torch.int64"]),
    (dict(k=torch.randn(T, 2, 64, dtype=torch.float64)), TypeError, ["k:", "torch.float32", "torch.float64"]),
    (dict(q=torch.randn(T, 4, 96), k=torch.randn(T, 2, 96), v=torch.randn(T, 2, 96)), ValueError,
     ["q:", "(64, 128)", "96"]),
    (dict(k=torch.randn(T, 3, 64), v=torch.randn(T, 3, 64)), ValueError, ["k:", "divides Hq = 4", "Hkv = 3"]),
    (dict(v=torch.randn(T, 2, 128)), ValueError, ["v:", "[150, 2, 64]", "[150, 2, 128]"]),
    (dict(k=torch.randn(T, 2, 64, device="meta")), ValueError, ["k:", "device cpu", "meta"]),
    (dict(block_indices=torch.zeros(2, T, 2, dtype=torch.int64)), TypeError,
     ["block_indices:", "int32", "torch.int64"]),
    (dict(block_indices=torch.zeros(4, T, 2, dtype=torch.int32)), ValueError,
     ["block_indices:", "[2, 150, topk >= 1]", "[4, 150, 2]"]),
    (dict(block_indices=torch.zeros(2, T, 0, dtype=torch.int32)), ValueError,
     ["block_indices:", "topk >= 1", "[2, 150, 0]"]),
    (dict(cu_seqlens_q=torch.tensor([0, 100, 150])), TypeError, ["cu_seqlens_q:", "int32", "torch.int64"]),
    (dict(cu_seqlens_k=torch.tensor([0, 150], dtype=torch.int32)), ValueError, ["cu_seqlens_k:", "3 boundaries", "2"]),
    (dict(cu_seqlens_q=torch.tensor([[0, 150]], dtype=torch.int32)), ValueError, ["cu_seqlens_q:", "1-D", "[1, 2]"]),
    (dict(cu_seqlens_q=None), ValueError, ["cu_seqlens_q:", "expected a tensor", "None"]),
    (dict(max_seqlen_q=-1), ValueError, ["max_seqlen_q:", ">= 0", "-1"]),
    (dict(max_seqlen_k=10.5), TypeError, ["max_seqlen_k:", "int", "float"]),
    (dict(block_size=32), ValueError, ["block_size:", "(64, 128)", "32"]),
    (dict(block_indices=None), TypeError, ["block_indices:", "torch.Tensor", "NoneType"]),
]


@pytest.mark.parametrize("changes,error,fragments", ATTENTION_CASES,
                         ids=[c[2][0] + str(i) for i, c in enumerate(ATTENTION_CASES)])
def test_attention_bad_input(changes, error, fragments):
    with pytest.raises(error) as raised:
        _attention(**changes)
    for fragment in fragments:
        assert fragment in str(raised.value), f"{fragment!r} not in {raised.value}"


SELECT_CASES = [
    (dict(index_q=torch.randn(T, 2)), ValueError, ["index_q:", "3-D", "[150, 2]"]),
    (dict(index_k=torch.randn(T, 2, 32)), ValueError, ["index_k.shape[1]", "1", "2"]),
    (dict(index_k=torch.randn(T, 1, 16)), ValueError, ["index_k.shape[2]", "32", "16"]),
    (dict(index_k=torch.randn(T, 1, 32, dtype=torch.float16)), TypeError,
     ["index_k:", "torch.float32", "torch.float16"]),
    (dict(topk=0), ValueError, ["topk:", ">= 1", "0"]),
    (dict(topk=True), TypeError, ["topk:", "int", "bool"]),
    (dict(block_size=256), ValueError, ["block_size:", "(64, 128)", "256"]),
    (dict(cu_seqlens_q=torch.tensor([0, 150], dtype=torch.int32)), ValueError, ["cu_seqlens_k:", "2 boundaries", "3"]),
    (dict(index_q=torch.randn(T, 2, 0), index_k=torch.randn(T, 1, 0)), ValueError,
     ["index_q:", "Di >= 1", "[150, 2, 0]"]),
]


@pytest.mark.parametrize("changes,error,fragments", SELECT_CASES,
                         ids=[c[2][0] + str(i) for i, c in enumerate(SELECT_CASES)])
def test_select_bad_input(changes, error, fragments):
    with pytest.raises(error) as raised:
        _select(**changes)
    for fragment in fragments:
        assert fragment in str(raised.value), f"{fragment!r} not in {raised.value}"


# msa_attention checks its index inputs against q and k (the selection alone cannot).
INDEX_CASES = [
    (dict(index_q=torch.randn(T, 4, 32)), ValueError, ["index_q:", "Hi = 2 index heads", "got 4"]),
    (dict(index_q=torch.randn(T - 1, 2, 32)), ValueError, ["index_q:", "Tq = 150 rows (the rows of q)", "got 149"]),
    (dict(index_k=torch.randn(T - 1, 1, 32)), ValueError, ["index_k:", "Tk = 150 rows (the rows of k)", "got 149"]),
    (dict(index_k=torch.randn(T, 1, 32, dtype=torch.float64)), TypeError,
     ["index_k:", "torch.float32", "torch.float64"]),
    (dict(index_q=torch.randn(T, 2, 32, device="meta")), ValueError, ["index_q:", "device cpu", "meta"]),
    (dict(index_k=torch.randn(T, 1, 32, device="meta")), ValueError, ["index_k:", "device cpu", "meta"]),
    (dict(index_k=torch.randn(T, 32)), ValueError, ["index_k:", "3-D", "[150, 32]"]),
    (dict(index_q=torch.randn(T, 2, 0), index_k=torch.randn(T, 1, 0)), ValueError,
     ["index_q:", "Di >= 1", "[150, 2, 0]"]),
]


@pytest.mark.parametrize("changes,error,fragments", INDEX_CASES,
                         ids=[c[2][0] + str(i) for i, c in enumerate(INDEX_CASES)])
def test_msa_attention_checks_the_index_inputs(changes, error, fragments):
    good = _good()
    index = {"index_q": torch.randn(T, 2, 32), "index_k": torch.randn(T, 1, 32), **changes}
    with pytest.raises(error) as raised:
        torch_msa.msa_attention(good["q"], good["k"], good["v"], index["index_q"], index["index_k"],
                                good["cu_seqlens_q"], good["cu_seqlens_k"], 100, 100, topk=2, block_size=64)
    for fragment in fragments:
        assert fragment in str(raised.value), f"{fragment!r} not in {raised.value}"


def test_index_inputs_may_have_their_own_dtype():
    good = _good()
    out = torch_msa.msa_attention(good["q"].bfloat16(), good["k"].bfloat16(), good["v"].bfloat16(),
                                  torch.randn(T, 2, 32), torch.randn(T, 1, 32), good["cu_seqlens_q"],
                                  good["cu_seqlens_k"], 100, 100, topk=2, block_size=64)
    assert out.dtype == torch.bfloat16


def test_backward_op_bad_input():
    good = _good()
    docs = (good["cu_seqlens_q"], good["cu_seqlens_k"], 100, 100)
    q, k, v, block_indices = good["q"], good["k"], good["v"], good["block_indices"]
    out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, 64, 0.125)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \[150, 4, 64\] .* got \[150, 4, 32\]"):
        torch.ops.msa.backward(torch.randn(T, 4, 32), q, k, v, out, lse, block_indices, *docs, 64, 0.125)
    with pytest.raises(TypeError, match="lse: expected dtype torch.float32, got torch.bfloat16"):
        torch.ops.msa.backward(out, q, k, v, out, lse.bfloat16(), block_indices, *docs, 64, 0.125)
    with pytest.raises(ValueError, match=r"grad_lse: expected shape \[150, 4\]"):
        torch.ops.msa.backward(out, q, k, v, out, lse, block_indices, *docs, 64, 0.125, torch.zeros(T, 2))


def test_bad_input_fails_at_trace_time_too():
    """The fake kernels run the same checks, so torch.compile reports the same message."""
    good = _good()
    compiled = torch.compile(lambda q, k, v, b: torch_msa.sparse_attention(q, k, v, b, block_size=64),
                             backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="block_indices: expected dtype int32"):
        compiled(good["q"], good["k"], good["v"], good["block_indices"].long())


# Value problems: visible only by reading the tensors (a host sync), so checked in debug mode
# and by validate_inputs; without them the op still never reads out of bounds.
VALUE_CASES = [
    (dict(cu_seqlens_q=torch.tensor([1, 100, 150], dtype=torch.int32)),
     "cu_seqlens_q: expected the first boundary to be 0, got 1"),
    (dict(cu_seqlens_k=torch.tensor([0, 160, 150], dtype=torch.int32)),
     "cu_seqlens_k: expected non-decreasing boundaries"),
    (dict(cu_seqlens_q=torch.tensor([0, 100, 140], dtype=torch.int32)),
     "expected the last boundary to equal the token count 150, got 140"),
    (dict(cu_seqlens_q=torch.tensor([0, 120, 150], dtype=torch.int32), max_seqlen_q=200),
     "document 0 with Lq = 120, Lk = 100"),
    (dict(max_seqlen_k=60), "max_seqlen_k: expected >= the longest document (100 tokens), got 60"),
]


def _block_ids(edit):
    good = _good()
    ids = good["block_indices"].clone()
    edit(ids)
    return dict(block_indices=ids)


def _set(ids, index, value):
    ids[index] = value


BLOCK_CASES = [
    (_block_ids(lambda ids: _set(ids, (0, 99, 0), -2)), "block_indices[0, 99, 0]: expected a block id >= -1, got -2"),
    (_block_ids(lambda ids: _set(ids, (1, 99, 0), -1)), "block_indices[1, 99, 1]: expected valid ids as a prefix"),
    (_block_ids(lambda ids: _set(ids, (0, 70, 0), 5)), "block_indices[0, 70, 0]: expected a block id < nvb = 2"),
    (_block_ids(lambda ids: _set(ids, (0, 99, 0), 1)), "block_indices[0, 99]: expected distinct block ids, got [1, 1]"),
    (_block_ids(lambda ids: _set(ids, (0, 99), torch.tensor([1, 0]))),
     "expected the local block 1 as the last valid id, got [1, 0]"),
    (_block_ids(lambda ids: _set(ids, (0, 10), -1)),
     "block_indices[0, 10]: expected the local block 0 as the last valid id"),
]


@pytest.mark.parametrize("changes,message", VALUE_CASES + BLOCK_CASES)
def test_value_checks(changes, message, monkeypatch):
    args = {**_good(), **changes}
    with pytest.raises(ValueError) as raised:
        torch_msa.validate_inputs(**args, block_size=64)
    assert message in str(raised.value)
    monkeypatch.setenv(torch_msa.DEBUG_ENV, "1")
    with pytest.raises(ValueError) as raised:
        torch_msa.sparse_attention(**args, block_size=64)
    assert message in str(raised.value)
    monkeypatch.setenv(torch_msa.DEBUG_ENV, "0")
    out = torch_msa.sparse_attention(**args, block_size=64)  # no debug: no sync, no crash
    assert out.shape == (T, 4, 64)


def test_validate_inputs_accepts_good_input_and_index_inputs():
    good = _good()
    torch_msa.validate_inputs(**good, index_q=torch.randn(T, 2, 32), index_k=torch.randn(T, 1, 32), topk=2,
                              block_size=64)
    with pytest.raises(ValueError, match=r"index_q: expected Hi = 2 index heads \(one per KV head of k\), got 3"):
        torch_msa.validate_inputs(**good, index_q=torch.randn(T, 3, 32), index_k=torch.randn(T, 1, 32), block_size=64)
    with pytest.raises(ValueError, match="index_k: expected a tensor"):
        torch_msa.validate_inputs(**good, index_q=torch.randn(T, 2, 32), block_size=64)


def test_debug_mode_checks_selection_documents(monkeypatch):
    monkeypatch.setenv(torch_msa.DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="cu_seqlens_k: expected the last boundary"):
        _select(cu_seqlens_k=torch.tensor([0, 100, 149], dtype=torch.int32))


def test_debug_checks_run_inside_compiled_code(monkeypatch):
    """The value checks live in the op kernels, which run (never trace) under torch.compile."""
    good = _good()
    compiled = torch.compile(
        lambda q, k, v, b, cu_q, cu_k: torch_msa.sparse_attention(q, k, v, b, cu_q, cu_k, 100, 100, block_size=64),
        backend="aot_eager", fullgraph=True,
    )
    args = (good["q"], good["k"], good["v"], good["block_indices"], good["cu_seqlens_q"], good["cu_seqlens_k"])
    compiled(*args)
    broken = torch.tensor([0, 100, 149], dtype=torch.int32)
    monkeypatch.setenv(torch_msa.DEBUG_ENV, "1")
    with pytest.raises(ValueError,
                       match="cu_seqlens_k: expected the last boundary to equal the token count 150, got 149"):
        compiled(*args[:5], broken)


# Arguments of the wrong type or range: the public functions name them before the dispatcher,
# whose own RuntimeError names neither the expectation nor the fix.
def _dense_loss(**changes):
    good = _good()
    args = dict(q=good["q"], k=good["k"], index_q=torch.randn(T, 2, 32), index_k=torch.randn(T, 1, 32), block_size=64)
    return torch_msa.indexer_kl_loss_dense(**{**args, **changes})


def _sparse_loss(**changes):
    good = _good()
    _, lse = torch_msa.sparse_attention(**good, block_size=64, return_lse=True)
    args = dict(q=good["q"], k=good["k"], lse=lse, index_q=torch.randn(T, 2, 32), index_k=torch.randn(T, 1, 32),
                block_indices=good["block_indices"], cu_seqlens_q=good["cu_seqlens_q"],
                cu_seqlens_k=good["cu_seqlens_k"], block_size=64)
    return torch_msa.indexer_kl_loss(**{**args, **changes})


def _plan(**changes):
    good = _good()
    args = dict(block_indices=good["block_indices"], cu_seqlens_q=good["cu_seqlens_q"], cu_seqlens_k=good["cu_seqlens_k"],
                num_keys=T, num_heads=4, block_size=64)
    return torch_msa.build_plan(**{**args, **changes})


ILL_TYPED_CASES = [
    (lambda: _attention(cu_seqlens_q=[0, 100, 150]), TypeError, ["cu_seqlens_q:", "torch.Tensor", "list"]),
    (lambda: _attention(cu_seqlens_k=(0, 100, 150)), TypeError, ["cu_seqlens_k:", "torch.Tensor", "tuple"]),
    (lambda: _select(cu_seqlens_q=[0, 100, 150]), TypeError, ["cu_seqlens_q:", "torch.Tensor", "list"]),
    (lambda: _attention(plan=[1, 2]), TypeError, ["plan:", "torch.Tensor", "list"]),
    (lambda: _attention(fragment_documents=[0, 1], fragment_starts=torch.zeros(2, dtype=torch.int32)), TypeError,
     ["fragment_documents:", "torch.Tensor", "list"]),
    (lambda: _attention(fragment_documents=torch.zeros(2, dtype=torch.int32), fragment_starts=[0, 0]), TypeError,
     ["fragment_starts:", "torch.Tensor", "list"]),
    (lambda: _dense_loss(lse=[0.0]), TypeError, ["lse:", "torch.Tensor", "list"]),
    (lambda: _dense_loss(index_softmax_scale="0.1"), TypeError, ["index_softmax_scale:", "float", "str"]),
    (lambda: _sparse_loss(index_softmax_scale="0.1"), TypeError, ["index_softmax_scale:", "float", "str"]),
    (lambda: _sparse_loss(index_softmax_scale=float("nan")), ValueError, ["index_softmax_scale:", "finite", "nan"]),
    (lambda: _plan(num_keys=150.0), TypeError, ["num_keys:", "int", "float"]),
    (lambda: _plan(num_heads="4"), TypeError, ["num_heads:", "int", "str"]),
    (lambda: _attention(max_seqlen_k=2**64), ValueError, ["max_seqlen_k:", "2**63 - 1", str(2**64)]),
    (lambda: _select(max_seqlen_q=2**63), ValueError, ["max_seqlen_q:", "2**63 - 1", str(2**63)]),
    (lambda: _select(topk=2**64), ValueError, ["topk:", "2**63 - 1", str(2**64)]),
]


@pytest.mark.parametrize("call,error,fragments", ILL_TYPED_CASES,
                         ids=[c[2][0] + str(i) for i, c in enumerate(ILL_TYPED_CASES)])
def test_ill_typed_arguments_are_named(call, error, fragments):
    with pytest.raises(error) as raised:
        call()
    for fragment in fragments:
        assert fragment in str(raised.value), str(raised.value)


def _plan_of_other_shape():
    """A plan msa::plan built for another Tk and topk: its length fits none of _good()'s shapes."""
    cu = torch.tensor([0, 120], dtype=torch.int32)
    return torch_msa.build_plan(random_block_indices(cu, cu, 2, 3, 64), cu, cu, num_keys=120, num_heads=4, block_size=64)


@pytest.mark.parametrize("plan", [torch.zeros(10, dtype=torch.int32), _plan_of_other_shape()], ids=["10", "other-shape"])
def test_a_plan_of_the_wrong_length_is_refused_eagerly_and_at_trace_time(plan):
    good = _good()
    with pytest.raises(ValueError, match=r"plan: expected \d+ \+ 3 \* num_items int32 entries"):
        _attention(plan=plan)
    docs = (good["cu_seqlens_q"], good["cu_seqlens_k"], 100, 100)
    with pytest.raises(ValueError, match="plan: expected"):  # the op itself, not only the API
        torch.ops.msa.forward(good["q"], good["k"], good["v"], good["block_indices"], *docs, 64, 0.125, plan)
    for dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, v, b, p: torch_msa.sparse_attention(q, k, v, b, block_size=64, plan=p),
                                 backend="aot_eager", fullgraph=True, dynamic=dynamic)
        with pytest.raises(Exception, match=r"plan: expected \d+ \+ 3 \* num_items"):
            compiled(good["q"], good["k"], good["v"], good["block_indices"], plan)


def test_a_plan_built_in_the_compiled_graph_passes_the_length_check():
    good = _good()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, b: torch_msa.sparse_attention(q, k, v, b, block_size=64, return_lse=True),
                             backend="aot_eager", fullgraph=True, dynamic=True)
    out, lse = compiled(good["q"], good["k"], good["v"], good["block_indices"])
    expected = torch_msa.sparse_attention(**{k: v for k, v in good.items() if "seqlen" not in k and "cu_" not in k},
                                          block_size=64, return_lse=True)
    torch.testing.assert_close(out, expected[0])


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _stale_plan_problem(device):
    good = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in _good().items()}
    other = good["block_indices"].clone()
    other[1, 99] = torch.tensor([1, -1])  # query 99 keeps only its local block: in contract, another selection
    assert not torch.equal(other, good["block_indices"])
    return good, other


def _plan_for(good, block_indices, cu_seqlens_q=None, cu_seqlens_k=None):
    cu_q = good["cu_seqlens_q"] if cu_seqlens_q is None else cu_seqlens_q
    cu_k = good["cu_seqlens_k"] if cu_seqlens_k is None else cu_seqlens_k
    return torch_msa.build_plan(block_indices, cu_q, cu_k, num_keys=T, num_heads=4, block_size=64)


@pytest.mark.parametrize("device", DEVICES)
def test_a_stale_plan_is_detected_by_validate_inputs_and_debug_mode(device, monkeypatch):
    """A plan of the same shapes built for another selection, or for other documents: the
    kernels would compute the plan's selection, so the value checks compare the two."""
    good, other = _stale_plan_problem(device)
    stale_selection = _plan_for(good, other)
    stale_documents = _plan_for(good, good["block_indices"], *cu_seqlens([50, 100], device=device))
    torch_msa.validate_inputs(**good, plan=_plan_for(good, good["block_indices"]), block_size=64)  # the right plan
    for stale in (stale_selection, stale_documents):
        with pytest.raises(ValueError, match="plan: expected the .* rebuild it with torch_msa.build_plan"):
            torch_msa.validate_inputs(**good, plan=stale, block_size=64)
    with pytest.raises(ValueError, match="block_indices: expected the selection the plan was built for"):
        torch_msa.validate_inputs(**{**good, "block_indices": None}, plan=stale_selection, block_size=64)
    monkeypatch.setenv(torch_msa.DEBUG_ENV, "1")
    q, k, v = (good[name].requires_grad_() for name in "qkv")
    with pytest.raises(ValueError, match="plan: expected the .* rebuild it with torch_msa.build_plan"):
        torch_msa.sparse_attention(**good, plan=stale_selection, block_size=64)
    out = torch_msa.sparse_attention(**good, plan=_plan_for(good, good["block_indices"]), block_size=64)
    out.sum().backward()  # the backward's debug checks accept the forward's own plan
    assert q.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_the_plan_check_accepts_every_plan_msa_plan_builds(device):
    """No false alarm: packs with empty and one-token documents, Lq < Lk, query fragments."""
    from torch_msa.testing import fragments
    from torch_msa.validation import check_plan_values

    generator = torch.Generator().manual_seed(3)
    for q_lens, k_lens in (([0, 1, 200, 0, 77], [0, 1, 200, 0, 77]), ([30, 1, 64], [130, 1, 200])):
        cu_q, cu_k = cu_seqlens(q_lens, k_lens, device)
        ids = random_block_indices(cu_q.cpu(), cu_k.cpu(), 2, 3, 64, generator).to(device)
        plan = torch_msa.build_plan(ids, cu_q, cu_k, num_keys=sum(k_lens), num_heads=4, block_size=64)
        check_plan_values(plan, ids, documents_of(cu_q, cu_k), sum(k_lens), 64)
        # Another random selection keeps as many blocks per row: only the entries tell them apart.
        other = random_block_indices(cu_q.cpu(), cu_k.cpu(), 2, 3, 64, generator).to(device)
        assert (other >= 0).sum() == (ids >= 0).sum() and not torch.equal(other, ids)
        with pytest.raises(ValueError, match="plan: expected the entries of this block_indices; the plan's entry"):
            check_plan_values(plan, other, documents_of(cu_q, cu_k), sum(k_lens), 64)
    pieces = fragments([150, 90], [(1, 10, 40), (0, 0, 64), (0, 100, 50)], device)
    ids = random_block_indices(pieces.cu_seqlens_q.cpu(), pieces.cu_seqlens_k.cpu(), 2, 3, 64, generator,
                               *(x.cpu() for x in pieces.tensors)).to(device)
    plan = torch_msa.build_plan(ids, pieces.cu_seqlens_q, pieces.cu_seqlens_k, pieces.max_seqlen_q, pieces.max_seqlen_k,
                                num_keys=240, num_heads=4, block_size=64, fragment_documents=pieces.fragment_documents,
                                fragment_starts=pieces.fragment_starts)
    check_plan_values(plan, ids, Documents(*pieces.op_args, *pieces.tensors), 240, 64)


def test_the_cpu_selection_costs_the_keys_present_not_max_seqlen_k():
    """A generous fixed max_seqlen_k (to keep compiled graphs static) changes neither the result
    nor the work: the candidate blocks are bounded by the keys present."""
    from torch.utils.flop_counter import FlopCounterMode

    from torch_msa import reference

    index_q, index_k = torch.randn(200, 2, 32), torch.randn(200, 1, 32)

    def select(max_seqlen_k):
        """The op's result and nominal FLOPs, and the FLOPs the CPU reference really runs."""
        with FlopCounterMode(display=False) as nominal:
            ids = torch_msa.select_blocks(index_q, index_k, max_seqlen_k=max_seqlen_k, topk=4, block_size=64)
        docs = torch.tensor([0, 200], dtype=torch.int32)
        with FlopCounterMode(display=False) as real:
            reference.select_blocks(index_q, index_k, Documents(docs, docs, 200, max_seqlen_k), 4, 64)
        return ids, nominal.get_total_flops(), real.get_total_flops()

    exact, exact_nominal, exact_real = select(200)
    assert exact_nominal == 2 * 32 * 2 * 200 * 200 and exact_real > 0
    for generous in (2**17, 2**40):
        ids, nominal, real = select(generous)
        assert torch.equal(ids, exact)
        assert (nominal, real) == (exact_nominal, exact_real)
