"""FLOP formulas of the msa ops under `torch.utils.flop_counter.FlopCounterMode`."""

import subprocess
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

import torch_msa
from torch_msa import flops
from torch_msa.testing import cu_seqlens, random_block_indices

HQ, HKV, D, DI, BLOCK, TOPK = 4, 2, 64, 32, 64, 3


def _counts(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return {str(op): count for op, count in counter.get_flop_counts()["Global"].items()}


def test_the_three_ops_count_their_nominal_work():
    cu_q, cu_k = cu_seqlens([100, 60], [130, 60])
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(tq, HQ, D, requires_grad=True)
    k, v = (torch.randn(tk, HKV, D, requires_grad=True) for _ in range(2))
    block_indices = random_block_indices(cu_q, cu_k, HKV, TOPK, BLOCK)

    def step():
        torch_msa.select_blocks(torch.randn(tq, HKV, DI), torch.randn(tk, 1, DI), cu_q, cu_k, 100, 130,
                                topk=TOPK, block_size=BLOCK)
        out, lse = torch_msa.sparse_attention(q, k, v, block_indices, cu_q, cu_k, 100, 130,
                                              block_size=BLOCK, return_lse=True)
        (out.sum() + lse.sum()).backward()

    pairs = tq * TOPK * BLOCK  # nominal: topk * block_size keys per query and head
    assert _counts(step) == {
        "msa.select_blocks": 2 * DI * HKV * tq * 130,
        "msa.forward": 4 * HQ * D * pairs,
        "msa.backward": 2 * (3 * D + 2 * D) * HQ * pairs,
    }


def test_nominal_work_bounds_the_valid_work_of_the_benchmark():
    """The registered counts are an upper bound of the benchmark's valid-pair accounting."""
    from benchmarks import flops as bench_flops
    from torch_msa.contract import Shape
    from torch_msa.documents import locate_queries

    shape = Shape(query_heads=HQ, kv_heads=HKV, head_dim=D, index_dim=DI, block_size=BLOCK, topk=TOPK)
    cu_q, cu_k = cu_seqlens([300])
    block_indices = random_block_indices(cu_q, cu_k, HKV, TOPK, BLOCK)
    position = locate_queries(cu_q, cu_k, 300, 300).position
    work = bench_flops.work(shape, [300], block_indices, position)
    shapes = dict(q=(300, HQ, D), block_indices=tuple(block_indices.shape))
    nominal_forward = flops.forward_flops(shapes["q"], None, None, shapes["block_indices"], None, None, 300, 300,
                                          BLOCK, 0.1)
    assert work.msa_forward < nominal_forward
    assert work.msa_backward == 2.5 * work.msa_forward
    assert work.index_scoring < flops.select_blocks_flops((300, HKV, DI), (300, 1, DI), None, None, 300, 300, TOPK, BLOCK)


def test_registration_waits_for_the_flop_counter_import():
    """torch.utils.flop_counter imports triton, so `import torch_msa` does not import it; the
    formulas are registered when it is imported later."""
    script = (
        "import sys, torch, torch_msa\n"
        "assert 'torch.utils.flop_counter' not in sys.modules and 'triton' not in sys.modules\n"
        "from torch.utils.flop_counter import FlopCounterMode, flop_registry\n"
        "assert all(getattr(torch.ops.msa, name) in flop_registry\n"
        "           for name in ('select_blocks', 'forward', 'backward'))\n"
        "import inspect, torch.utils.flop_counter as module\n"
        "assert 'FlopCounterMode' in inspect.getsource(module)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
