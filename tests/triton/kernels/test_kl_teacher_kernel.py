"""The Triton KL loss from a given teacher (`index_loss_from_teacher` of `torch_msa/index_loss/sparse.py`
and of `kl_deterministic.py`) against the reference's at small shapes, on an fp16 teacher from
`reference_index_loss.teacher_probabilities`.

Run natively on a CUDA host, or on CPU under the Triton interpreter by
`tests/triton/test_interpret.py`; fp32 and fp16 index inputs only (the interpreter's bf16
`tl.dot` is wrong, see `tests/support/triton_kernels.py`). Every case has junk ids (repeats, ids far past the
horizon or near the int32 limit, -1 in a first slot), which the kernels must neither read nor
count.
"""


import pytest
import torch

from tests.support.documents import Documents
from tests.support.triton_kernels import DEVICE, require_a_device
from torch_msa import query_windows, reference, reference_index_loss, testing
from torch_msa.backends import UnsupportedInputs
from torch_msa.index_loss import sparse as kl_kernel
from torch_msa.index_loss import sparse_deterministic as kl_deterministic

require_a_device()

HEADS, KV_HEADS, DIM, BLOCK, TOPK = 4, 2, 64, 64, 3
SCALE = DIM**-0.5
MODULES = {"default": kl_kernel, "deterministic": kl_deterministic}
# (q lengths, k lengths, Di, index dtype); "fragments": query fragments of a pack instead.
LAYOUTS = {
    "one-document": ([130], [130], 32, torch.float32),
    "pack-empty-1-token-suffix": ([40, 0, 1, 90], [140, 5, 1, 90], 32, torch.float32),
    "fragments": (None, None, 32, torch.float32),
    "fp16-index": ([70], [200], 16, torch.float16),
}


def _problem(layout, seed=0):
    """`(teacher, index_q, index_k, block_indices, documents, block_size, index_scale)` with an fp16 teacher
    from `teacher_probabilities` of the attention's own lse, and `support` (bool, the slots' keys
    that teacher covers: positive fp32 probabilities)."""
    q_lens, k_lens, index_dim, dtype = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(seed)
    if q_lens is None:
        frag = testing.fragments((150, 0, 1, 90), ((3, 40, 50), (0, 0, 60), (2, 0, 1), (0, 60, 90), (3, 0, 40)), DEVICE)
        documents = Documents(*frag.op_args, *frag.tensors)
    else:
        cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens, DEVICE)
        documents = Documents(cu_q, cu_k, max(q_lens), max(k_lens))
    num_queries, num_keys = int(documents.cu_seqlens_q[-1]), int(documents.cu_seqlens_k[-1])
    block_indices = testing.random_block_indices(documents.cu_seqlens_q, documents.cu_seqlens_k, KV_HEADS, TOPK, BLOCK,
                                                 generator, *documents.fragments)
    block_indices[0, :, -1] = block_indices[0, :, 0]
    block_indices[-1, ::3, 0] = 10_000
    block_indices[-1, 1::4, 1] = 2**31 - 1
    block_indices[0, 2::5, 0] = -1

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    q, k, v = randn(num_queries, HEADS, DIM), randn(num_keys, KV_HEADS, DIM), randn(num_keys, KV_HEADS, DIM)
    index_q, index_k = randn(num_queries, KV_HEADS, index_dim, dtype=dtype), randn(num_keys, 1, index_dim, dtype=dtype)
    _, lse = reference.forward(q, k, v, block_indices, documents, BLOCK, SCALE, None)
    teacher = reference_index_loss.teacher_probabilities(q, k, lse, block_indices, documents, BLOCK, SCALE)
    return (teacher.half(), index_q, index_k, block_indices, documents, BLOCK, index_dim**-0.5), teacher > 0


def _assert_close(got, want, dtype):
    loss_tolerance, grad_tolerance = (2e-5, 1e-4) if dtype == torch.float32 else (3e-3, 2e-3)
    assert got[0].dtype == want[0].dtype and got[0].dim() == 0
    torch.testing.assert_close(got[0], want[0], rtol=loss_tolerance, atol=loss_tolerance)
    for name, a, b in zip(("d index_q", "d index_k"), got[1:], want[1:], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = b.float().abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(a.float(), b.float(), rtol=grad_tolerance, atol=grad_tolerance * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _assert_equal(got, want):
    for name, a, b in zip(("loss", "d index_q", "d index_k"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_from_teacher_matches_reference(layout, module):
    """The loss and gradients of the reference on the same fp16 teacher; the slots and keys
    outside the support are not read (NaN there changes nothing: bitwise in deterministic mode,
    within the tolerance where the default kernels add with atomics), and the deterministic
    variant repeats bitwise."""
    args, support = _problem(layout)
    teacher, index_q = args[0], args[1]
    grad_loss = torch.tensor(1.7, device=DEVICE)
    want = reference_index_loss.index_loss_from_teacher(teacher, grad_loss, *args[1:])
    assert want[0] > 0 and (~support).any()
    got = MODULES[module].index_loss_from_teacher(teacher, grad_loss, *args[1:])
    _assert_close(got, want, index_q.dtype)
    poisoned = teacher.masked_fill(~support, float("nan"))
    from_poisoned = MODULES[module].index_loss_from_teacher(poisoned, grad_loss, *args[1:])
    if module == "deterministic":
        _assert_equal(from_poisoned, got)
        _assert_equal(kl_deterministic.index_loss_from_teacher(teacher, grad_loss, *args[1:]), got)
    else:
        assert not any(x.isnan().any() for x in from_poisoned)
        _assert_close(from_poisoned, want, index_q.dtype)


@pytest.mark.parametrize("module", MODULES)
def test_loss_alone_without_grad_loss(module):
    args, _ = _problem("pack-empty-1-token-suffix")
    with_grads = MODULES[module].index_loss_from_teacher(args[0], torch.tensor(1.0, device=DEVICE), *args[1:])
    loss, d_index_q, d_index_k = MODULES[module].index_loss_from_teacher(args[0], None, *args[1:])
    assert d_index_q is None and d_index_k is None
    assert torch.equal(loss, with_grads[0])


def test_split_buckets_and_query_windows_match_reference(monkeypatch):
    """Deterministic, items of 16 entries (a key block over several items) and a budget of 37
    queries' workspace (windows whose boundaries fall inside documents and fragments)."""
    monkeypatch.setattr(kl_deterministic, "backward_entries_per_item", lambda num_index_heads: 16)
    args, _ = _problem("fragments")
    per_query = kl_deterministic.partial_bytes_per_query(KV_HEADS, TOPK, args[1].shape[-1], BLOCK, 16)
    monkeypatch.setattr(query_windows, "PARTIAL_BYTES", 37 * per_query)
    launches = []
    launch = kl_deterministic.launch_forward_from_teacher

    def counted(*call_args):
        launches.append(call_args[0].shape[0])
        return launch(*call_args)

    monkeypatch.setattr(kl_deterministic, "launch_forward_from_teacher", counted)
    grad_loss = torch.tensor(0.6, device=DEVICE)
    got = kl_deterministic.index_loss_from_teacher(args[0], grad_loss, *args[1:])
    num_queries = args[1].shape[0]
    assert len(launches) == -(-num_queries // 37) and sum(launches) == num_queries
    _assert_close(got, reference_index_loss.index_loss_from_teacher(args[0], grad_loss, *args[1:]), torch.float32)
    _assert_equal(kl_deterministic.index_loss_from_teacher(args[0], grad_loss, *args[1:]), got)


@pytest.mark.parametrize("module", MODULES)
def test_a_non_finite_document_changes_no_other_documents_gradients(module):
    """Documents end mid-block (blocks of 64 over documents of 50, 40 and 30 tokens), so an
    item's block holds the next document's keys: NaN/Inf in document 1's teacher (its slots'
    rows) and index keys leave the gradients of documents 0 and 2 finite and equal to a clean run's."""
    lengths = [50, 40, 30]
    cu_q, cu_k = testing.cu_seqlens(lengths, lengths, DEVICE)
    documents = Documents(cu_q, cu_k, max(lengths), max(lengths))
    generator = torch.Generator().manual_seed(3)
    num_tokens, index_dim = sum(lengths), 16
    index_q = torch.randn(num_tokens, KV_HEADS, index_dim, generator=generator).to(DEVICE)
    index_k = torch.randn(num_tokens, 1, index_dim, generator=generator).to(DEVICE)
    teacher = torch.rand(num_tokens, KV_HEADS, 2, BLOCK, generator=generator).to(DEVICE, torch.float16)
    block_indices = torch.arange(2, dtype=torch.int32, device=DEVICE).expand(KV_HEADS, num_tokens, 2).contiguous()
    dirty_teacher, dirty_index_k = teacher.clone(), index_k.clone()
    dirty_teacher[50:90:2], dirty_index_k[50:90:2] = float("nan"), float("nan")
    dirty_teacher[51:90:2], dirty_index_k[51:90:2] = float("inf"), float("inf")
    grad_loss = torch.tensor(1.0, device=DEVICE)
    clean = MODULES[module].index_loss_from_teacher(teacher, grad_loss, index_q, index_k, block_indices, documents,
                                                    BLOCK, 0.25)
    dirty = MODULES[module].index_loss_from_teacher(dirty_teacher, grad_loss, index_q, dirty_index_k, block_indices,
                                                    documents, BLOCK, 0.25)
    for name, a, b in zip(("d index_q", "d index_k"), dirty[1:], clean[1:], strict=True):
        for rows in (slice(0, 50), slice(90, 120)):
            assert a[rows].isfinite().all(), f"{name} rows {rows} are not finite"
            torch.testing.assert_close(a[rows], b[rows], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, rows=rows: f"{name} {rows}: {m}")


def test_the_default_gradients_decline_under_deterministic_algorithms(deterministic_algorithms):
    """Their reductions add with atomics; the loss alone has none and is served."""
    args, _ = _problem("one-document")
    with pytest.raises(UnsupportedInputs, match="deterministic"):
        kl_kernel.index_loss_from_teacher(args[0], torch.tensor(1.0, device=DEVICE), *args[1:])
    loss, *_ = kl_kernel.index_loss_from_teacher(args[0], None, *args[1:])
    assert torch.equal(loss, kl_deterministic.index_loss_from_teacher(args[0], None, *args[1:])[0])


def test_empty_inputs_give_zero_loss_and_gradients():
    documents = Documents(*testing.cu_seqlens([0], [0], DEVICE), 0, 0)
    index_q, index_k = torch.zeros(0, KV_HEADS, 32, device=DEVICE), torch.zeros(0, 1, 32, device=DEVICE)
    block_indices = torch.zeros(KV_HEADS, 0, TOPK, dtype=torch.int32, device=DEVICE)
    teacher = torch.zeros(0, KV_HEADS, TOPK, BLOCK, dtype=torch.float16, device=DEVICE)
    for module in MODULES.values():
        loss, d_index_q, d_index_k = module.index_loss_from_teacher(teacher, torch.tensor(1.0, device=DEVICE), index_q,
                                                                    index_k, block_indices, documents, BLOCK, 0.25)
        assert loss.item() == 0 and d_index_q.shape == index_q.shape and d_index_k.shape == index_k.shape
