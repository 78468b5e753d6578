"""The Triton selection kernel against the reference and the dense float64 check at small shapes.

Where and how they run, and why in fp32 and fp16: `tests/support/triton_kernels.py`.
"""

import pytest
import torch

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
# Under the interpreter (on CPU, half a minute a run) the block-128 case runs in fp16 only: the
# other cases cover the fp32 loads and precision there.
SELECT_RUNS = [(case, dtype) for case in SELECT_CASES for dtype in (torch.float32, torch.float16)
               if not (INTERPRETING and case == "block128-topk-beyond" and dtype == torch.float32)]


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
