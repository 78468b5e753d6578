"""The Triton dense-support KL kernels at M3 shapes against the reference. Skipped without CUDA;
run on the H200.

M3: Hq = 64, Hkv = 4, D = 128, index heads 4 x 128, bf16 inputs. Both sides accumulate in fp32;
the kernels round probabilities to bf16 in the teacher-term and student GEMMs, so the gradients
are compared by relative Frobenius error (about 1e-3 from that rounding, O(1) for a wrong row).
"""

import pytest
import torch

from tests.support.documents import Documents, backend_arguments
from torch_msa import reference_index_loss
from torch_msa.testing import cu_seqlens

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("junk_in_uninitialized_buffers")]

HEADS, KV_HEADS, DIM, INDEX_DIM = 64, 4, 128, 128
SCALES = (DIM**-0.5, INDEX_DIM**-0.5)
LAYOUTS = {
    "4K": ([4096], [4096]),
    "pack": ([1000, 3000, 77, 1, 0, 2178], [1000, 3000, 77, 1, 0, 2178]),
    "suffix-pack": ([700, 129, 2000], [2600, 129, 2000]),
}


def _problem(layout, seed=0):
    q_lens, k_lens = LAYOUTS[layout]
    cu_q, cu_k = cu_seqlens(q_lens, k_lens, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])

    def tensor(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    q, k = tensor(tq, HEADS, DIM), tensor(tk, KV_HEADS, DIM)
    index_q, index_k = tensor(tq, KV_HEADS, INDEX_DIM), tensor(tk, 1, INDEX_DIM)
    return q, k, index_q, index_k, (cu_q, cu_k, max(q_lens), max(k_lens))


def _relative_error(got, want):
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("with_lse", [False, True], ids=["lse-computed", "lse-given"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_m3_dense_loss_and_gradients_match_reference(layout, with_lse):
    from torch_msa.index_loss import dense as kl_dense_kernel

    q, k, index_q, index_k, docs = _problem(layout)
    lse = None
    if with_lse:  # the exact lse, shifted so that the teacher's mass is not 1
        lse = reference_index_loss.indexer_kl(*backend_arguments("indexer_kl", q, k, None, index_q, index_k, None, *docs, 128,
                                                         *SCALES))[1]
        lse = lse + 0.1 * torch.randn_like(lse)
    got = kl_dense_kernel.indexer_kl_dense(q, k, lse, index_q, index_k, Documents(*docs), *SCALES)
    want = reference_index_loss.indexer_kl(
        *backend_arguments("indexer_kl", q, k, lse, index_q, index_k, None, *docs, 128, *SCALES))
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=1e-5)
    names = ("teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    for name, a, b in zip(names, got[1:], want[1:], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        assert _relative_error(a.nan_to_num(neginf=0), b.nan_to_num(neginf=0)) < 1e-3, name

    # Each backward from its own forward's outputs.
    grad_loss = torch.tensor(1.0, device="cuda")
    expected = reference_index_loss.indexer_kl_backward(*backend_arguments("indexer_kl_backward", grad_loss, index_q, index_k,
                                                                   *want[2:], None, *docs, 128, SCALES[1]))
    actual = kl_dense_kernel.indexer_kl_dense_backward(grad_loss, index_q, index_k, *got[2:], Documents(*docs), SCALES[1])
    for name, a, b in zip(("d index_q", "d index_k"), actual, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _relative_error(a, b) < 1e-2, (name, _relative_error(a, b))


def test_m3_dense_kernels_at_32k_add_memory_linear_in_tokens():
    """One 32K document: the forward and backward allocate their O(T) outputs and gradients,
    nothing of size T x T (which alone would be 4 GiB in fp32)."""
    from torch_msa.index_loss import dense as kl_dense_kernel

    tokens = 32768
    q, k, index_q, index_k, _ = _problem("4K")  # compile and warm on a small problem first
    del q, k, index_q, index_k
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(tokens, HEADS, DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    index_q = torch.randn(tokens, KV_HEADS, INDEX_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    index_k = torch.randn(tokens, 1, INDEX_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    documents = Documents(cu, cu, tokens, tokens)
    loss, _, *saved = kl_dense_kernel.indexer_kl_dense(q, k, None, index_q, index_k, documents, *SCALES)
    grads = kl_dense_kernel.indexer_kl_dense_backward(torch.tensor(1.0, device="cuda"), index_q, index_k, *saved,
                                                      documents, SCALES[1])
    torch.cuda.synchronize()
    added = torch.cuda.max_memory_allocated() - before
    # fp32 per token: teacher lse (Hq), student lse, mass and weighted (Hi each), teacher index
    # keys (Hi x Di) and queries (Di); bf16 gradients (Hi x Di + Di); the document tables.
    per_token = 4 * (HEADS + 3 * KV_HEADS + KV_HEADS * INDEX_DIM + INDEX_DIM) + 2 * (KV_HEADS + 1) * INDEX_DIM + 16
    assert added <= 2 * per_token * tokens, (added, per_token * tokens)
    assert torch.isfinite(loss) and loss > 0
    assert all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize("layout", ["pack", "suffix-pack"])
def test_m3_deterministic_dense_forward_is_bitwise_and_close_to_the_default(layout):
    """Under deterministic algorithms the dense forward takes its teacher's index queries from the
    key-tile-outer kernel: two calls agree bitwise, and every output is the default forward's up
    to rounding (that kernel recomputes the teacher with transposed GEMMs, whose fp32 sums round
    apart, and splits those probabilities into two bf16 halves, about 16 bits, like the default)."""
    from torch_msa.index_loss import dense as kl_dense_kernel

    q, k, index_q, index_k, docs = _problem(layout)
    default = kl_dense_kernel.indexer_kl_dense(q, k, None, index_q, index_k, Documents(*docs), *SCALES)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [kl_dense_kernel.indexer_kl_dense(q, k, None, index_q, index_k, Documents(*docs), *SCALES) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(previous)
    names = ("loss", "teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    for name, a, b in zip(names, *runs, strict=True):
        assert torch.equal(a, b), name
    for name, a, b in zip(names, runs[0], default, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        assert _relative_error(a.nan_to_num(neginf=0), b.nan_to_num(neginf=0)) < 1e-4, name


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_m3_query_fragments_match_reference(deterministic, request):
    """A context-parallel rank's zigzag share of a pack (the first and last quarter of one
    document, the middle of another) as query fragments over the documents' whole keys: forward
    and backward against the reference, with the default forward and the deterministic one."""
    from torch_msa.index_loss import dense as kl_dense_kernel
    from torch_msa.testing import fragments

    if deterministic:
        request.getfixturevalue("deterministic_algorithms")
    frag = fragments((3000, 1096), ((0, 0, 750), (1, 274, 548), (0, 2250, 750)), "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    num_queries, num_keys = int(frag.cu_seqlens_q[-1]), int(frag.cu_seqlens_k[-1])

    def tensor(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    q, k = tensor(num_queries, HEADS, DIM), tensor(num_keys, KV_HEADS, DIM)
    index_q, index_k = tensor(num_queries, KV_HEADS, INDEX_DIM), tensor(num_keys, 1, INDEX_DIM)
    documents = Documents(*frag.op_args, *frag.tensors)
    got = kl_dense_kernel.indexer_kl_dense(q, k, None, index_q, index_k, documents, *SCALES)
    want = reference_index_loss.indexer_kl(*backend_arguments("indexer_kl", q, k, None, index_q, index_k, None, *frag.op_args,
                                                      128, *SCALES, *frag.tensors))
    torch.testing.assert_close(got[0], want[0], rtol=2e-3, atol=1e-5)
    names = ("teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    for name, a, b in zip(names, got[1:], want[1:], strict=True):
        assert _relative_error(a.nan_to_num(neginf=0), b.nan_to_num(neginf=0)) < 1e-3, name
    grad_loss = torch.tensor(1.0, device="cuda")
    expected = reference_index_loss.indexer_kl_backward(*backend_arguments(
        "indexer_kl_backward", grad_loss, index_q, index_k, *want[2:], None, *frag.op_args, 128, SCALES[1], *frag.tensors))
    actual = kl_dense_kernel.indexer_kl_dense_backward(grad_loss, index_q, index_k, *got[2:], documents, SCALES[1])
    for name, a, b in zip(("d index_q", "d index_k"), actual, expected):
        assert _relative_error(a, b) < 1e-2, (name, _relative_error(a, b))
