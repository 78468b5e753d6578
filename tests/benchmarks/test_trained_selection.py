"""The benchmark's `trained` selection regime: the fixture's codec, the committed fixture, the mapping."""

import pytest
import torch

import torch_msa
from benchmarks import cli, trained_selection
from benchmarks.problems import ProblemSpec, make_inputs
from torch_msa.contract import M3
from torch_msa.testing import cu_seqlens, random_block_indices


def test_codec_round_trips_selections_in_contract_order(tmp_path):
    lengths = [700, 129, 1000]
    cu = cu_seqlens(lengths)[0]
    selection = random_block_indices(cu, cu, 3, 5, 64, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "fixture.npz"
    path.write_bytes(trained_selection.encode(selection, lengths, 64, ["a", "b", "c"], {"step": 7}))
    loaded = trained_selection.load(path)
    assert loaded.lengths == tuple(lengths) and loaded.streams == ("a", "b", "c") and loaded.meta == {"step": 7}
    assert torch.equal(loaded.block_indices.sort(-1).values, selection.sort(-1).values)  # the same sets
    position = torch.cat([torch.arange(n) for n in lengths])
    valid = loaded.block_indices >= 0
    last = valid.sum(-1, keepdim=True) - 1
    assert torch.equal(loaded.block_indices.gather(-1, last).squeeze(-1), (position // 64).expand(3, -1))  # local last
    assert torch.equal(valid, valid.cummin(-1).values)  # valid ids first, -1 after


def test_the_committed_fixture_is_small_and_a_valid_selection():
    assert trained_selection.FIXTURE.stat().st_size <= trained_selection.MAX_BYTES
    fixture = trained_selection.load()
    assert (fixture.topk, fixture.block_size) == (M3.topk, M3.block_size)
    lengths = trained_selection.split_beyond_trained((3 * min(fixture.lengths) + 1000,), min(fixture.lengths))
    assert lengths == (min(fixture.lengths),) * 3 + (1000,)
    block_indices = trained_selection.selection_for(fixture, lengths, M3.kv_heads, M3.topk, M3.block_size)
    assert block_indices.shape == (M3.kv_heads, sum(lengths), M3.topk)
    cu = cu_seqlens(list(lengths))[0]
    q = torch.zeros(sum(lengths), M3.kv_heads, 64, dtype=torch.bfloat16)
    torch_msa.validate_inputs(q, q, q, block_indices, cu, cu, block_size=M3.block_size)
    # KV head h takes stream h % streams; the last document is the prefix of the next fixture document.
    streams = len(fixture.streams)
    start = sum(fixture.lengths[: 3 % len(fixture.lengths)])
    assert torch.equal(block_indices[M3.kv_heads - 1, -1000:], fixture.block_indices[(M3.kv_heads - 1) % streams,
                                                                                      start:start + 1000])


def test_mapping_refuses_what_it_cannot_serve():
    fixture = trained_selection.load()
    with pytest.raises(ValueError, match="the fixture selects top-16 blocks of 128; the problem asks for top-8 of 128"):
        trained_selection.selection_for(fixture, (100,), 4, 8, 128)
    with pytest.raises(ValueError, match="lengths: expected documents of at most"):
        trained_selection.selection_for(fixture, (min(fixture.lengths) + 1,), 4, 16, 128)
    with pytest.raises(ValueError, match="no fixture at"):
        trained_selection.load.__wrapped__(trained_selection.FIXTURE.with_name("missing.npz"))


def test_bench_splits_documents_beyond_the_trained_length():
    trained_length = min(trained_selection.load().lengths)
    args = cli.parse_args(["--device", "cpu", "--selection", "trained", "--seqlens", "1000",
                           str(trained_length * 2)])
    assert [p.lengths for p in args.problems] == [(1000,), (trained_length, trained_length)]
    assert [p.pack for p in args.problems] == [False, True]
    inputs = make_inputs(ProblemSpec((1000,)), M3, torch.device("cpu"), "trained", seed=0)
    assert torch.equal(inputs.block_indices, trained_selection.selection_for(trained_selection.load(), (1000,), 4, 16, 128))
