"""Bad input raises ValueError/TypeError naming the argument, what was expected and what was given."""

import pytest
import torch

import torch_msa
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
