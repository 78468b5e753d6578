"""The Triton KL kernels at M3 shapes against the reference. Skipped without CUDA; run on the H200.

M3: Hq = 64, Hkv = 4, D = 128, index heads 4 x 128, block 128, topk 16, bf16 inputs. The loss is
compared relatively (both sides accumulate in fp32); the gradients by relative Frobenius error,
about 1e-3 for bf16 rounding and O(1) for any wrong row, so 1e-2 separates the two.
"""

import warnings

import pytest
import torch

import torch_msa
from tests.support.documents import Documents, backend_arguments
from torch_msa import reference_index_loss
from torch_msa.testing import cu_seqlens, random_block_indices, skewed_block_indices

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("junk_in_uninitialized_buffers")]

HEADS, KV_HEADS, DIM, INDEX_DIM, BLOCK, TOPK = 64, 4, 128, 128, 128, 16
LAYOUTS = {
    "4K": ([4096], [4096]),
    "pack": ([1000, 3000, 77, 1, 0, 2178], [1000, 3000, 77, 1, 0, 2178]),
    "suffix-pack": ([700, 129, 2000], [2600, 129, 2000]),
}


def _problem(layout, selection, seed=0):
    q_lens, k_lens = LAYOUTS[layout]
    cu_q, cu_k = cu_seqlens(q_lens, k_lens, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])

    def tensor(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    q, k, v = tensor(tq, HEADS, DIM), tensor(tk, KV_HEADS, DIM), tensor(tk, KV_HEADS, DIM)
    index_q, index_k = tensor(tq, KV_HEADS, INDEX_DIM), tensor(tk, 1, INDEX_DIM)
    docs = (cu_q, cu_k, max(q_lens), max(k_lens))
    if selection == "index":
        block_indices = torch.ops.msa.select_blocks(index_q, index_k, *docs, TOPK, BLOCK)
    elif selection == "skewed":
        block_indices = skewed_block_indices(cu_q, cu_k, KV_HEADS, TOPK, BLOCK)
    else:
        block_indices = random_block_indices(cu_q, cu_k, KV_HEADS, TOPK, BLOCK).cuda()
    _, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, BLOCK, DIM**-0.5)
    return (q, k, lse, index_q, index_k, block_indices, *docs, BLOCK, DIM**-0.5, INDEX_DIM**-0.5)


def _relative_error(got, want):
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


def test_triton_serves_the_sparse_loss_on_cuda():
    device = torch.device("cuda")
    assert torch_msa.resolve("indexer_kl", device).name == "triton"
    assert torch_msa.resolve("indexer_kl_backward", device).name == "triton"


@pytest.mark.parametrize("selection", ["index", "random", "skewed"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_m3_sparse_loss_and_gradients_match_reference(layout, selection):
    from torch_msa.index_loss import sparse as kl_kernel

    args = _problem(layout, selection)
    got = kl_kernel.indexer_kl(*backend_arguments("indexer_kl", *args))
    want = reference_index_loss.indexer_kl(*backend_arguments("indexer_kl", *args))
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=1e-5)
    assert torch.equal(got[1], want[1])
    names = ("index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    for name, a, b in zip(names, got[2:], want[2:]):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        assert _relative_error(a.nan_to_num(neginf=0), b.nan_to_num(neginf=0)) < 1e-3, name

    q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, max_q, max_k, block_size, _, index_scale = args
    backward_args = (torch.tensor(1.0, device="cuda"), index_q, index_k, *want[2:], block_indices, cu_q, cu_k,
                     max_q, max_k, block_size, index_scale)
    for name, a, b in zip(("d index_q", "d index_k"), kl_kernel.indexer_kl_backward(*backend_arguments("indexer_kl_backward",
                                                                                                       *backward_args)),
                          reference_index_loss.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *backward_args))):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _relative_error(a, b) < 1e-2, (name, _relative_error(a, b))


@pytest.mark.parametrize("layout", ["4K", "pack"])
def test_deterministic_mode_serves_triton_bitwise(layout, monkeypatch, deterministic_algorithms):
    """Under deterministic algorithms the default kernels decline (atomics) and the backend runs
    the deterministic ones, with no fallback to the reference: two training steps of the loss
    agree bitwise and stay close to the default kernels."""
    from torch_msa import backends
    from torch_msa.index_loss import sparse as kl_kernel
    from torch_msa.index_loss import sparse_deterministic as kl_deterministic

    args = _problem(layout, "index")
    with pytest.raises(torch_msa.UnsupportedInputs, match="deterministic"):
        kl_kernel.indexer_kl(*backend_arguments("indexer_kl", *args))
    served = {"indexer_kl": 0, "indexer_kl_backward": 0}

    def counted(name):
        function = getattr(kl_deterministic, name)

        def call(*call_args):
            served[name] += 1
            return function(*call_args)

        return call

    for name in served:
        monkeypatch.setattr(kl_deterministic, name, counted(name))
    monkeypatch.setattr(backends, "_warned", set())  # a fallback warns once per process
    steps = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the reference would warn
        for _ in range(2):
            index_q, index_k = args[3].clone().requires_grad_(), args[4].clone().requires_grad_()
            loss = torch_msa.indexer_kl_loss(*args[:3], index_q, index_k, *args[5:10], block_size=BLOCK)
            steps.append((loss.detach(), *torch.autograd.grad(loss, (index_q, index_k))))
    assert served == {"indexer_kl": 2, "indexer_kl_backward": 2}
    for name, a, b in zip(("loss", "d index_q", "d index_k"), *steps, strict=True):
        assert torch.equal(a, b), name
    forward = [kl_deterministic.indexer_kl(*backend_arguments("indexer_kl", *args)) for _ in range(2)]
    for a, b in zip(*forward, strict=True):
        assert torch.equal(a, b)

    torch.use_deterministic_algorithms(False)
    default = kl_kernel.indexer_kl(*backend_arguments("indexer_kl", *args))
    torch.testing.assert_close(forward[0][0], default[0], rtol=1e-5, atol=1e-7)
    names = ("index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    for name, a, b in zip(names, forward[0][2:], default[2:], strict=True):
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        assert _relative_error(a.nan_to_num(neginf=0), b.nan_to_num(neginf=0)) < 1e-5, name
    q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, max_q, max_k, block_size, _, index_scale = args
    backward_args = (torch.tensor(1.0, device="cuda"), index_q, index_k, *default[2:], block_indices, cu_q, cu_k,
                     max_q, max_k, block_size, index_scale)
    want = kl_kernel.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *backward_args))
    torch.use_deterministic_algorithms(True)
    got = kl_deterministic.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *backward_args))
    for name, a, b in zip(("d index_q", "d index_k"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        # bf16 outputs: the fp32 sums differ in their last bits, a few elements round apart.
        assert _relative_error(a, b) < 1e-3, (name, _relative_error(a, b))


def test_deterministic_query_windows_match_one_window(monkeypatch, deterministic_algorithms):
    """A budget of 1000 queries' partials splits the pack (6256 queries) into windows: the
    outputs and gradients stay those of one window, up to fp32 rounding."""
    from torch_msa import query_windows
    from torch_msa.index_loss import sparse_deterministic as kl_deterministic

    args = _problem("pack", "index")
    q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, max_q, max_k, block_size, _, index_scale = args
    one_window = kl_deterministic.indexer_kl(*backend_arguments("indexer_kl", *args))
    backward_args = (torch.tensor(1.0, device="cuda"), index_q, index_k, *one_window[2:], block_indices, cu_q, cu_k,
                     max_q, max_k, block_size, index_scale)
    one_window_grads = kl_deterministic.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *backward_args))
    per_query = kl_deterministic.partial_bytes_per_query(
        KV_HEADS, TOPK, INDEX_DIM, BLOCK, kl_deterministic.forward_entries_per_item(HEADS, KV_HEADS))
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES", 1000 * per_query)
    windows = kl_deterministic.indexer_kl(*backend_arguments("indexer_kl", *args))
    torch.testing.assert_close(windows[0], one_window[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(windows[2:], one_window[2:], strict=True):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        assert _relative_error(a.nan_to_num(neginf=0), b.nan_to_num(neginf=0)) < 1e-5
    windows_grads = kl_deterministic.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *backward_args))
    for name, a, b in zip(("d index_q", "d index_k"), windows_grads, one_window_grads, strict=True):
        assert _relative_error(a, b) < 1e-3, (name, _relative_error(a, b))


@pytest.mark.parametrize("selection", ["random", "skewed"])
def test_m3_deterministic_loss_and_gradients_match_reference(selection, deterministic_algorithms):
    """The deterministic kernels at M3 shapes, on a suffix pack, against the reference (the
    skewed selection splits block 0 over many items)."""
    from torch_msa.index_loss import sparse_deterministic as kl_deterministic

    args = _problem("suffix-pack", selection)
    got = kl_deterministic.indexer_kl(*backend_arguments("indexer_kl", *args))
    want = reference_index_loss.indexer_kl(*backend_arguments("indexer_kl", *args))
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=1e-5)
    names = ("index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    for name, a, b in zip(names, got[2:], want[2:], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _relative_error(a.nan_to_num(neginf=0), b.nan_to_num(neginf=0)) < 1e-3, name
    q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, max_q, max_k, block_size, _, index_scale = args
    backward_args = (torch.tensor(1.0, device="cuda"), index_q, index_k, *want[2:], block_indices, cu_q, cu_k,
                     max_q, max_k, block_size, index_scale)
    backend_form = backend_arguments("indexer_kl_backward", *backward_args)
    for name, a, b in zip(("d index_q", "d index_k"), kl_deterministic.indexer_kl_backward(*backend_form),
                          reference_index_loss.indexer_kl_backward(*backend_form), strict=True):
        assert _relative_error(a, b) < 1e-2, (name, _relative_error(a, b))


@pytest.mark.parametrize(("layout", "selection"), [("4K", "index"), ("pack", "index"), ("suffix-pack", "skewed")])
def test_m3_loss_from_teacher_matches_the_float64_reference(layout, selection):
    """`index_loss_from_teacher`, default and deterministic, on the fp16 teacher of
    `teacher_probabilities` against the reference's in float64 on the same teacher; its loss is
    the loss of the path that computes the teacher, up to the teacher's fp16 rounding."""
    from torch_msa.index_loss import sparse as kl_kernel
    from torch_msa.index_loss import sparse_deterministic as kl_deterministic

    args = _problem(layout, selection)
    q, k, lse, index_q, index_k, block_indices, cu_q, cu_k, max_q, max_k, block_size, scale, index_scale = args
    documents = Documents(cu_q, cu_k, max_q, max_k)
    teacher = reference_index_loss.teacher_probabilities(q, k, lse, block_indices, documents, block_size, scale).half()
    assert teacher.shape == (q.shape[0], KV_HEADS, TOPK, BLOCK)
    grad_loss = torch.tensor(1.0, device="cuda")
    want = reference_index_loss.index_loss_from_teacher(teacher.double(), grad_loss.double(), index_q.double(),
                                                index_k.double(), block_indices, documents, block_size, index_scale)
    computed_teacher_loss = reference_index_loss.indexer_kl(*backend_arguments("indexer_kl", *args))[0]
    torch.testing.assert_close(want[0].float(), computed_teacher_loss, rtol=2e-3, atol=1e-5)
    runs = {}
    for name, module in (("default", kl_kernel), ("deterministic", kl_deterministic)):
        runs[name] = got = module.index_loss_from_teacher(teacher, grad_loss, index_q, index_k, block_indices, documents,
                                                          block_size, index_scale)
        assert got[0].dtype == torch.float32
        torch.testing.assert_close(got[0].double(), want[0], rtol=2e-3, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        for grad, a, b, x in zip(("d index_q", "d index_k"), got[1:], want[1:], (index_q, index_k), strict=True):
            assert a.dtype == x.dtype and a.shape == x.shape, (name, grad)
            assert _relative_error(a, b) < 1e-2, (name, grad, _relative_error(a, b))
    again = kl_deterministic.index_loss_from_teacher(teacher, grad_loss, index_q, index_k, block_indices, documents,
                                                     block_size, index_scale)
    for a, b in zip(again, runs["deterministic"], strict=True):
        assert torch.equal(a, b)
    loss_only = kl_kernel.index_loss_from_teacher(teacher, None, index_q, index_k, block_indices, documents, block_size,
                                                  index_scale)
    assert loss_only[1:] == (None, None) and torch.equal(loss_only[0], runs["default"][0])


def test_training_step_through_the_public_api():
    q, k, _, index_q, index_k, _, cu_q, cu_k, max_q, max_k, *_ = _problem("pack", "random")
    q, k, v = q.requires_grad_(), k.requires_grad_(), torch.randn_like(k).requires_grad_()
    index_q, index_k = index_q.requires_grad_(), index_k.requires_grad_()
    docs = (cu_q, cu_k, max_q, max_k)
    attn = torch_msa.msa_attention(q, k, v, index_q.detach(), index_k.detach(), *docs, return_lse=True,
                                   return_block_indices=True)
    lse, block_indices = attn.lse, attn.block_indices
    kl = torch_msa.indexer_kl_loss(q, k, lse, index_q, index_k, block_indices, *docs)
    (attn.out.float().square().mean() + kl).backward()
    assert kl.dtype == torch.float32 and torch.isfinite(kl) and kl > 0
    for x in (q, k, v, index_q, index_k):
        assert x.grad is not None and torch.isfinite(x.grad).all()
    want = reference_index_loss.indexer_kl(*backend_arguments(
        "indexer_kl", q.detach(), k.detach(), lse.detach(), index_q.detach(), index_k.detach(), block_indices, *docs,
        BLOCK, DIM**-0.5, INDEX_DIM**-0.5))[0]
    torch.testing.assert_close(kl.detach(), want, rtol=2e-3, atol=1e-5)


def test_dense_warm_up_is_served_by_the_triton_kernels():
    q, k, _, index_q, index_k, _, cu_q, cu_k, max_q, max_k, *_ = _problem("suffix-pack", "random")
    docs = (cu_q, cu_k, max_q, max_k)
    index_q, index_k = index_q.requires_grad_(), index_k.requires_grad_()
    assert torch_msa.resolve("indexer_kl", q.device).name == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the reference would warn
        loss = torch_msa.indexer_kl_loss_dense(q, k, index_q, index_k, *docs)
        loss.backward()
    want = reference_index_loss.indexer_kl(*backend_arguments("indexer_kl", q, k, None, index_q.detach(), index_k.detach(), None,
                                                      *docs, BLOCK, DIM**-0.5, INDEX_DIM**-0.5))[0]
    torch.testing.assert_close(loss.detach(), want, rtol=2e-3, atol=1e-5)
    assert torch.isfinite(index_q.grad).all() and torch.isfinite(index_k.grad).all()
