"""The deterministic Triton KL loss (`torch_msa/index_loss/sparse_deterministic.py`) against the reference at
small shapes, bitwise repeats, and the backend's choice of it under deterministic algorithms.

Run natively on a CUDA host, or on CPU under the Triton interpreter by
`tests/triton/test_interpret.py`; fp32 and fp16 only (the interpreter's bf16 `tl.dot` is wrong,
see `tests/support/triton_kernels.py`). Cases marked `split` shrink the items to 16 or 32 entries, so that one
key block is split over several items and the fixed-order reduction sums more than one item per
bucket.
"""


import pytest
import torch

import torch_msa
import torch_msa.triton.interface as triton_backend
from tests.support.documents import backend_arguments
from tests.support.triton_kernels import DEVICE, require_a_device
from torch_msa import query_windows, reference, reference_index_loss, testing
from torch_msa.backends import UnsupportedInputs
from torch_msa.index_loss import sparse as kl_kernel
from torch_msa.index_loss import sparse_deterministic as kl_deterministic
from torch_msa.plan import kernels as plan_kernels

require_a_device()

FORWARD_NAMES = ("loss", "teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
BACKWARD_NAMES = ("d index_q", "d index_k")

# (q lengths, k lengths, Hq, Hkv, D, Di, block, topk, dtype, split)
CASES = {
    "pack-empty-1-token-suffix": ([40, 0, 1, 90], [140, 5, 1, 90], 4, 2, 64, 32, 64, 3, torch.float32, False),
    "pack-empty-1-token-split": ([60, 0, 1, 70], [60, 0, 1, 70], 4, 2, 64, 32, 64, 3, torch.float32, True),
    "group3-fp16-split": ([70], [200], 6, 2, 128, 16, 64, 2, torch.float16, True),
    "group16-two-head-passes": ([50, 20], [150, 20], 16, 1, 64, 16, 64, 2, torch.float32, False),
}


@pytest.fixture
def small_items(monkeypatch):
    """Items of 16 forward and 32 backward entries."""
    monkeypatch.setattr(kl_deterministic, "forward_entries_per_item", lambda num_heads, num_kv_heads: 16)
    monkeypatch.setattr(kl_deterministic, "backward_entries_per_item", lambda num_index_heads: 32)


def _problem(q_lens, k_lens, num_heads, num_kv_heads, dim, index_dim, block_size, topk, dtype):
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens, DEVICE)
    num_queries, num_keys = sum(q_lens), sum(k_lens)
    block_indices = testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    if topk > 1:  # out-of-contract ids are read as a set
        block_indices[0, :, -1] = block_indices[0, :, 0]
        block_indices[-1, ::3, 0] = 10_000
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype)
    index_q = torch.randn(num_queries, num_kv_heads, index_dim, device=DEVICE, dtype=dtype)
    index_k = torch.randn(num_keys, 1, index_dim, device=DEVICE, dtype=dtype)
    docs = (cu_q, cu_k, max(q_lens), max(k_lens))
    scales = (dim**-0.5, index_dim**-0.5)
    _, lse = reference.forward(*backend_arguments("forward", q, k, k, block_indices, *docs, block_size, scales[0]))
    return (q, k, lse, index_q, index_k, block_indices, *docs, block_size, *scales)


def _backward_args(args, forward_outputs, grad_loss=1.7):
    _, _, _, index_q, index_k, block_indices, cu_q, cu_k, max_q, max_k, block_size, _, index_scale, *fragments = args
    return (torch.tensor(grad_loss, device=DEVICE), index_q, index_k, *forward_outputs[2:], block_indices, cu_q, cu_k,
            max_q, max_k, block_size, index_scale, *fragments)


def _forward(module, args):
    """`module.indexer_kl` (a backend's) of the op's arguments `args`; its outputs never share
    storage (a custom op's outputs must not alias)."""
    outputs = module.indexer_kl(*backend_arguments("indexer_kl", *args))
    storages = [t.untyped_storage().data_ptr() for t in outputs if t.numel()]
    assert len(set(storages)) == len(storages), "outputs share storage"
    return outputs


def _backward(module, args):
    """`module.indexer_kl_backward` (a backend's) of the op's arguments `args`."""
    return module.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *args))


def _assert_forward_close(got, expected, tolerance):
    assert len(got) == len(FORWARD_NAMES)
    for name, a, b in zip(FORWARD_NAMES, got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = max(1.0, b.nan_to_num(neginf=0).abs().max().item())
        # The teacher's reductions keep fp32 accuracy for 16-bit inputs too (split weights).
        close = 2e-5 if name.startswith("teacher_index") else tolerance
        torch.testing.assert_close(a, b, rtol=close, atol=close * scale, msg=lambda m, name=name: f"{name}: {m}")


def _assert_backward_close(got, expected, tolerance):
    for name, a, b in zip(BACKWARD_NAMES, got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=tolerance, atol=tolerance * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_deterministic_kl_matches_reference_and_repeats_bitwise(case, request):
    *shape, dtype, split = CASES[case]
    if split:
        request.getfixturevalue("small_items")
    args = _problem(*shape, dtype)
    expected = _forward(reference_index_loss, args)
    got = _forward(kl_deterministic, args)
    assert expected[0] > 0 and expected[4].abs().sum() > 0
    _assert_forward_close(got, expected, 2e-5 if dtype == torch.float32 else 3e-3)
    again = _forward(kl_deterministic, args)
    for name, a, b in zip(FORWARD_NAMES, got, again, strict=True):
        assert torch.equal(a, b), name

    backward_args = _backward_args(args, expected)
    grads = _backward(kl_deterministic, backward_args)
    _assert_backward_close(grads, _backward(reference_index_loss, backward_args),
                           1e-4 if dtype == torch.float32 else 2e-3)
    for name, a, b in zip(BACKWARD_NAMES, grads, _backward(kl_deterministic, backward_args), strict=True):
        assert torch.equal(a, b), name


def test_deterministic_kl_matches_the_default_kernels(small_items):
    """The same tiles, the sums only added in another order: the two variants agree to fp32 rounding."""
    args = _problem([60, 1, 70], [60, 1, 70], 4, 2, 64, 32, 64, 3, torch.float32)
    got, default = _forward(kl_deterministic, args), _forward(kl_kernel, args)
    _assert_forward_close(got, default, 1e-6)
    backward_args = _backward_args(args, default)
    _assert_backward_close(_backward(kl_deterministic, backward_args),
                           _backward(kl_kernel, backward_args), 1e-6)


def test_fragments_match_reference(small_items):
    """Query fragments sharing their documents' keys (out of order, several per document, an empty
    and a 1-token document, junk ids), with buckets split over several items."""
    lengths = (150, 0, 1, 90)
    pieces = ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40), (0, 100, 20))
    frag = testing.fragments(lengths, pieces, DEVICE)
    num_heads, num_kv_heads, dim, index_dim, block_size, topk = 4, 2, 64, 32, 64, 3
    num_queries, num_keys = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])
    fragments = frag.tensors
    block_indices = testing.random_block_indices(frag.cu_seqlens_q, frag.cu_seqlens_k, num_kv_heads, topk, block_size,
                                                 None, *fragments)
    block_indices[-1, ::3, 0] = 10_000
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE)
    k = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE)
    index_q = torch.randn(num_queries, num_kv_heads, index_dim, device=DEVICE)
    index_k = torch.randn(num_keys, 1, index_dim, device=DEVICE)
    scales = (dim**-0.5, index_dim**-0.5)
    _, lse = reference.forward(*backend_arguments("forward", q, k, k, block_indices, *frag.op_args, block_size, scales[0],
                                                   None, *fragments))
    args = (q, k, lse, index_q, index_k, block_indices, *frag.op_args, block_size, *scales, *fragments)
    expected = _forward(reference_index_loss, args)
    got = _forward(kl_deterministic, args)
    assert expected[0] > 0 and expected[4].abs().sum() > 0
    _assert_forward_close(got, expected, 2e-5)
    for name, a, b in zip(FORWARD_NAMES, got, _forward(kl_deterministic, args), strict=True):
        assert torch.equal(a, b), name
    backward_args = _backward_args(args, expected, grad_loss=1.3)
    _assert_backward_close(_backward(kl_deterministic, backward_args),
                           _backward(reference_index_loss, backward_args), 1e-4)


@pytest.mark.parametrize("fragmented", [False, True], ids=["pack", "fragments"])
def test_query_windows_match_reference(fragmented, monkeypatch):
    """A budget of 37 queries' partials: the forward and the backward run over windows whose
    boundaries fall inside documents (and fragments), and still match the reference."""
    num_heads, num_kv_heads, dim, index_dim, block_size, topk = 4, 2, 64, 32, 64, 3
    per_query = kl_deterministic.partial_bytes_per_query(
        num_kv_heads, topk, index_dim, block_size, kl_deterministic.forward_entries_per_item(num_heads, num_kv_heads))
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES", 37 * per_query)
    if fragmented:
        frag = testing.fragments((150, 0, 1, 90), ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40)), DEVICE)
        cu_q, cu_k, fragments = frag.cu_seqlens_q, frag.cu_seqlens_k, frag.tensors
        docs = frag.op_args
    else:
        cu_q, cu_k = testing.cu_seqlens([60, 0, 1, 70], [80, 0, 1, 70], DEVICE)
        fragments = ()
        docs = (cu_q, cu_k, 70, 80)
    num_queries, num_keys = int(cu_q[-1]), int(cu_k[-1])
    assert num_queries > 2 * 37
    block_indices = testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size, None, *fragments)
    block_indices[-1, ::3, 0] = 10_000
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE)
    k = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE)
    index_q = torch.randn(num_queries, num_kv_heads, index_dim, device=DEVICE)
    index_k = torch.randn(num_keys, 1, index_dim, device=DEVICE)
    scales = (dim**-0.5, index_dim**-0.5)
    _, lse = reference.forward(*backend_arguments("forward", q, k, k, block_indices, *docs, block_size, scales[0], None,
                                                   *fragments))
    args = (q, k, lse, index_q, index_k, block_indices, *docs, block_size, *scales, *fragments)
    launches = []

    def counted(name):
        launch = getattr(kl_deterministic, name)

        def call(*call_args, **options):
            launches.append(name)
            return launch(*call_args, **options)

        return call

    for name in ("launch_forward", "launch_backward"):
        monkeypatch.setattr(kl_deterministic, name, counted(name))
    expected = _forward(reference_index_loss, args)
    got = _forward(kl_deterministic, args)
    assert launches.count("launch_forward") == -(-num_queries // 37)
    _assert_forward_close(got, expected, 2e-5)
    for name, a, b in zip(FORWARD_NAMES, got, _forward(kl_deterministic, args), strict=True):
        assert torch.equal(a, b), name
    backward_args = _backward_args(args, expected)
    _assert_backward_close(_backward(kl_deterministic, backward_args),
                           _backward(reference_index_loss, backward_args), 1e-4)
    assert launches.count("launch_backward") > 1


@pytest.mark.parametrize("module", [kl_kernel, kl_deterministic], ids=["default", "deterministic"])
def test_the_loss_walks_a_given_plan_and_builds_none(module, monkeypatch):
    """Given the step's plan (items of the attention's size), the loss and its gradients build no
    plan and equal those of the plans they build themselves (bitwise in the deterministic mode,
    whose items are the same)."""
    case = CASES["pack-empty-1-token-suffix"][:-1]
    args = _problem(*case)
    _, _, lse, _, _, block_indices, *docs, block_size, _, _ = args
    plan = torch_msa.build_plan(block_indices, *docs, num_keys=args[1].shape[0], num_heads=args[0].shape[1],
                                block_size=block_size)

    def loss_and_gradients(**given):
        forward = module.indexer_kl(*backend_arguments("indexer_kl", *args), **given)
        backward = module.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *_backward_args(args, forward)),
                                              **given)
        return (*forward, *backward)

    builds = []
    build = plan_kernels.plan
    monkeypatch.setattr(plan_kernels, "plan", lambda *plan_args: builds.append(plan_args) or build(*plan_args))
    own = loss_and_gradients()
    assert len(builds) == 2  # the forward's and the backward's, with items of their own sizes
    walked = loss_and_gradients(plan=plan)
    assert len(builds) == 2, "a plan was built although one was given"
    for a, b in zip(walked, own, strict=True):
        if module is kl_deterministic:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_empty_inputs_give_zero_loss_and_gradients():
    args = list(_problem([0], [0], 4, 2, 64, 32, 64, 3, torch.float32))
    loss, _, index_lse, mass, teacher_keys, teacher_queries = _forward(kl_deterministic, args)
    assert loss.item() == 0 and index_lse.shape == (0, 2) and mass.shape == (0, 2)
    assert teacher_keys.shape == (0, 2, 32) and teacher_queries.shape == (0, 1, 32)
    d_index_q, d_index_k = _backward(kl_deterministic, _backward_args(args, _forward(reference_index_loss, args)))
    assert d_index_q.shape == (0, 2, 32) and d_index_k.shape == (0, 1, 32)


def test_the_backend_serves_the_deterministic_kernels_under_deterministic_algorithms(deterministic_algorithms):
    """The default kernels decline (they add with atomics); the backend's ops run the
    deterministic ones instead, so nothing falls back to the reference."""
    args = _problem([40, 1, 30], [40, 1, 30], 4, 2, 64, 32, 64, 3, torch.float32)
    with pytest.raises(UnsupportedInputs, match="deterministic"):
        _forward(kl_kernel, args)
    served = _forward(triton_backend, args)
    for name, a, b in zip(FORWARD_NAMES, served, _forward(kl_deterministic, args), strict=True):
        assert torch.equal(a, b), name
    backward_args = _backward_args(args, served)
    with pytest.raises(UnsupportedInputs, match="deterministic"):
        _backward(kl_kernel, backward_args)
    for name, a, b in zip(BACKWARD_NAMES, _backward(triton_backend, backward_args),
                          _backward(kl_deterministic, backward_args), strict=True):
        assert torch.equal(a, b), name


def test_deterministic_kernels_decline_what_the_default_ones_decline():
    args = list(_problem([20], [20], 4, 2, 64, 32, 64, 2, torch.float32))
    with pytest.raises(UnsupportedInputs, match="no lse"):
        _forward(kl_deterministic, (*args[:2], None, *args[3:]))
    args[3], args[4] = args[3][..., :24], args[4][..., :24]
    with pytest.raises(UnsupportedInputs, match="index head dim 24"):
        _forward(kl_deterministic, args)
