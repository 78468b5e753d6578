"""The Triton selection kernel against the reference and the dense float64 check at small shapes.

Where and how they run, and why in fp32 and fp16: `tests/support/triton_kernels.py`.
"""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from tests.support import dense
from tests.support.documents import Documents, backend_arguments
from tests.support.triton_kernels import (
    DEVICE,
    INTERPRETING,
    layout,
    require_a_device,
)
from torch_msa import reference
from torch_msa.triton import select as select_kernel

require_a_device()


SELECT_CASES = {
    "pack": ([40, 0, 1, 300], [140, 5, 1, 300], 2, 32, 64, 4),
    "suffix-non-pow2-dim": ([30, 170], [400, 170], 3, 48, 64, 3),
    "block128-topk-beyond": ([300], [300], 4, 128, 128, 16),
}
SELECT_RUNS = [(case, dtype) for case in SELECT_CASES for dtype in (torch.float32, torch.float16)]


@pytest.mark.parametrize("case, dtype", SELECT_RUNS,
                         ids=[f"{case}-{str(dtype).removeprefix('torch.')}" for case, dtype in SELECT_RUNS])
def test_selection_matches_reference(case, dtype):
    q_lens, k_lens, num_heads, index_dim, block_size, topk = SELECT_CASES[case]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout(q_lens, k_lens)
    index_q = torch.randn(num_queries, num_heads, index_dim, device=DEVICE, dtype=dtype)
    index_k = torch.randn(num_keys, 1, index_dim, device=DEVICE, dtype=dtype)
    args = (index_q, index_k, cu_q, cu_k, max_q, max_k, topk, block_size)
    chosen = select_kernel.select_blocks(*backend_arguments("select_blocks", *args))
    dense.check_selection(chosen.cpu(), index_q.cpu(), index_k.cpu(), cu_q.cpu(), cu_k.cpu(), topk, block_size)
    assert torch.equal(chosen, reference.select_blocks(*backend_arguments("select_blocks", *args)))


def test_selection_reads_strided_boundaries():
    """`cu_seqlens` views with a stride of 2 select exactly as their contiguous copies."""
    q_lens, k_lens, num_heads, index_dim, block_size, topk = SELECT_CASES["pack"]
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout(q_lens, k_lens)
    index_q = torch.randn(num_queries, num_heads, index_dim, device=DEVICE)
    index_k = torch.randn(num_keys, 1, index_dim, device=DEVICE)
    strided_q, strided_k = (torch.stack((cu, -cu), 1)[:, 0] for cu in (cu_q, cu_k))
    assert strided_q.stride(0) == 2
    expected = select_kernel.select_blocks(index_q, index_k, Documents(cu_q, cu_k, max_q, max_k), topk, block_size)
    got = select_kernel.select_blocks(index_q, index_k, Documents(strided_q, strided_k, max_q, max_k), topk, block_size)
    assert torch.equal(got, expected)


def test_selection_ties_prefer_the_lower_block():
    """Integer scores tie everywhere; the contract keeps the lower ids, like the reference."""
    cu_q, cu_k, num_queries, num_keys, max_q, max_k = layout([260, 200], [520, 200])
    index_q = torch.randint(-1, 2, (num_queries, 2, 16), device=DEVICE).float()
    index_k = torch.randint(-1, 2, (num_keys, 1, 16), device=DEVICE).float()
    args = (index_q, index_k, cu_q, cu_k, max_q, max_k, 3, 64)
    assert torch.equal(select_kernel.select_blocks(*backend_arguments("select_blocks", *args)),
                       reference.select_blocks(*backend_arguments("select_blocks", *args)))


@triton.jit
def _xor_sum_and_sort(x, xor_out, sorted_out, COLUMNS: tl.constexpr, ROWS: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * COLUMNS + tl.arange(0, COLUMNS)[None, :]
    tile = tl.load(x + offsets)
    tl.store(xor_out + tl.arange(0, ROWS), tl.xor_sum(tile, axis=1))
    tl.store(xor_out + ROWS + tl.arange(0, COLUMNS), tl.xor_sum(tile, axis=0))
    tl.store(sorted_out + offsets, tl.sort(tile, dim=1, descending=True))


@pytest.mark.skipif(not INTERPRETING, reason="needs a host without a CUDA device: the check is of the Triton "
                                             "interpreter's reductions (tests/triton/kernels/conftest.py)")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_the_interpreters_numpy_xor_sum_equals_its_element_loop(dtype, monkeypatch):
    """`xor_sum` and `tl.sort` (which reduces with it) give the same bits through the numpy path of
    tests/triton/kernels/conftest.py as through the interpreter's own element loop, and those of
    numpy and torch."""
    from triton.runtime import interpreter

    from tests.triton.kernels import conftest

    rows, columns = 4, 16
    x = torch.randint(torch.iinfo(dtype).min, torch.iinfo(dtype).max, (rows, columns), dtype=dtype, device=DEVICE)

    def run():
        xor, ordered = torch.empty(rows + columns, dtype=dtype, device=DEVICE), torch.empty_like(x)
        _xor_sum_and_sort[(1,)](x, xor, ordered, COLUMNS=columns, ROWS=rows)
        return xor, ordered

    fast = run()
    assert interpreter.ReduceOps.apply_impl is not conftest.element_loop_apply_impl
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", conftest.element_loop_apply_impl)
    slow = run()
    for got, want in zip(fast, slow, strict=True):
        assert torch.equal(got, want)
    data = x.numpy()
    expected_xor = np.concatenate([np.bitwise_xor.reduce(data, axis=1), np.bitwise_xor.reduce(data, axis=0)])
    assert np.array_equal(fast[0].numpy(), expected_xor)
    assert torch.equal(fast[1], x.sort(dim=1, descending=True).values)
