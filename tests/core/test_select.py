"""`msa::select_blocks` against brute force, including ties and the edge cases of the contract."""

import pytest
import torch

import torch_msa
from tests.support import dense, install
from tests.support.documents import Documents
from torch_msa.testing import cu_seqlens

LAYOUTS = {
    "one_doc": ([700], None),
    "pack": ([70, 0, 333, 1, 129], None),
    "suffix": ([50, 0, 130, 3], [400, 10, 130, 260]),
    "short": ([5], [9]),
}


@pytest.mark.parametrize("topk", [1, 2, 4, 16])
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_brute_force(layout, block_size, topk):
    q_lens, k_lens = LAYOUTS[layout]
    cu_q, cu_k = cu_seqlens(q_lens, k_lens)
    iq = torch.randn(int(cu_q[-1]), 2, 32)
    ik = torch.randn(int(cu_k[-1]), 1, 32)
    max_q, max_k = max(q_lens), max(k_lens or q_lens)
    chosen = torch_msa.select_blocks(iq, ik, cu_q, cu_k, max_q, max_k, topk=topk, block_size=block_size)
    dense.check_selection(chosen, iq, ik, cu_q, cu_k, topk, block_size)


def test_m3_shape_bf16():
    cu_q, cu_k = cu_seqlens([2600])
    iq = torch.randn(2600, 4, 128, dtype=torch.bfloat16)
    ik = torch.randn(2600, 1, 128, dtype=torch.bfloat16)
    chosen = torch_msa.select_blocks(iq, ik)
    dense.check_selection(chosen, iq, ik, cu_q, cu_k, 16, 128)
    assert (chosen[:, 2048:] >= 0).all()  # every query past 16 blocks keeps all 16 slots
    assert (chosen[:, :128, 1:] == -1).all()  # the first block only sees itself


def test_ties_prefer_lower_block_ids():
    """All-zero index inputs tie every block: the lowest ids win, local block last."""
    iq = torch.zeros(1000, 3, 64)
    ik = torch.zeros(1000, 1, 64)
    chosen = torch_msa.select_blocks(iq, ik, topk=4, block_size=64)
    for t in (0, 63, 64, 200, 999):
        nvb = t // 64 + 1
        kept = list(range(min(3, nvb - 1)))
        expected = kept + [nvb - 1] + [-1] * (4 - len(kept) - 1)
        assert chosen[:, t].tolist() == [expected] * 3, t


def test_partial_ties_at_the_threshold():
    """Blocks 2 and 5 tie for the last kept slot: block 2 wins."""
    block_size = 64
    ik = torch.zeros(8 * block_size, 1, 4)
    values = {0: 5.0, 2: 1.0, 3: 3.0, 5: 1.0, 6: 0.5}
    for block, value in values.items():
        ik[block * block_size, 0, 0] = value
    iq = torch.zeros(8 * block_size, 1, 4)
    iq[:, 0, 0] = 1.0
    chosen = torch_msa.select_blocks(iq, ik, topk=4, block_size=block_size)
    last = chosen[0, -1].tolist()  # nvb = 8, local block 7
    assert sorted(last[:3]) == [0, 2, 3] and last[3] == 7


def test_scores_only_visible_keys():
    """A huge score just past a query's position must not make its block win."""
    ik = torch.zeros(256, 1, 4)
    iq = torch.ones(256, 1, 4)
    ik[100, 0, 0] = 100.0  # in block 1, visible only from position 100 on
    ik[10, 0, 0] = 1.0  # block 0
    chosen = torch_msa.select_blocks(iq, ik, topk=2, block_size=64)
    # Position 140 (block 2): block 1 (max 100 at key 100) beats block 0.
    assert chosen[0, 140].tolist() == [1, 2]
    # Position 99 is in block 1 (local): only block 0 is a candidate.
    assert chosen[0, 99].tolist() == [0, 1]


def test_empty_and_degenerate():
    empty = torch_msa.select_blocks(torch.zeros(0, 2, 16), torch.zeros(0, 1, 16), topk=3, block_size=64)
    assert empty.shape == (2, 0, 3) and empty.dtype == torch.int32
    cu_q, cu_k = cu_seqlens([0, 1, 0], [0, 1, 0])
    one = torch_msa.select_blocks(torch.randn(1, 2, 16), torch.randn(1, 1, 16), cu_q, cu_k, topk=3, block_size=64)
    assert one.tolist() == [[[0, -1, -1]], [[0, -1, -1]]]


def test_small_max_seqlen_stays_in_contract():
    """A max_seqlen_k below the truth narrows the candidates but never breaks the contract."""
    iq = torch.randn(640, 1, 16)
    ik = torch.randn(640, 1, 16)
    chosen = torch_msa.select_blocks(iq, ik, None, None, 640, 128, topk=4, block_size=64)
    torch_msa.validate_inputs(torch.randn(640, 1, 64), torch.randn(640, 1, 64), torch.randn(640, 1, 64), chosen,
                              block_size=64)
    assert chosen[0, -1].tolist() in ([0, 1, 9, -1], [1, 0, 9, -1])  # only blocks 0, 1 were scored


def test_bounded_working_set_gives_the_same_selection(monkeypatch):
    """A tiny memory budget (one query and one block of keys at a time) changes nothing."""
    from torch_msa import reference

    cu_q, cu_k = cu_seqlens([300, 0, 90], [420, 5, 90])
    iq, ik = torch.randn(390, 2, 32), torch.randn(515, 1, 32)
    expected = torch_msa.select_blocks(iq, ik, cu_q, cu_k, topk=3, block_size=64)
    monkeypatch.setattr(reference, "_CHUNK_BYTES_CPU", 1)
    assert torch.equal(torch_msa.select_blocks(iq, ik, cu_q, cu_k, topk=3, block_size=64), expected)


def test_triton_selection_stays_a_few_host_calls(monkeypatch):
    """The Triton selection's host work, counted without a GPU (the kernels replaced by counters):
    the `-1` fill of the result, the two tables of where each query sits, and two launches (the
    tables in one kernel rather than a few dozen small torch ops, each a host-side launch in eager
    mode)."""
    pytest.importorskip("triton", reason=install.TRITON)
    from tests.support.host_calls import CountOps, KernelLaunches
    from torch_msa.triton import select as select_kernel
    from torch_msa.triton_utils import common

    launches = KernelLaunches(monkeypatch)
    launches.replace(common, "msa_locate_kernel")
    launches.replace(select_kernel, "msa_select_kernel")
    cu_q, cu_k = cu_seqlens([300, 200])
    iq, ik = torch.randn(500, 4, 128), torch.randn(500, 1, 128)
    with CountOps() as counted:
        select_kernel.select_blocks(iq, ik, Documents(cu_q, cu_k, 300, 300), 16, 128)
    assert launches.names == ["msa_locate_kernel", "msa_select_kernel"]
    assert [str(op) for op in counted.calls] == ["aten.full.default", *["aten.empty.memory_format"] * 2], counted.calls
