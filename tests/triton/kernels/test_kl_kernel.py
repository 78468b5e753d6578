"""The Triton KL kernels (`torch_msa/index_loss/sparse.py`) against the reference at small shapes
(their deterministic variant: `test_kl_deterministic_kernel.py`).

Run natively on a CUDA host, or on CPU under the Triton interpreter by
`tests/triton/test_interpret.py`; fp32 and fp16 only (the interpreter's bf16 `tl.dot` is wrong,
see `tests/support/triton_kernels.py`).
"""


import pytest
import torch

from tests.support.documents import backend_arguments
from tests.support.triton_kernels import DEVICE, require_a_device
from torch_msa import reference, reference_index_loss, testing
from torch_msa.backends import UnsupportedInputs
from torch_msa.index_loss import sparse as kl_kernel
from torch_msa.index_loss import sparse_deterministic as kl_deterministic

require_a_device()

# (q lengths, k lengths, Hq, Hkv, D, Di, block, topk, dtype)
CASES = {
    "pack-empty-1-token-suffix": ([40, 0, 1, 90], [140, 5, 1, 90], 4, 2, 64, 32, 64, 3, torch.float32),
    "group3-fp16-d128": ([70], [200], 6, 2, 128, 16, 64, 2, torch.float16),
    "mha-topk-beyond-blocks": ([130], [130], 2, 2, 64, 16, 64, 16, torch.float32),
    "group16-two-head-passes": ([50, 20], [150, 20], 16, 1, 64, 16, 64, 2, torch.float32),
    "group32-four-head-passes": ([30], [100], 32, 1, 64, 16, 64, 2, torch.float32),
}


@pytest.mark.parametrize("case", CASES)
def test_kl_forward_and_backward_match_reference(case):
    q_lens, k_lens, num_heads, num_kv_heads, dim, index_dim, block_size, topk, dtype = CASES[case]
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens, DEVICE)
    num_queries, num_keys = sum(q_lens), sum(k_lens)
    block_indices = testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    if topk > 1:  # out-of-contract ids are read as a set
        block_indices[0, :, -1] = block_indices[0, :, 0]
        block_indices[-1, ::3, 0] = 10_000
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype)
    index_q = torch.randn(num_queries, num_kv_heads, index_dim, device=DEVICE, dtype=dtype)
    index_k = torch.randn(num_keys, 1, index_dim, device=DEVICE, dtype=dtype)
    docs = (cu_q, cu_k, max(q_lens), max(k_lens))
    scales = (dim**-0.5, index_dim**-0.5)
    _, lse = reference.forward(*backend_arguments("forward", q, k, v, block_indices, *docs, block_size, scales[0]))
    args = (q, k, lse, index_q, index_k, block_indices, *docs, block_size, *scales)
    expected = reference_index_loss.indexer_kl(*backend_arguments("indexer_kl", *args))
    got = kl_kernel.indexer_kl(*backend_arguments("indexer_kl", *args))
    tolerance = 2e-5 if dtype == torch.float32 else 3e-3
    names = ("loss", "teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    assert len(got) == len(names)
    # A custom op's outputs never share storage (torch.library.opcheck's schema check).
    storages = [t.untyped_storage().data_ptr() for t in got if t.numel()]
    assert len(set(storages)) == len(storages), "outputs share storage"
    for name, a, b in zip(names, got, expected):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = max(1.0, b.nan_to_num(neginf=0).abs().max().item())
        # The teacher's reductions take their fp32 weights in two halves of a 16-bit dtype, so
        # they keep fp32 accuracy where one rounding to fp16 would be off by ~1e-4.
        close = 2e-5 if name.startswith("teacher_index") else tolerance
        torch.testing.assert_close(a, b, rtol=close, atol=close * scale, msg=lambda m, name=name: f"{name}: {m}")

    grad_loss = torch.tensor(1.7, device=DEVICE)
    backward_args = (grad_loss, index_q, index_k, *expected[2:], block_indices, *docs, block_size, scales[1])
    for name, a, b in zip(("d index_q", "d index_k"), kl_kernel.indexer_kl_backward(*backend_arguments("indexer_kl_backward",
                                                                                                       *backward_args)),
                          reference_index_loss.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *backward_args))):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        # Both sides start from the same index_lse and teacher terms: the gradients differ by
        # little more than their final rounding to the index dtype.
        scale = b.float().abs().max().item()
        close = 1e-4 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(a.float(), b.float(), rtol=close, atol=close * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_kl_kernels_decline_what_they_do_not_serve():
    index_q = torch.zeros(4, 2, 16, device=DEVICE)
    with pytest.raises(UnsupportedInputs, match="no lse"):
        kl_kernel.check_inputs(False, index_q)
    with pytest.raises(UnsupportedInputs, match="index head dim 24"):
        kl_kernel.check_inputs(True, torch.zeros(4, 2, 24, device=DEVICE))
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(UnsupportedInputs, match="deterministic"):
            kl_kernel.check_atomics_allowed()
    finally:
        torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("module", [kl_kernel, kl_deterministic], ids=["default", "deterministic"])
@pytest.mark.parametrize("poisoned", ["q", "k", "index_q", "index_k"])
def test_a_non_finite_document_changes_no_other_documents_index_gradients(poisoned, module):
    """Documents end mid-block (key blocks of 64 over documents of 50, 40 and 30 tokens), so an
    item's block holds the next document's keys; NaN/Inf in document 1 must leave the forward's
    per-query and per-key outputs and the index gradients of documents 0 and 2 finite and equal
    to a clean run's, with the default kernels and with the deterministic ones."""
    lengths = [50, 40, 30]
    cu_q, cu_k = testing.cu_seqlens(lengths, lengths, DEVICE)
    num_tokens, num_heads, num_kv_heads, dim, index_dim, block_size, topk = sum(lengths), 2, 1, 64, 16, 64, 2
    generator = torch.Generator().manual_seed(3)
    clean = {
        "q": torch.randn(num_tokens, num_heads, dim, generator=generator),
        "k": torch.randn(num_tokens, num_kv_heads, dim, generator=generator),
        "index_q": torch.randn(num_tokens, num_kv_heads, index_dim, generator=generator),
        "index_k": torch.randn(num_tokens, 1, index_dim, generator=generator),
    }
    clean = {name: x.to(DEVICE) for name, x in clean.items()}
    dirty = dict(clean)
    dirty[poisoned] = clean[poisoned].clone()
    dirty[poisoned][50:90:2] = float("nan")
    dirty[poisoned][51:90:2] = float("inf")
    block_indices = torch.arange(topk, dtype=torch.int32, device=DEVICE)
    block_indices = block_indices.expand(num_kv_heads, num_tokens, topk).contiguous()
    docs = (cu_q, cu_k, max(lengths), max(lengths))
    scales = (dim**-0.5, index_dim**-0.5)

    def outputs(x):
        """The forward's per-query and per-key outputs, then the index gradients."""
        _, lse = reference.forward(*backend_arguments("forward", x["q"], x["k"], x["k"], block_indices, *docs, block_size,
                                                      scales[0]))
        args = (x["q"], x["k"], lse, x["index_q"], x["index_k"], block_indices, *docs, block_size, *scales)
        _, _, *kept = module.indexer_kl(*backend_arguments("indexer_kl", *args))
        gradients = module.indexer_kl_backward(*backend_arguments(
            "indexer_kl_backward", torch.tensor(1.0, device=DEVICE), x["index_q"], x["index_k"], *kept, block_indices,
            *docs, block_size, scales[1]))
        return (*kept, *gradients)

    names = ("index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries", "d index_q", "d index_k")
    want, got = outputs(clean), outputs(dirty)
    for name, a, b in zip(names, got, want):
        for rows in (slice(0, 50), slice(90, 120)):
            assert a[rows].isfinite().all(), f"{name} rows {rows} are not finite"
            torch.testing.assert_close(a[rows], b[rows], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, rows=rows: f"{name} {rows}: {m}")


def test_fragments_match_reference():
    """Query fragments sharing their documents' keys (out of order, several per document, an empty
    and a 1-token document, junk ids): the loss, the forward's outputs and the gradients."""
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
    expected = reference_index_loss.indexer_kl(*backend_arguments("indexer_kl", *args))
    got = kl_kernel.indexer_kl(*backend_arguments("indexer_kl", *args))
    assert expected[0] > 0 and expected[4].abs().sum() > 0
    names = ("loss", "teacher_lse", "index_lse", "teacher_mass", "teacher_index_keys", "teacher_index_queries")
    for name, a, b in zip(names, got, expected, strict=True):
        scale = max(1.0, b.nan_to_num(neginf=0).abs().max().item())
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * scale, msg=lambda m, name=name: f"{name}: {m}")
    backward_args = (torch.tensor(1.3, device=DEVICE), index_q, index_k, *expected[2:], block_indices, *frag.op_args,
                     block_size, scales[1], *fragments)
    for name, a, b in zip(("d index_q", "d index_k"), kl_kernel.indexer_kl_backward(*backend_arguments("indexer_kl_backward",
                                                                                                       *backward_args)),
                          reference_index_loss.indexer_kl_backward(*backend_arguments("indexer_kl_backward", *backward_args))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")
