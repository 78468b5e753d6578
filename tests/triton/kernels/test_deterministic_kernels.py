"""The Triton deterministic backward against the reference at small shapes, and bitwise repeats.

Where and how they run, and why in fp32 and fp16: `tests/support/triton_kernels.py`.
"""

import pytest
import torch
from torch.profiler import profile

from tests.support.determinism import deterministic_algorithms
from tests.support.documents import backend_arguments, documents_of
from tests.support.triton_kernels import (
    ATTENTION_CASES,
    DEVICE,
    TOLERANCE,
    close,
    junk_indices,
    layout,
    require_a_device,
)
from tests.support.uninitialized import allocate_with
from torch_msa import reference, testing
from torch_msa.plan import kernels as plan_kernels
from torch_msa.plan.schedule import build_schedule, entries_per_item
from torch_msa.stages import deterministic as backward_deterministic_kernel
from torch_msa.triton import backward as backward_kernel
from torch_msa.triton import backward_deterministic
from torch_msa.triton import forward as forward_kernel
from torch_msa.triton_utils import common
from torch_msa.uninitialized import uninitialized

require_a_device()


DETERMINISTIC_CASES = ("pack-empty-and-1-token", "suffix-pack-group3")


@pytest.mark.parametrize("case", DETERMINISTIC_CASES)
def test_deterministic_backward_matches_reference_and_repeats_bitwise(case, monkeypatch):
    """Junk and repeated ids, grad_lse, a pack with an empty and a 1-token document, Lq < Lk.

    Items of one tile split every bucket the queries share, so the reduction of dK/dV sums
    several items whose last positions differ."""
    monkeypatch.setattr(backward_deterministic_kernel, "ITEM_TILES", 1)
    q_lens, k_lens, num_heads, num_kv_heads, dim, block_size, topk, dtype = ATTENTION_CASES[case]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout(q_lens, k_lens)
    block_indices = junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    entries_per_item = common.tile_shape(num_heads, num_kv_heads,
                                         backward_kernel.DETERMINISTIC_BLOCKS_CONFIGS[0].rows)[0]
    bucket_sizes = build_schedule(block_indices, documents_of(cu_q, cu_k), num_keys, block_size,
                                  entries_per_item).bucket_ptr.diff()
    assert (bucket_sizes > entries_per_item).any(), "no bucket is split over several items"
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, dim**-0.5)
    out, lse = reference.forward(*backend_arguments("forward", q, k, v, *args))
    grad_out = torch.randn_like(q)
    grad_lse = torch.randn(num_queries, num_heads, device=DEVICE)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args, grad_lse))
    first = backward_deterministic.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args, grad_lse))
    second = backward_deterministic.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args, grad_lse))
    for name, got, again, want in zip(("dq", "dk", "dv"), first, second, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        close(got, want, 4 * TOLERANCE[dtype], name)
        assert torch.equal(got, again), f"{name} differs between two runs"


def test_deterministic_backward_of_a_skewed_selection_without_grad_lse(monkeypatch):
    """Every query picks block 0 and its newest blocks: block 0's bucket spans many items."""
    monkeypatch.setattr(backward_deterministic_kernel, "ITEM_TILES", 1)
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout([150, 60], [300, 60])
    num_heads, num_kv_heads, dim, block_size, topk = 4, 1, 64, 64, 3
    block_indices = testing.skewed_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=torch.float16)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=torch.float16) for _ in range(2))
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, 0.3)
    out, lse = reference.forward(*backend_arguments("forward", q, k, v, *args))
    grad_out = torch.randn_like(q)
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args))
    grads = backward_deterministic.backward(*backend_arguments("backward", grad_out, q, k, v, out, lse, *args))
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        close(got, want, 4 * TOLERANCE[torch.float16], name)


ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty"}


def test_deterministic_mode_fills_no_buffer_the_kernels_write(monkeypatch):
    """Under `torch.use_deterministic_algorithms(True)` PyTorch fills each `torch.empty` with NaN
    (`torch.utils.deterministic.fill_uninitialized_memory`), a pass over memory as large as the
    buffer. The forward's output, lse and partials and the deterministic backward's gradients
    and workspaces are written by their kernels before they are read, so none is filled: the
    only fills inside an allocation are of empty tensors, and the test's own `torch.empty`."""
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    allocate_with(monkeypatch, uninitialized)  # not the junk the conftest hands every test here
    q_lens, k_lens, num_heads, num_kv_heads, dim, block_size, topk, dtype = ATTENTION_CASES["suffix-pack-group3"]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout(q_lens, k_lens)
    block_indices = junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    q = torch.randn(num_queries, num_heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(num_keys, num_kv_heads, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    grad_out = torch.randn_like(q)
    # The step's plan, built once outside (msa::plan's output is returned to the caller whole).
    plan = plan_kernels.plan(block_indices, documents_of(cu_q, cu_k), num_keys, block_size,
                             entries_per_item(num_heads, num_kv_heads))
    args = (block_indices, cu_q, cu_k, max_q, max_k, block_size, dim**-0.5)

    def step():
        out, lse = forward_kernel.forward(*backend_arguments("forward", q, k, v, *args, plan=plan))
        return out, backward_deterministic.backward(
            *backend_arguments("backward", grad_out, q, k, v, out, lse, *args, plan=plan))

    with deterministic_algorithms():
        with profile(record_shapes=True) as trace:
            torch.empty(7)  # the one fill the profile must show
            out, grads = step()
        again = step()
    # Allocations the code asks for itself; `torch.zeros` and `torch.full` fill theirs anyway.
    filled = [(event.cpu_parent.name, event.input_shapes[0]) for event in trace.events()
              if event.name == "aten::fill_" and event.cpu_parent is not None
              and event.cpu_parent.name in ALLOCATIONS and event.cpu_parent.cpu_parent is None]
    assert [shape for _, shape in filled if 0 not in shape] == [[7]], filled
    # What the kernels wrote is what the reference computes, bitwise the same twice.
    assert all(torch.equal(x, y) for x, y in zip((out, *grads), (again[0], *again[1])))
    expected_out, expected_lse = reference.forward(*backend_arguments("forward", q, k, v, *args))
    close(out, expected_out, TOLERANCE[dtype], "out")
    expected = reference.backward(*backend_arguments("backward", grad_out, q, k, v, expected_out, expected_lse, *args))
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected):
        close(got, want, 4 * TOLERANCE[dtype], name)
