"""`python -m benchmarks`: FLOP formulas, the FlexAttention mask, timing, failure handling,
the targets and the command line (CPU at tiny sizes; one CUDA test runs every peer)."""

import json
import os
import pathlib
import re
import runpy
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import torch_msa
from benchmarks import cli, command, devices, flops, msa, peers, problems, runner, targets, timing
from benchmarks.flex_mask import TILE_ROWS, fold_query_heads, kv_heads_first, msa_block_mask
from benchmarks.problems import Inputs, ProblemSpec, describe_sharing, make_inputs, parse_pack, parse_seqlens
from benchmarks.results import ERROR, OK, OOM, SKIPPED, STEP_TOLERANCE, BenchResult, ProblemResult, Row
from benchmarks.subject import Measurement, Subject
from benchmarks.timing import Timing, is_out_of_memory, measure
from tests.support import install
from tests.support.terminal import FakeTerminal, screen
from torch_msa import backends
from torch_msa._progress import Progress
from torch_msa.contract import M3, Shape
from torch_msa.testing import random_block_indices

CPU = torch.device("cpu")
# A tiny topology: 2 KV heads of 4 query heads, so a 128-row query tile holds 32 tokens.
SMALL = Shape(query_heads=8, kv_heads=2, head_dim=64, index_dim=32, block_size=64, topk=3)


def _brute_force_keys(block_ids: list[int], position: int, block_size: int) -> int:
    """Keys a query at `position` reads: the distinct valid blocks' keys up to the causal horizon."""
    keys = set()
    for block in block_ids:
        if block >= 0:
            keys.update(j for j in range(block * block_size, block * block_size + block_size) if j <= position)
    return len(keys)


# ---------------------------------------------------------------------------------------------
# FLOP accounting


def test_keys_per_token_is_the_performance_md_formula():
    positions = torch.arange(5000)
    closed = flops.keys_per_token(positions, block_size=128, topk=16)
    formula = [(t % 128) + 1 + 128 * min(15, t // 128) for t in range(5000)]
    assert closed.tolist() == formula
    assert flops.keys_per_token(torch.tensor([-1]), 128, 16).tolist() == [0]


def test_m3_work_of_one_document_has_the_known_numbers():
    # T = 4096: tokens 0..2047 read every earlier key (2048 * 2049 / 2 pairs); tokens 2048..4095
    # read 15 full blocks plus their local block: 2048 * 1920 + 16 * (1 + ... + 128).
    tokens = 4096
    position = torch.arange(tokens)
    expected_pairs = 2048 * 2049 // 2 + 2048 * 1920 + 16 * (128 * 129 // 2)
    assert expected_pairs == 6162432
    for block_indices in (
        torch_msa.testing.skewed_block_indices(*torch_msa.testing.cu_seqlens([tokens]), 4, 16, 128),
        random_block_indices(*torch_msa.testing.cu_seqlens([tokens]), 4, 16, 128,
                             generator=torch.Generator().manual_seed(1)),
    ):
        work = flops.work(M3, [tokens], block_indices, position)
        assert work.attended_pairs == expected_pairs
        assert work.msa_forward == 32768 * expected_pairs  # 4 * Hq * D * S
        assert work.msa_backward == 2.5 * work.msa_forward == 81920 * expected_pairs
        assert work.causal_pairs == tokens * (tokens + 1) // 2
        assert work.index_scoring == 2 * 128 * 4 * tokens * (tokens + 1) // 2
        assert work.dense_forward == 4 * 64 * 128 * tokens * (tokens + 1) // 2
        assert work.dense_backward == 2.5 * work.dense_forward
        assert work.msa_step == work.index_scoring + 3.5 * work.msa_forward


def test_selected_keys_counts_the_actual_indices_as_sets():
    # Documents not aligned to blocks, and ids outside the contract: -1, repeats, past the horizon.
    cu_q, cu_k = torch_msa.testing.cu_seqlens([300, 70, 1, 200])
    block_size, topk, heads = 64, 4, 3
    block_indices = random_block_indices(cu_q, cu_k, heads, topk, block_size,
                                         generator=torch.Generator().manual_seed(2))
    position = torch_msa.documents.locate_queries(cu_q, cu_k, 571, 571).position
    valid = flops.selected_key_counts(block_indices, position, block_size)
    assert torch.equal(valid, flops.keys_per_token(position, block_size, topk).expand(heads, -1))
    broken = block_indices.clone()
    broken[0, 250] = torch.tensor([1, 1, -1, 3])
    broken[1, 299] = torch.tensor([4, 9, 0, 4])  # 9 is past the horizon of position 299
    broken[2, 10] = torch.tensor([-1, -1, -1, -1])
    counts = flops.selected_key_counts(broken, position, block_size)
    for head in range(heads):
        for t in (10, 250, 299, 300, 570):
            expected = _brute_force_keys(broken[head, t].tolist(), position[t].item(), block_size)
            assert counts[head, t].item() == expected, (head, t)
    assert counts[0, 250].item() == 64 + 59  # block 1, and keys 192..250 of block 3


def test_tflops():
    assert flops.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert flops.tflops(None, 1.0) is None and flops.tflops(1.0, None) is None


# ---------------------------------------------------------------------------------------------
# Problems and selections


def test_parse_seqlens_and_pack():
    assert parse_seqlens(["8K,32K", "65536", "1M"]) == [8192, 32768, 65536, 2**20]
    assert parse_pack("8x16K") == (16384,) * 8
    assert parse_pack("2x4k, 8K,1000") == (4096, 4096, 8192, 1000)
    assert parse_pack("none") is None
    for bad, argument in (("8x", "--pack"), ("ax4K", "--pack"), ("0x4K", "--pack"), ("4G", "--pack")):
        with pytest.raises(ValueError, match=argument):
            parse_pack(bad)
    with pytest.raises(ValueError, match="--seqlens"):
        parse_seqlens(["0"])


def test_problem_names():
    assert ProblemSpec((8192,)).name == "T=8192"
    assert ProblemSpec((16384,) * 8, pack=True).name == "pack 8x16384"
    assert ProblemSpec((100, 100, 7, 100), pack=True).name == "pack 2x100+7+100"


def test_skewed_selection_picks_block_zero_and_the_newest_blocks():
    inputs = make_inputs(ProblemSpec((1000, 130, 5), pack=True), SMALL, CPU, "skewed", seed=0)
    assert inputs.block_indices.shape == (2, 1135, 3)
    assert inputs.block_indices[:, 999].tolist() == [[0, 14, 15]] * 2  # p = 999: 16 visible blocks
    assert inputs.block_indices[:, 1000 + 129].tolist() == [[0, 1, 2]] * 2  # p = 129: 3 visible blocks
    assert inputs.block_indices[:, 1000 + 5].tolist() == [[0, -1, -1]] * 2  # p = 5: only the local block
    torch_msa.validate_inputs(inputs.q, inputs.k, inputs.v, inputs.block_indices, inputs.cu_seqlens,
                              inputs.cu_seqlens, topk=3, block_size=64)


def test_the_tiled_selection_gives_each_query_tile_its_last_querys_row():
    lengths = (200, 130, 64)
    index = make_inputs(ProblemSpec(lengths, pack=True), SMALL, CPU, "index", seed=2)
    tiled = make_inputs(ProblemSpec(lengths, pack=True), SMALL, CPU, "tiled", seed=2)
    start = 0
    for length in lengths:
        for position in range(length):
            last = min((position // 64 + 1) * 64, length) - 1
            assert torch.equal(tiled.block_indices[:, start + position], index.block_indices[:, start + last])
        start += length
    torch_msa.validate_inputs(tiled.q, tiled.k, tiled.v, tiled.block_indices, tiled.cu_seqlens, tiled.cu_seqlens,
                              topk=3, block_size=64)
    # The first token of a tile with earlier blocks selects more than its own index row would allow.
    assert not torch.equal(tiled.block_indices, index.block_indices)


@pytest.mark.parametrize("block", [64, 32])
def test_bsa_block_lists_are_the_tiles_selections_ascending_per_query_head(block):
    shape = Shape(query_heads=8, kv_heads=2, head_dim=64, index_dim=32, block_size=64, topk=5)
    inputs = make_inputs(ProblemSpec((448,) * 2, pack=True), shape, CPU, "tiled", seed=3)
    lists, counts = peers._bsa_block_lists(inputs, block)
    split = 64 // block
    assert lists.shape == (2, 8, 448 // block, 5 * split) and lists.dtype == counts.dtype == torch.int32
    for document in range(2):
        for head in range(8):
            for tile in range(448 // block):
                token = document * 448 + min((tile // split + 1) * 64, 448) - 1
                chosen = sorted(b * split + s for b in set(inputs.block_indices[head // 4, token].tolist()) if b >= 0
                                for s in range(split))
                count = counts[document, head, tile].item()
                assert lists[document, head, tile, :count].tolist() == chosen
                assert lists[document, head, tile, count:].eq(0).all()


def test_cudnn_bsa_is_a_peer_only_where_it_can_run():
    inputs = make_inputs(ProblemSpec((256,)), SMALL, CPU, "tiled", seed=0)
    subject = peers.bsa_subject(inputs, 128)
    assert subject.impl == "cuDNN BSA blk128" and subject.phases == ("fwd", "bwd")
    assert "needs CUDA" in subject.skip_reason
    assert peers.bsa_subject(inputs, 64).phases == ("fwd",)


def test_the_sharing_note_gives_the_work_the_query_outer_rule_takes():
    # 8 query heads over 2 KV heads: 32-token groups, inside the tiled selection's 64-token tiles.
    note = describe_sharing(make_inputs(ProblemSpec((256,)), SMALL, CPU, "tiled", seed=0))
    assert "the plan's query-outer rule takes 100% of the pairs (32-token tiles 100% full, 100% of the rows" in note
    assert "the forward runs 0% of the pairs query-outer" in note  # the reference forward has no such part
    note = describe_sharing(make_inputs(ProblemSpec((1024,)), SMALL, CPU, "index", seed=0))
    share = int(note.split("query-outer rule takes ")[1].split("%")[0])
    assert 0 < share < 100, note


@pytest.mark.parametrize(("setting", "runs"), [(None, False), ("1", True), ("0", False)])
def test_the_sharing_note_gives_the_work_the_forward_runs_query_outer(setting, runs, monkeypatch):
    """Where the forward resolves to `sm90`: by default none in a 1024-query document (the
    default's bound is 8192 queries at M3's heads), all the rule takes with `1`, none with `0`."""
    from torch_msa.settings import QUERY_OUTER_ENV

    monkeypatch.setattr(torch_msa, "resolve", lambda op, device: types.SimpleNamespace(name="sm90"))
    if setting is None:
        monkeypatch.delenv(QUERY_OUTER_ENV, raising=False)
    else:
        monkeypatch.setenv(QUERY_OUTER_ENV, setting)
    inputs = make_inputs(ProblemSpec((1024,)), M3, CPU, "tiled", seed=0)
    note = describe_sharing(inputs)
    assert "the plan's query-outer rule takes 100% of the pairs" in note
    assert f"the forward runs {100 if runs else 0}% of the pairs query-outer" in note, note


def test_the_query_outer_subject_times_the_forward_and_step_with_the_query_outer_part(monkeypatch):
    """`--query-outer` adds `torch_msa q-outer`: torch_msa's fwd and step, each call with
    `TORCH_MSA_QUERY_OUTER=1` set and the caller's value restored after it."""
    from torch_msa.contract import M3
    from torch_msa.settings import QUERY_OUTER_ENV

    def plain(inputs, max_reference_tokens):
        def measurements():
            for phase in msa.PHASES:
                yield Measurement(phase, lambda: os.environ.get(QUERY_OUTER_ENV), None)

        return Subject(msa.IMPL, msa.PHASES, measurements)

    monkeypatch.setattr(msa, "msa_subject", plain)
    monkeypatch.setenv(QUERY_OUTER_ENV, "0")
    subject = msa.query_outer_subject(None, 0)
    timed = list(subject.measurements())
    assert subject.impl == msa.QUERY_OUTER_IMPL and [m.phase for m in timed] == list(msa.QUERY_OUTER_PHASES)
    assert [m.fn() for m in timed] == ["1", "1"] and os.environ[QUERY_OUTER_ENV] == "0"
    monkeypatch.delenv(QUERY_OUTER_ENV)
    assert timed[0].fn() == "1" and QUERY_OUTER_ENV not in os.environ
    config = runner.Config(device=torch.device("cpu"), problems=(), shape=M3, query_outer=True)
    inputs = make_inputs(ProblemSpec((256,)), M3, torch.device("cpu"), "index", seed=0)
    assert [found.impl for found in runner.subjects(inputs, config)][-2:] == [msa.IMPL, msa.QUERY_OUTER_IMPL]
    assert cli.parse_args(["--query-outer", "--device", "cpu"]).query_outer


def test_the_sharing_command_prints_each_regimes_union_and_query_outer_work(capsys):
    from benchmarks import sharing

    assert sharing.main(["--device", "cpu", "--seqlens", "512", "--selection", "skewed", "index",
                         "--heads", "16/1"]) == 0
    header, skewed, index = capsys.readouterr().out.strip().splitlines()
    assert "query-outer" in header and skewed.split()[:2] == ["512", "skewed"] and index.split()[1] == "index"
    # Every query of an 8-token group picks block 0 and the newest blocks: all of it runs query-outer.
    assert skewed.split()[-3:] == ["100.0%", "100.0%", "100.0%"], skewed


def test_the_balance_command_compares_the_kernels_walk_with_an_in_order_fetch(capsys):
    from benchmarks import balance
    from torch_msa.plan.schedule import valid_entries

    work = torch.tensor([1, 4, 1, 4])
    assert balance.round_robin_loads(work, 2).tolist() == [2, 8]
    # 1 and 4 to each CTA; the second 1 to the first CTA (1 < 4), then the second 4 too (2 < 4).
    assert balance.in_order_loads(work, 2).tolist() == [6, 4]
    assert balance.round_robin_loads(torch.tensor([3]), 2).tolist() == [3, 0]
    # Rounds of two items: tokens {0, 1, 2}, then {5, 6}; the lower middle of [3, 2].
    assert balance.tokens_in_flight([torch.tensor([0, 1]), torch.tensor([1, 2]), torch.tensor([5]),
                                     torch.tensor([5, 6])], 2) == 2

    tokens, ctas = 1024, 4
    assert balance.main(["--seqlens", str(tokens), "--selection", "skewed", "--heads", "16/1",
                         "--ctas", str(ctas)]) == 0
    header, *lines = capsys.readouterr().out.strip().splitlines()
    assert "round-robin" in header and [line.split()[2] for line in lines] == ["plan", "deterministic"]
    # The same items from the selection: a block's bucket holds the (token, slot) pairs that
    # select it in token order, cut into items of 128 (plan) and 512 entries (deterministic: 64
    # tiles of 8 tokens); an item's work is its sm90 tiles of 4 tokens.
    inputs = make_inputs(ProblemSpec((tokens,)), cli.parse_heads("16/1"), torch.device("cpu"), "skewed", seed=0)
    valid = valid_entries(inputs.block_indices, torch.arange(tokens), 128)
    selected = [(block, token) for token, slot in valid[0].nonzero().tolist()
                for block in [int(inputs.block_indices[0, token, slot])]]
    buckets = [[token for block_of, token in sorted(selected) if block_of == block] for block in range(tokens // 128)]
    for line, size in zip(lines, (128, 512)):
        items = [bucket[start:start + size] for bucket in buckets for start in range(0, len(bucket), size)]
        work = torch.tensor([-(-len(item) // 4) for item in items])
        mean = work.sum().item() / ctas
        walked = [work[cta::ctas].sum().item() / mean for cta in range(ctas)]
        in_flight = sorted(len(set(sum(items[first:first + ctas], []))) for first in range(0, len(items), ctas))
        fields = line.split()
        assert (int(fields[3]), float(fields[4])) == (len(items), pytest.approx(mean, abs=0.5)), line
        assert (float(fields[6]), float(fields[7])) == (pytest.approx(max(walked), abs=5e-4),
                                                        pytest.approx(min(walked), abs=5e-4)), line
        assert float(fields[6]) >= float(fields[9]) >= 1.0, line  # the in-order fetch is no worse here
        assert int(fields[-1]) == in_flight[(len(in_flight) - 1) // 2], line


def test_the_deterministic_command_scales_each_documents_first_key(capsys, one_thread):
    from benchmarks import deterministic

    inputs = make_inputs(ProblemSpec((40, 24), pack=True), M3, torch.device("cpu"), "index", seed=0)
    k, v = inputs.k.clone(), inputs.v.clone()
    deterministic.with_outlier_keys(inputs, 8.0)
    first, rest = [0, 40], [t for t in range(64) if t not in (0, 40)]
    for name, before, after in (("k", k, inputs.k), ("v", v, inputs.v)):
        assert torch.equal(after[first], before[first] * 8), name
        assert torch.equal(after[rest], before[rest]), name
    assert deterministic.main(["--device", "cpu", "--seqlens", "64", "--warmup", "0", "--iters", "1",
                               "--outlier", "1000"]) == 0
    title, origin = capsys.readouterr().out.splitlines()[:2]
    assert "index selection, first keys x1000, on cpu" in title
    # The tree the run measured: the package this process imported.
    assert origin.startswith(f"torch_msa {torch_msa.__version__} from {os.path.dirname(torch_msa.__file__)} (")


def test_a_run_names_the_tree_it_measures_even_outside_git(monkeypatch):
    monkeypatch.setattr(command, "git_commit", lambda: "0123abc-dirty")
    assert command.torch_msa_origin().endswith(f"from {os.path.dirname(torch_msa.__file__)} (0123abc-dirty)")
    monkeypatch.setattr(command, "git_commit", lambda: None)
    assert command.torch_msa_origin().endswith("(not a git checkout)")


def test_the_deterministic_command_turns_the_nan_fill_off_for_its_run_alone(capsys, one_thread, monkeypatch):
    from benchmarks import deterministic

    seen = []
    monkeypatch.setattr(deterministic, "measure", lambda *args, **kwargs: seen.append(
        torch.utils.deterministic.fill_uninitialized_memory) or types.SimpleNamespace(median_ms=1.0))
    for argv, fill in ((["--no-fill"], False), ([], True)):
        seen.clear()
        assert deterministic.main(["--device", "cpu", "--seqlens", "64", "--warmup", "0", "--iters", "1", *argv]) == 0
        assert seen == [fill, fill], argv
        assert torch.utils.deterministic.fill_uninitialized_memory
    headers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("msa::backward")]
    assert [header.split("bf16, ")[1] for header in headers] == [
        "index selection, deterministic without NaN fill, on cpu", "index selection, on cpu"]


def test_the_deterministic_command_times_the_step_both_ways_and_measures_dq_against_fp32(capsys, one_thread):
    from benchmarks import deterministic

    assert deterministic.main(["--device", "cpu", "--seqlens", "64", "--warmup", "0", "--iters", "1",
                               "--step", "--error"]) == 0
    header, backward, *steps, error = capsys.readouterr().out.strip().splitlines()[2:]
    assert "speed share" in header and backward.split()[0] == "64"
    assert [step.split()[0] for step in steps] == ["step", "synced"]  # a CUDA graph only on CUDA
    for step in steps:
        _, default_ms, deterministic_ms, share = step.split()
        assert float(default_ms) > 0 and float(deterministic_ms) > 0
        assert share == f"{float(default_ms) / float(deterministic_ms):.0%}"
    assert error.startswith("dQ error")
    shares = re.findall(r"(default|deterministic|fp32 rounded) ([\d.e+-]+) / ([\d.e+-]+) / ([\d.e+-]+)", error)
    assert [name for name, *_ in shares] == ["default", "deterministic", "fp32 rounded"], error
    for name, *quantiles in shares:
        median, p99, largest = map(float, quantiles)
        # bf16 rounds to 2**-9 of a value; nothing beyond that moves dQ here.
        assert 0 < median <= p99 <= largest < 2**-7, (name, error)


def test_the_frontend_command_times_every_call_on_stubs_and_leaves_the_registry_as_it_was(capsys):
    from benchmarks import frontend

    before = backends.registered_backends()
    assert frontend.main(["--tokens", "64", "--heads", "16/1", "--iters", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "every op a stub" in lines[0]
    rows = {line[:20].strip(): float(line[20:]) for line in lines[1:]}
    assert list(rows) == ["select_blocks", "build_plan", "forward, plan given", "forward + backward",
                          "msa_attention step", "step + index loss"] and all(value > 0 for value in rows.values()), rows
    assert backends.registered_backends() == before


def test_inputs_use_torch_msa_selection():
    inputs = make_inputs(ProblemSpec((100, 150), pack=True), SMALL, CPU, "index", seed=3)
    assert torch.equal(inputs.block_indices, inputs.select())
    assert inputs.q.dtype == torch.bfloat16 and inputs.q.shape == (250, 8, 64)
    assert inputs.cu_seqlens.tolist() == [0, 100, 250] and inputs.max_seqlen == 150


# ---------------------------------------------------------------------------------------------
# FlexAttention's mask


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("lengths, selection",
                         [((300,), "index"), ((100, 230, 64, 1), "index"), ((64, 64, 129), "skewed")])
def test_flex_block_mask_is_exactly_the_msa_mask(lengths, selection):
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    shape = SMALL
    inputs = make_inputs(ProblemSpec(lengths, pack=len(lengths) > 1), shape, CPU, selection, seed=4)
    tokens, group, block_size = sum(lengths), shape.group, shape.block_size
    block_mask, stats = msa_block_mask(inputs.block_indices, inputs.key_start, inputs.position, tokens,
                                       group, block_size)
    expected = torch.zeros(shape.kv_heads, tokens * group, tokens, dtype=torch.bool)
    for head in range(shape.kv_heads):
        for t in range(tokens):
            start, position = inputs.key_start[t].item(), inputs.position[t].item()
            for block in {b for b in inputs.block_indices[head, t].tolist() if b >= 0}:
                end = min(block * block_size + block_size, position + 1)
                expected[head, t * group:(t + 1) * group, start + block * block_size:start + end] = True
    assert torch.equal(create_mask(block_mask.mask_mod, 1, shape.kv_heads, tokens * group, tokens, device="cpu")[0],
                       expected)
    # Full-width index tensors (older torch counts the KV blocks from their width).
    assert block_mask.kv_indices.shape[-1] == block_mask.full_kv_indices.shape[-1] == -(-tokens // block_size)
    # Every needed KV block is listed, as partial or full; a full one is all True.
    for head in range(shape.kv_heads):
        for tile in range(block_mask.kv_num_blocks.shape[-1]):
            partial = set(block_mask.kv_indices[0, head, tile, :block_mask.kv_num_blocks[0, head, tile]].tolist())
            full_count = block_mask.full_kv_num_blocks[0, head, tile]
            full = set(block_mask.full_kv_indices[0, head, tile, :full_count].tolist())
            assert not partial & full
            for kv_block in range(-(-tokens // block_size)):
                region = expected[head, tile * TILE_ROWS:(tile + 1) * TILE_ROWS,
                                  kv_block * block_size:(kv_block + 1) * block_size]
                assert (kv_block in partial | full) == bool(region.any())
                if kv_block in full:
                    assert region.shape[0] == TILE_ROWS and region.all()
    assert stats.tokens_per_tile == TILE_ROWS // group
    if selection == "skewed" or lengths == (300,):
        assert stats.full > 0  # aligned documents share blocks: the full path is exercised
    # And FlexAttention with it computes MSA.
    as_float = [x.float() for x in (inputs.q, inputs.k, inputs.v)]
    out = flex_attention(fold_query_heads(as_float[0], shape.kv_heads), kv_heads_first(as_float[1]),
                         kv_heads_first(as_float[2]), block_mask=block_mask)
    reference, _ = torch.ops.msa.forward(*as_float, inputs.block_indices, *inputs.document_args, block_size,
                                         shape.head_dim ** -0.5)
    torch.testing.assert_close(out, fold_query_heads(reference, shape.kv_heads), atol=1e-5, rtol=1e-5)


def test_flex_mask_rejects_a_group_that_splits_a_tile():
    with pytest.raises(ValueError, match="group"):
        msa_block_mask(torch.zeros(1, 4, 1, dtype=torch.int32), torch.zeros(4, dtype=torch.int64),
                       torch.arange(4), 4, group=3, block_size=64)


# ---------------------------------------------------------------------------------------------
# Timing and failure handling


def test_measure_counts_calls_and_returns_the_median():
    calls = []
    timing = measure(lambda: calls.append(1), CPU, warmup=3, iters=7)
    assert len(calls) == 10 and timing.runs == 7 and timing.warmups == 3 and not timing.capped
    assert timing.median_ms == sorted(timing.times_ms)[3]


def test_measure_caps_slow_calls_by_the_budget():
    timing = measure(lambda: time.sleep(0.02), CPU, warmup=2, iters=50, budget_s=0.1, min_runs=2)
    assert timing.capped and 2 <= timing.runs <= 6
    assert 15 < timing.median_ms < 200


def test_out_of_memory_is_recognised_also_when_wrapped():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    try:
        try:
            raise torch.cuda.OutOfMemoryError("boom")
        except RuntimeError as inner:
            raise ValueError("compiler failed") from inner
    except ValueError as outer:
        assert is_out_of_memory(outer)
    assert not is_out_of_memory(RuntimeError("No available kernel"))


@pytest.fixture
def one_thread():
    """The reference backend on one thread: on a 2-core machine whose other core is busy, two
    OpenMP threads contending for it made these runs several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(**overrides):
    settings = dict(device=CPU, problems=(), shape=SMALL, warmup=0, iters=1, budget_s=None)
    settings.update(overrides)
    return runner.Config(**settings)


def test_runner_records_oom_and_errors_and_goes_on(capsys):
    result = ProblemResult(ProblemSpec((10,)), None, "math dense")
    progress = Progress("T=10", 8)

    def oom_in_a_phase():
        yield Measurement("fwd", lambda: 1, 1e9)
        def allocate():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")
        yield Measurement("bwd", allocate, 1e9)

    def oom_while_preparing():
        yield Measurement("mask", lambda: 1, None)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory while building")

    def broken():
        yield Measurement("fwd", lambda: 1 / 0, 1.0)

    for subject in (Subject("a", ("fwd", "bwd"), oom_in_a_phase),
                    Subject("b", ("mask", "fwd", "bwd"), oom_while_preparing),
                    Subject("c", ("fwd",), broken), Subject("d", ("fwd", "bwd"), skip_reason="not here")):
        runner.run_subject(subject, result, _config(), progress)
    status = {(r.impl, r.phase): r.status for r in result.rows}
    assert status == {("a", "fwd"): OK, ("a", "bwd"): OOM, ("b", "mask"): OK, ("b", "fwd"): OOM,
                      ("b", "bwd"): OOM, ("c", "fwd"): "error", ("d", "fwd"): SKIPPED, ("d", "bwd"): SKIPPED}
    assert "could not prepare" in result.row("b", "bwd").note
    assert "ZeroDivisionError" in result.row("c", "fwd").note
    assert "ZeroDivisionError" in capsys.readouterr().err  # the traceback of an error goes to stderr


@pytest.mark.parametrize("selection", ["index", "skewed"])
def test_small_pack_runs_every_cpu_row(selection, one_thread):
    config = _config(problems=(ProblemSpec((100, 150, 7), pack=True),), selection=selection)
    result = runner.run_problem(config.problems[0], config)
    status = {(r.impl, r.phase): r.status for r in result.rows}
    for phase in ("fwd", "bwd", "fwd+bwd"):
        assert status["math dense", phase] == OK
    for phase in msa.PHASES + ("fwd+bwd",):
        assert status["torch_msa", phase] == OK, phase
    assert status["FlexAttention", "mask"] == status["FlexAttention", "fwd"] == OK
    assert status["FlexAttention", "bwd"] == SKIPPED
    assert status["fla parallel_nsa", "fwd"] == SKIPPED
    total = result.row("torch_msa", "fwd+bwd")
    assert total.derived and total.ms == result.row("torch_msa", "fwd").ms + result.row("torch_msa", "bwd").ms
    assert result.rows.index(total) == result.rows.index(result.row("torch_msa", "bwd")) + 1
    assert result.speedup(result.row("math dense", "fwd")) == 1.0
    assert result.speedup(result.row("torch_msa", "select+fwd+bwd")) == pytest.approx(
        result.row("math dense", "fwd+bwd").ms / result.row("torch_msa", "select+fwd+bwd").ms)


def _count_calls(monkeypatch, ms: float | None = None) -> list[tuple]:
    """`runner.measure` replaced: call i takes `ms`, or i ms; returns the (warmup, iters, budget_s) of each call."""
    calls = []

    def measure(fn, device, warmup, iters, budget_s=None, min_runs=5, synchronised=False):
        assert not synchronised, "off CUDA no phase is timed synchronised"
        calls.append((warmup, iters, budget_s))
        return Timing((float(len(calls)) if ms is None else ms,), warmup, False)

    monkeypatch.setattr(runner, "measure", measure)
    return calls


CPU_PHASES = [("math dense", "fwd"), ("math dense", "bwd"), *(("torch_msa", phase) for phase in msa.PHASES)]


def test_cpu_phases_are_timed_interleaved_one_run_per_round(monkeypatch):
    """Off CUDA every round times every phase once (the warm-ups in the first), so a change of
    the machine's load falls on all of them alike; a row's median is over its rounds."""
    calls = _count_calls(monkeypatch)
    config = _config(problems=(ProblemSpec((64,)),), warmup=1, iters=3, skip_peers=True)
    result = runner.run_problem(config.problems[0], config)
    timed = [row for row in result.rows if row.status == OK and not row.derived]
    assert [(row.impl, row.phase) for row in timed] == CPU_PHASES
    rounds = len(CPU_PHASES)
    assert calls == [(1, 1, None)] * rounds + [(0, 1, None)] * 2 * rounds
    for index, row in enumerate(timed, 1):  # the phase's calls are index, index + rounds, index + 2 rounds
        assert (row.runs, row.ms, row.capped) == (3, index + rounds, False), row


def test_interleaved_rounds_stop_at_the_time_budget(monkeypatch):
    calls = _count_calls(monkeypatch, ms=40.0)
    config = _config(problems=(ProblemSpec((64,)),), iters=3, budget_s=0.05, min_runs=2, skip_peers=True)
    result = runner.run_problem(config.problems[0], config)
    timed = [row for row in result.rows if row.status == OK and not row.derived]
    # 3 runs of 40 ms exceed the 50 ms budget; the 2 runs of min_runs remain.
    assert len(calls) == 2 * len(CPU_PHASES) and all((row.runs, row.capped) == (2, True) for row in timed)


# ---------------------------------------------------------------------------------------------
# Targets


def _result_with(rows_by_problem: dict) -> BenchResult:
    problems = []
    for name, rows in rows_by_problem.items():
        tokens = int(name.split("=")[1]) if name.startswith("T=") else 16384 * 8
        spec = ProblemSpec((tokens,)) if name.startswith("T=") else ProblemSpec((16384,) * 8, pack=True)
        problems.append(ProblemResult(spec, None, "cudnn dense", rows=rows))
    return BenchResult({}, problems)


def _timed(impl, phase, ms, tflop=None, **extra):
    return Row(impl, phase, OK, ms, 20, flops=None if tflop is None else tflop * 1e12 * ms * 1e-3, **extra)


def test_targets_reached_missed_and_not_measured():
    result = _result_with({
        "T=65536": [_timed("torch_msa", "fwd", 10.0, tflop=500.0), _timed("torch_msa", "bwd", 20.0, tflop=300.0),
                    _timed("fla parallel_nsa", "fwd", 50.0), _timed("fla parallel_nsa", "bwd", 40.0),
                    _timed("cudnn dense", "fwd+bwd", 450.0), _timed("torch_msa", "select+fwd+bwd", 40.0)],
        "T=131072": [_timed("torch_msa", "fwd", 20.0, tflop=208.0),
                     _timed("torch_msa", "select+fwd+bwd", 90.0, extra_peak_bytes=8 * 2**30)],
        "pack 8x16384": [Row("torch_msa", "select+fwd+bwd", OOM)],
    })
    outcomes = {o.label: o for o in targets.evaluate(result)}  # no selection in the meta: index
    forward = outcomes["forward >= 260 TF/s (--selection index)"]
    assert forward.verdict == targets.NOT_REACHED
    assert forward.values == pytest.approx({"T=65536": 500.0, "T=131072": 208.0})
    assert "below at 1 of 2" in forward.detail and "T=131072: 80% of the target (short by 52.0 TF/s)" in forward.detail
    assert outcomes["backward (dq, dk, dv) >= 320 TF/s (--selection index)"].verdict == targets.NOT_REACHED
    assert outcomes["select+fwd+bwd >= 10x cuDNN dense fwd+bwd at T=64K (--selection index)"].verdict == \
        targets.REACHED  # 11.25x
    assert outcomes["select+fwd+bwd >= 15x cuDNN dense fwd+bwd at T=128K (--selection index)"].verdict == \
        targets.NOT_MEASURED
    assert outcomes["forward >= 4x fla parallel_nsa (--selection index)"].verdict == targets.REACHED  # 5x
    backward_fla = outcomes["backward >= 3x fla parallel_nsa (--selection index)"]  # 2x
    assert backward_fla.verdict == targets.NOT_REACHED and "1.5x short" in backward_fla.detail
    assert outcomes["selection (index scoring + top-k) >= 400 TF/s"].verdict == targets.NOT_MEASURED
    [memory] = [o for label, o in outcomes.items() if label.startswith("memory")]
    # 8 GiB over 128K tokens is 64 KiB per token; the pack of 8 x 16K ran out of memory.
    assert memory.verdict == targets.NOT_REACHED and "pack 8x16384 OOM" in memory.detail
    assert "T=131072 ran, peak 8.00 GiB above the inputs (64 KiB per token)" in memory.detail
    assert memory.values == pytest.approx({"T=131072": 64.0})
    assert outcomes["top-k under 10% of selection"].verdict == targets.NOT_MEASURED
    assert not any("skewed" in label or "tiled" in label for label in outcomes)
    text = targets.format_outcomes(list(outcomes.values()))
    assert text.count("\n  [") == len(outcomes)


def test_the_rate_goals_follow_the_runs_selection():
    """`skewed` judges its rates at 32K and 128K only, `tiled` against cuDNN BSA's time at 8K, 32K
    and 64K; the memory goal holds per token on every regime."""
    rows = {
        "T=8192": [_timed("torch_msa", "fwd", 1.0, tflop=300.0), _timed("torch_msa", "fwd+bwd", 3.0),
                   _timed("cuDNN BSA blk128", "fwd+bwd", 3.3)],
        "T=32768": [_timed("torch_msa", "fwd", 1.0, tflop=430.0), _timed("torch_msa", "bwd", 1.0, tflop=440.0),
                    _timed("torch_msa", "fwd+bwd", 10.0), _timed("cuDNN BSA blk128", "fwd+bwd", 8.0)],
        "T=131072": [_timed("torch_msa", "fwd", 1.0, tflop=425.0), _timed("torch_msa", "bwd", 1.0, tflop=460.0),
                     _timed("torch_msa", "select+fwd+bwd", 90.0, extra_peak_bytes=12 * 2**30)],
    }
    skewed = {o.label: o for o in targets.evaluate(BenchResult({"selection": "skewed"}, _result_with(rows).problems))}
    forward = skewed["forward >= 420 TF/s at T=32768 and T=131072 (--selection skewed)"]
    assert forward.verdict == targets.REACHED and set(forward.values) == {"T=32768", "T=131072"}  # not 8K's 300
    backward = skewed["backward (dq, dk, dv) >= 450 TF/s at T=32768 and T=131072 (--selection skewed)"]
    assert backward.verdict == targets.NOT_REACHED and "T=32768: 98% of the target" in backward.detail
    [memory] = [o for label, o in skewed.items() if label.startswith("memory")]
    assert memory.verdict == targets.NOT_REACHED and memory.values == pytest.approx({"T=131072": 96.0})  # > 80 KiB
    tiled = {o.label: o for o in targets.evaluate(BenchResult({"selection": "tiled"}, _result_with(rows).problems))}
    bsa = tiled["fwd+bwd at most 1x cuDNN BSA blk128's time at T=8192, T=32768, T=65536 (--selection tiled)"]
    assert bsa.verdict == targets.NOT_REACHED and bsa.values == pytest.approx({"T=8192": 1.1, "T=32768": 0.8})
    assert tiled["forward >= 400 TF/s (--selection tiled)"].verdict == targets.NOT_REACHED  # 8K at 300
    assert not any("--selection index" in label or "--selection skewed" in label for label in tiled)


def test_topk_share_is_what_a_top1_selection_saves():
    def timed(phase, ms):
        return Row("torch_msa", phase, OK, ms, 20)

    within = _result_with({"T=65536": [timed("select", 4.0), timed("select topk=2", 3.7)]})
    [share] = [o for o in targets.evaluate(within) if o.label == "top-k under 10% of selection"]
    assert share.verdict == targets.REACHED and share.values == pytest.approx({"T=65536": 0.075})
    over = _result_with({"T=32768": [timed("select", 1.0), timed("select topk=2", 0.95)],
                         "T=65536": [timed("select", 4.0), timed("select topk=2", 2.0)]})
    [share] = [o for o in targets.evaluate(over) if o.label == "top-k under 10% of selection"]
    assert share.verdict == targets.NOT_REACHED
    assert "worst T=65536: 50% of the selection (5.0x the 10% budget)" in share.detail


# The run metadata (`cli._meta`) of the device the goals are set for, and of two others.
H200 = {"device_type": "cuda", "device": "NVIDIA H200", "capability": [9, 0]}
H100 = {"device_type": "cuda", "device": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}
CPU_RUN = {"device_type": "cpu", "device": "cpu (2 threads)", "capability": None}


def test_the_goals_are_judged_only_on_the_h200_they_are_set_for():
    assert targets.why_not_judged(H200) is None
    assert targets.why_not_judged(H100) == ("they are set for one H200 (compute capability 9.0) and this run is on "
                                            "NVIDIA H100 80GB HBM3, compute capability 9.0")
    not_judged = targets.why_not_judged(CPU_RUN)
    assert not_judged == "they are set for one H200 (compute capability 9.0) and this run is on cpu (2 threads)"
    assert targets.format_outcomes([], not_judged) == (
        "performance goals (docs/performance.md; set for one H200, M3 shapes, bf16): not judged on this device: "
        + not_judged)


def test_a_step_whose_parts_do_not_add_up_is_labelled():
    def rows(select, forward, backward, step):
        return [Row("torch_msa", phase, OK, ms, 3)
                for phase, ms in (("select", select), ("fwd", forward), ("bwd", backward), ("select+fwd+bwd", step))]

    # The report of a busy machine: forward 3612 ms and backward 6866 ms beside a step of 977 ms.
    busy = ProblemResult(ProblemSpec((128,)), None, "math dense", rows=rows(52.0, 3612.0, 6866.0, 977.0))
    busy.note_step_mismatch()
    [note] = busy.notes
    assert note.startswith("the phases do not add up: torch_msa's select+fwd+bwd took 977.000 ms, 0.09x the "
                           "select + fwd + bwd of 10530.000 ms (expected within 1.5x)")
    steady = ProblemResult(ProblemSpec((128,)), None, "math dense", rows=rows(50.0, 600.0, 1600.0, 2100.0))
    steady.note_step_mismatch()
    assert steady.notes == []


def test_docs_list_every_goal_the_bench_judges():
    table = (pathlib.Path(__file__).parents[2] / "docs" / "performance.md").read_text()
    goals = table.split("## Performance goals", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("|")[1].strip() for line in goals.splitlines() if line.startswith("| ")} - {"goal", "---"}
    judged = {outcome.label for selection in problems.SELECTIONS
              for outcome in targets.evaluate(BenchResult({"selection": selection}, []))}
    assert set(targets.RATE_GOALS) == set(problems.SELECTIONS)
    assert listed == judged


@pytest.mark.parametrize("name, capability, tflops", [
    ("NVIDIA H200", (9, 0), 790.0),
    ("NVIDIA H100 80GB HBM3", (9, 0), 790.0),
    ("NVIDIA H100 PCIe", (9, 0), 756.0),
    ("NVIDIA H20", (9, 0), 148.0),
    ("NVIDIA B200", (10, 0), 2250.0),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 312.0),
    ("Some Future Hopper", (9, 0), 989.0),
    ("NVIDIA GeForce GTX 1080", (6, 1), None),
])
def test_peak_rates_by_device_name_then_capability(name, capability, tflops):
    peak = devices.peak_for(name, capability)
    assert (None if peak is None else peak.tflops) == tflops
    if peak is not None:
        assert name in peak.source


def test_cpu_has_no_peak_rate_and_no_l2():
    assert devices.device_peak(CPU) is None and devices.l2_bytes(CPU) is None


# ---------------------------------------------------------------------------------------------
# The command line


def test_cli_on_cpu_prints_the_table_and_targets_and_writes_json(tmp_path, capsys, one_thread):
    out = tmp_path / "out"
    assert cli.main(["--device", "cpu", "--seqlens", "128", "--iters", "1", "--warmup", "0", "--heads", "16/1",
                     "--out", str(out)]) == 0
    captured = capsys.readouterr()
    stdout = captured.out
    assert "torch_msa benchmark" in stdout and "T=128: 1 document, 128 tokens" in stdout
    assert "shapes     Hq=16 Hkv=1 D=128, block 128, top-16, bf16, index heads 1 x 128" in stdout
    assert "% of peak: no known dense bf16 rate for this device" in stdout
    for impl, phase in (("math dense", "fwd"), ("math dense", "fwd+bwd"), ("FlexAttention", "fwd"),
                        ("torch_msa", "select"), ("torch_msa", "select topk=2"), ("torch_msa", "fwd"),
                        ("torch_msa", "bwd"),
                        ("torch_msa", "select+fwd+bwd")):
        words = [*impl.split(), *phase.split()]
        assert any(line.split()[:len(words)] == words for line in stdout.splitlines()), \
            f"no row {impl} {phase}:\n{stdout}"
    assert "skipped" in stdout and "fla's Triton kernels need CUDA" in stdout
    assert "median of 1 runs, interleaved (one run of every phase per round)" in stdout
    # The goals are set for one H200: a CPU run does not judge them (no verdict lines) and says why.
    assert not [line for line in stdout.splitlines() if line.startswith("  [")]
    assert ("performance goals (docs/performance.md; set for one H200, M3 shapes, bf16): not judged on this device: "
            "they are set for one H200 (compute capability 9.0) and this run is on cpu (1 threads)") in stdout
    # stderr is not a terminal here: no row lines, one line for the problem's 16 phases (2 math
    # dense, 2 fla, 3 FlexAttention, 2 + 1 cuDNN BSA, 6 torch_msa).
    assert re.fullmatch(r"\[1/1\] T=128: 16/16 in \d+:\d\d\n", captured.err), captured.err

    data = json.loads((out / "bench.json").read_text())
    assert data["status"] == "complete" and data["partial"] is False
    meta = data["meta"]
    assert meta["device"] == "cpu (1 threads)" and meta["device_type"] == "cpu" and meta["timing"]["iters"] == 1
    assert meta["timing"]["interleaved"] and meta["capability"] is None
    assert meta["torch_msa"] == torch_msa.__version__
    assert meta["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", meta["git_commit"])
    assert meta["shape"]["query_heads"] == 16 and meta["shape"]["kv_heads"] == meta["shape"]["index_heads"] == 1
    assert meta["peak_tflops"] is None
    assert data["meta"]["torch_msa_backends"]["forward"] == "reference"
    [problem] = data["problems"]
    assert problem["name"] == "T=128" and problem["lengths"] == [128] and not problem["pack"]
    assert problem["baseline"] == "math dense"
    assert problem["work"]["attended_pairs"] == 128 * 129 / 2  # every token of 128 reads all its keys
    row = next(r for r in problem["rows"] if r["impl"] == "torch_msa" and r["phase"] == "fwd")
    assert row["status"] == OK and row["ms"] > 0 and row["runs"] == 1
    assert row["tflops"] == pytest.approx(problem["work"]["msa_forward"] / (row["ms"] * 1e-3) / 1e12)
    assert row["peak_fraction"] is None  # a CPU has no known peak rate
    assert row["speedup_vs_baseline"] > 0
    # The step and the sum of its parts agree within the tolerance, or the problem says they do not.
    timed = {r["phase"]: r["ms"] for r in problem["rows"] if r["impl"] == "torch_msa"}
    ratio = timed["select+fwd+bwd"] / sum(timed[phase] for phase in ("select", "fwd", "bwd"))
    labelled = [note for note in problem["notes"] if note.startswith("the phases do not add up")]
    assert len(labelled) == (not 1 / STEP_TOLERANCE <= ratio <= STEP_TOLERANCE), (ratio, problem["notes"])
    assert data["targets"] == [] and data["targets_not_judged"].startswith("they are set for one H200")
    assert (out / "bench.txt").read_text().count("torch_msa ") >= 5
    png = out / "bench.png"
    assert png.exists() == ("wrote " + str(png) in stdout)
    if not png.exists():
        assert "plot: matplotlib is not importable" in stdout


def test_plot_is_written_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib", reason=install.MATPLOTLIB)
    from benchmarks import report

    result = _result_with({"T=8192": [Row("cudnn dense", "fwd", OK, 2.0, 20, flops=1e12),
                                       Row("torch_msa", "fwd", OK, 1.0, 20, flops=1e12),
                                       Row("torch_msa", "select+fwd+bwd", OK, 3.0, 20, flops=1e12)]})
    path = tmp_path / "plot.png"
    assert report.write_plot(result, str(path)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("device, goals", [
    (H200, {"H200 goal 260", "H200 goal 320"}),
    (H100, set()),
    (CPU_RUN, set()),
])
def test_plot_draws_the_h200_goals_only_for_an_h200_run(device, goals):
    pytest.importorskip("matplotlib", reason=install.MATPLOTLIB)
    import matplotlib.pyplot as plt

    from benchmarks import report

    result = _result_with({"T=512": [Row("math dense", "fwd", OK, 2.0, 20, flops=1e9),
                                      Row("math dense", "fwd+bwd", OK, 6.0, 20, flops=3e9),
                                      Row("torch_msa", "fwd", OK, 1.0, 20, flops=1e9),
                                      Row("torch_msa", "bwd", OK, 2.0, 20, flops=2e9),
                                      Row("torch_msa", "select+fwd+bwd", OK, 3.5, 20, flops=3e9)]})
    result.meta.update(device)
    assert targets.rate_goals(result) == ({"fwd": 260.0, "bwd": 320.0, "select": 400.0} if goals else {})
    figure = report.plot(result, targets.rate_goals(result))
    labels = {line.get_label() for axis in figure.axes for line in axis.get_lines()}
    plt.close(figure)
    assert {label for label in labels if "goal" in label} == goals


def _fake_measure(interrupt_at_select: int | None = None):
    """`timing.measure` without running anything: 1 ms per phase; with `interrupt_at_select`,
    Ctrl-C when torch_msa's `select` phase is timed for that problem (1 = the first)."""
    selects = []

    def measure(fn, device, warmup, iters, budget_s=None, min_runs=5, synchronised=False):
        if getattr(fn, "__func__", None) is Inputs.select:
            selects.append(fn)
            if len(selects) == interrupt_at_select:
                raise KeyboardInterrupt
        return Timing((1.0,), 0, False)

    return measure


def _cli(out, *extra):
    return cli.main(["--device", "cpu", "--seqlens", "64", "128", "--heads", "16/1", "--skip-peers", "--iters", "1",
                     "--warmup", "0", "--out", str(out), *extra])


def test_an_interrupted_run_leaves_a_valid_partial_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "measure", _fake_measure(interrupt_at_select=2))
    assert _cli(tmp_path) == 130
    assert "interrupted: the partial results are in" in capsys.readouterr().err
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["status"] == "interrupted" and data["partial"] is True
    first, second = data["problems"]
    assert first["name"] == "T=64" and not [note for note in first["notes"] if "interrupted" in note]
    assert {row["impl"] for row in first["rows"]} == {"math dense", "torch_msa"}
    assert all(row["status"] == OK for row in first["rows"])
    # The second problem stopped at torch_msa's first phase: the dense rows (and their sum) remain.
    assert second["name"] == "T=128"
    assert [(row["impl"], row["phase"]) for row in second["rows"]] == [
        ("math dense", "fwd"), ("math dense", "bwd"), ("math dense", "fwd+bwd")]
    sharing, interrupted = second["notes"]
    assert sharing.startswith("index selection: 8-token groups read ")  # torch_msa.selection_stats, before timing
    assert interrupted == "interrupted (KeyboardInterrupt): the phases after its last row did not run"
    assert "status: interrupted (partial results)" in (tmp_path / "bench.txt").read_text()
    assert not (tmp_path / "bench.png").exists()


def test_json_written_after_a_problem_says_the_run_is_still_going(tmp_path, monkeypatch):
    """A run killed outright (no KeyboardInterrupt) leaves the file of its last finished problem."""
    seen = []
    write_json = cli.report.write_json

    def spy(result, outcomes, path, *rest):
        write_json(result, outcomes, path, *rest)
        seen.append(json.loads(pathlib.Path(path).read_text()))

    monkeypatch.setattr(runner, "measure", _fake_measure())
    monkeypatch.setattr(cli.report, "write_json", spy)
    assert _cli(tmp_path) == 0
    assert [(len(data["problems"]), data["status"], data["partial"]) for data in seen] == [
        (1, "running", True), (2, "running", True), (2, "complete", False)]


def test_progress_on_a_terminal_shows_each_row_and_the_time_left(tmp_path, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(runner, "measure", _fake_measure())
    assert _cli(tmp_path) == 0
    shown = screen(terminal)
    rows = [line for line in shown if line.startswith(("T=64 ", "T=128 "))]
    assert len(rows) == 2 * 8 and all(" 1.000 ms " in line for line in rows)  # 2 dense + 6 torch_msa phases each
    final = [line for line in shown if line.startswith("[")]  # each problem's last progress line stays
    assert len(final) == 2 and all(re.fullmatch(r"\[[12]/2\] T=(64|128): 8/8 done, \d+:\d\d elapsed", line)
                                   for line in final), final
    # While a phase ran, the line named it and estimated the time left from the phases done.
    raw = terminal.getvalue()
    assert re.search(r"\[1/2\] T=64: [1-7]/8 done, torch_msa \S+.*, \d+:\d\d elapsed, about \d+:\d\d left", raw)


def _fake_kl_measure(monkeypatch, interrupt_at=None):
    """`benchmarks.kl.measure` without running anything: 2 ms per row; Ctrl-C at call `interrupt_at`."""
    from benchmarks import kl

    calls = []

    def measure(fn, device, warmup, iters, budget_s=None, min_runs=5):
        calls.append(fn)
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return Timing((2.0,), 0, False)

    monkeypatch.setattr(kl, "measure", measure)
    return kl


def test_the_kl_benchmark_writes_its_json(tmp_path, capsys, monkeypatch):
    kl = _fake_kl_measure(monkeypatch)
    assert kl.main(["--device", "cpu", "--seqlen", "64", "--iters", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "kl.json").read_text())
    assert data["status"] == "complete" and data["partial"] is False
    assert data["meta"]["backends"]["indexer_kl"] == "reference" and data["meta"]["command"].startswith("python -m")
    assert data["lengths"] == [{"tokens": 64, "documents": 1, "rows_ms": dict.fromkeys(kl.SPARSE_ROWS, 2.0)}]
    captured = capsys.readouterr()
    assert "T=    64  sparse KL fwd+bwd                  2.00 ms  100.0% of the attention step" in captured.out
    rows = len(kl.SPARSE_ROWS)
    assert re.fullmatch(rf"\[1/1\] T=64: {rows}/{rows} in \d+:\d\d\n", captured.err), captured.err


def test_an_interrupted_kl_run_leaves_a_valid_partial_json(tmp_path, capsys, monkeypatch):
    from benchmarks.kl import SPARSE_ROWS

    rows = len(SPARSE_ROWS)
    kl = _fake_kl_measure(monkeypatch, interrupt_at=rows + 2)  # the second row of the second length
    assert kl.main(["--device", "cpu", "--seqlen", "32", "64", "--iters", "1", "--out", str(tmp_path)]) == 130
    data = json.loads((tmp_path / "kl.json").read_text())
    assert data["status"] == "interrupted" and data["partial"] is True
    assert data["lengths"] == [{"tokens": 32, "documents": 1, "rows_ms": dict.fromkeys(kl.SPARSE_ROWS, 2.0)},
                               {"tokens": 64, "documents": 1, "rows_ms": {"attention step": 2.0}}]
    err = capsys.readouterr().err
    assert f"[2/2] T=64: stopped at 1/{rows} after" in err and "interrupted: the partial results are in" in err


@pytest.mark.parametrize("argv, message", [
    (["--pack", "8x"], "--pack"),
    (["--seqlens", "12Q"], "--seqlens"),
    (["--iters", "0"], "--iters"),
    (["--warmup", "-1"], "--warmup"),
    (["--row-budget", "-2"], "--row-budget"),
    (["--seqlens", ",", "--pack", "none"], "nothing to run"),
    (["--heads", "16"], "--heads: expected query heads / KV heads"),
    (["--heads", "16/3"], "--heads: expected KV heads >= 1 dividing the query heads, got 16/3"),
    (["--max-reference-tokens", "-1"], "argument --max-reference-tokens: expected an integer >= 0, got '-1'"),
    (["--device", "meta"], "argument --device: expected cpu, cuda or cuda:N, got 'meta'"),
])
def test_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_defaults():
    assert [p.name for p in cli.parse_args(["--device", "cpu"]).problems] == ["T=512"]
    quick = cli.parse_args(["--device", "cpu", "--quick"])
    assert [p.name for p in quick.problems] == ["T=128"] and (quick.warmup, quick.iters) == (0, 3) and quick.skip_peers
    assert cli.parse_args(["--device", "cpu"]).shape == M3
    shard = cli.parse_args(["--device", "cpu", "--heads", "16/1"]).shape
    assert (shard.query_heads, shard.kv_heads, shard.head_dim, shard.topk) == (16, 1, 128, 16)
    both = cli.parse_args(["--device", "cpu", "--seqlens", "1K", "--pack", "2x512", "--iters", "4"])
    assert [p.name for p in both.problems] == ["T=1024", "pack 2x512"] and (both.warmup, both.iters) == (5, 4)
    assert [p.name for p in cli.parse_args(["--device", "cpu", "--pack", "8x16K"]).problems] == ["pack 8x16384"]


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _exit_status(main, argv) -> int:
    """`main(argv)`, failing the test (rather than stopping pytest) if a KeyboardInterrupt escapes it."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("a KeyboardInterrupt escaped the command (a traceback, for its user)")


def _pretend_cuda(monkeypatch):
    """A host that says it has one GPU (for the checks of the commands that need one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_ctrl_c_while_the_plot_is_drawn_ends_with_the_interrupted_status(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "measure", _fake_measure())
    monkeypatch.setattr(cli.report, "write_plot", _interrupt)
    assert _exit_status(cli.main, ["--device", "cpu", "--seqlens", "64", "--heads", "16/1", "--skip-peers",
                                   "--iters", "1", "--out", str(tmp_path)]) == 130
    assert f"interrupted: while drawing {tmp_path / 'bench.png'}, not written; the results are complete in" \
        in capsys.readouterr().err
    assert json.loads((tmp_path / "bench.json").read_text())["status"] == "complete"


def _ctrl_c_in_kl(monkeypatch, out):  # while it reads the git commit of its metadata
    from benchmarks import kl

    monkeypatch.setattr(command, "git_commit", _interrupt)
    return kl.main, ["--device", "cpu", "--seqlen", "64", "--out", out]


def _ctrl_c_in_long_context(monkeypatch, out):  # as it starts its record
    from benchmarks import long_context

    _pretend_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", _interrupt)
    return long_context.main, ["--seqlens", "1K", "--out", out]


def _ctrl_c_in_deterministic(monkeypatch, out):  # while it makes its inputs
    from benchmarks import deterministic

    monkeypatch.setattr(deterministic, "make_inputs", _interrupt)
    return deterministic.main, ["--device", "cpu", "--seqlens", "64"]


def _ctrl_c_in_overhead(monkeypatch, out):  # while it measures
    from benchmarks import overhead

    _pretend_cuda(monkeypatch)
    monkeypatch.setattr(overhead, "measure", _interrupt)
    return overhead.main, ["64"]


def _ctrl_c_in_sm90(monkeypatch, out):  # while it checks the GPU
    from benchmarks import sm90

    _pretend_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", _interrupt)
    return sm90.main, []


@pytest.mark.parametrize("ctrl_c", [_ctrl_c_in_kl, _ctrl_c_in_long_context, _ctrl_c_in_deterministic,
                                    _ctrl_c_in_overhead, _ctrl_c_in_sm90])
def test_ctrl_c_at_any_moment_ends_every_command_with_the_interrupted_status(ctrl_c, tmp_path, capsys, monkeypatch):
    main, argv = ctrl_c(monkeypatch, str(tmp_path))
    assert _exit_status(main, argv) == 130
    assert "interrupted: stopped by Ctrl-C before the command finished" in capsys.readouterr().err


def test_ctrl_c_while_a_command_starts_ends_it_with_the_interrupted_status(capsys):
    """`python -m benchmarks[.COMMAND]` installs this while its imports run, until its `main`."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        command.stop_cleanly_while_starting()
        with pytest.raises(SystemExit) as exit_info:
            signal.raise_signal(signal.SIGINT)
        assert exit_info.value.code == 130
        assert capsys.readouterr().err == "interrupted: stopped by Ctrl-C while the command started\n"
        command.stop_cleanly_while_starting()
        # Inside `main` Ctrl-C is a KeyboardInterrupt again, for the commands' own handling.
        assert command.exits_on_interrupt(lambda: signal.getsignal(signal.SIGINT))() is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.filterwarnings("ignore:'benchmarks.*' found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("command, argv, message", [
    ("benchmarks", ["--out", __file__], f"argument --out: expected a directory, got {__file__!r}, a file"),
    ("benchmarks", ["--device", "cuda"], "argument --device: cuda requested but CUDA is not available"),
    ("benchmarks.kl", ["--device", "cuda"], "argument --device: cuda requested but CUDA is not available"),
    ("benchmarks.kl", ["--iters", "0"], "argument --iters: expected an integer >= 1, got '0'"),
    ("benchmarks.kl", ["--seqlen", "100", "--documents", "3"],
     "argument --seqlen: expected multiples of --documents 3, got [100]"),
    ("benchmarks.kl", ["--dense", "--documents", "2"],
     "argument --documents: expected 1 with --dense (the dense rows take one document), got 2"),
    ("benchmarks.long_context", ["--device", "cuda"], "argument --device: cuda requested but CUDA is not available"),
    ("benchmarks.long_context", ["--seqlens", "12Q"], "--seqlens: expected a token count such as 8192, 8K or 1M, "
                                                      "got '12Q'"),
    ("benchmarks.long_context", ["--device", "cpu"], "needs a CUDA device (its lengths take tens of GiB); "
                                                     "got --device cpu"),
    ("benchmarks.deterministic", ["--device", "cuda"], "argument --device: cuda requested but CUDA is not available"),
    ("benchmarks.deterministic", ["--warmup", "-1"], "argument --warmup: expected an integer >= 0, got '-1'"),
    ("benchmarks.overhead", ["4Q"], "argument T: expected a token count such as 8192, 8K or 1M, got '4Q'"),
    ("benchmarks.overhead", [], "needs a CUDA device (it times GPU kernels and the host work that launches them); "
                                "found no GPU"),
    ("benchmarks.sm90", ["--docs", "8x"], "argument --docs: expected a document length such as 8192 or COUNTxLENGTH "
                                          "such as 8x16384, got '8x'"),
    ("benchmarks.sm90", [], "needs a CUDA device (it times the SM90 kernels of H100/H200); found no GPU"),
    ("benchmarks.query_outer", ["8K", "--pack", "2x4K"],
     "argument --pack: expected either document lengths or --pack, got both (['8K'] and '2x4K')"),
    ("benchmarks.query_outer", ["--rounds", "5"], "argument --rounds: expected an integer >= 6, got '5'"),
    ("benchmarks.query_outer", ["--autograd", "--step"], "argument --step: not allowed with argument --autograd"),
    ("benchmarks.query_outer", [], "needs a CUDA device (it times GPU kernels and the host work that launches "
                                   "them); found no GPU"),
])
def test_every_command_refuses_a_bad_argument_with_a_message(command, argv, message, monkeypatch, capsys):
    """As `python -m COMMAND ARGS` runs it (runpy), on a host without a GPU: the usage and a
    message naming the argument, exit status 2, before any work; never a traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)

    def work(*args, **kwargs):
        raise AssertionError("the work began before the arguments were checked")

    for module in (problems, runner):
        monkeypatch.setattr(module, "make_inputs", work)
    monkeypatch.setattr(timing, "measure", work)
    monkeypatch.setattr(sys, "argv", [command, *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(command + (".__main__" if command == "benchmarks" else ""), run_name="__main__",
                         alter_sys=True)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: python -m {command} ") and f"python -m {command}: error: {message}\n" in err, err


def test_a_command_given_a_bad_argument_exits_with_a_message_not_a_traceback():
    """The same through a real `python -m`, the GPUs hidden: the process's exit status and stderr."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.kl", "--device", "cuda"], capture_output=True,
                            text=True, timeout=120, cwd=pathlib.Path(__file__).resolve().parents[2],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stderr
    assert "python -m benchmarks.kl: error: argument --device: cuda requested but CUDA is not available" \
        in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------------------------------------
# CUDA: every peer on a small problem


@pytest.mark.cuda
def test_every_peer_runs_on_cuda(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["--seqlens", "4096", "--pack", "2x1024,2048", "--warmup", "1", "--iters", "2",
                     "--row-budget", "0", "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    fla_installed = peers.fla_version() is not None
    for problem in data["problems"]:
        for row in problem["rows"]:
            if row["impl"] == "fla parallel_nsa" and not fla_installed:
                assert row["status"] == SKIPPED
            elif row["impl"].startswith("cuDNN BSA"):
                # The index selection differs from token to token inside a query tile.
                assert row["status"] == SKIPPED and "--selection tiled" in row["note"], row
            elif row["impl"] == "torch_msa" and row["phase"] == "schedule" and row["status"] == SKIPPED:
                continue
            elif row["impl"] == "FlexAttention" and row["phase"] == "bwd" and row["status"] == ERROR:
                # Seen on an H200 with torch 2.11: the compiled flex backward template needs
                # 235 KB of shared memory (227 KB available); the bench must record it and go on.
                assert "out of resource" in row["note"], row
            else:
                assert row["status"] == OK, (problem["name"], row)
        step = next(r for r in problem["rows"] if r["phase"] == "select+fwd+bwd")
        assert step["extra_peak_bytes"] > 0
        # The model's step and the dense forward + backward, each call synchronised, side by side.
        synced = {(r["impl"], r["phase"]): r for r in problem["rows"] if r["phase"].startswith("synced")}
        assert synced.keys() >= {("torch_msa", "synced step"), ("cudnn dense", "synced fwd+bwd")}, synced.keys()
        assert synced["torch_msa", "synced step"]["speedup_vs_baseline"] > 0


@pytest.mark.cuda
def test_compiled_flex_and_fla_compute_msa_on_cuda():
    inputs = make_inputs(ProblemSpec((1000, 3000), pack=True), M3, torch.device("cuda"), "index", seed=5)
    reference, _ = torch.ops.msa.forward(inputs.q, inputs.k, inputs.v, inputs.block_indices, *inputs.document_args,
                                         128, 128 ** -0.5)
    block_mask, _ = msa_block_mask(inputs.block_indices, inputs.key_start, inputs.position, 4000, 16, 128)
    out = peers._compiled_flex_attention()(fold_query_heads(inputs.q, 4), kv_heads_first(inputs.k),
                                           kv_heads_first(inputs.v), block_mask=block_mask, scale=128 ** -0.5)
    torch.testing.assert_close(out, fold_query_heads(reference, 4), atol=2e-2, rtol=2e-2)
    if peers.fla_version() is not None:
        from fla.ops.nsa.parallel import ParallelNSAFunction

        indices = inputs.block_indices.permute(1, 0, 2).unsqueeze(0).to(torch.int64).contiguous()
        out = ParallelNSAFunction.apply(inputs.q[None], inputs.k[None], inputs.v[None], indices, 16, 128,
                                        128 ** -0.5, inputs.cu_seqlens.to(torch.int64))
        torch.testing.assert_close(out[0], reference, atol=2e-2, rtol=2e-2)


def _bsa_importable() -> bool:
    try:
        from cudnn.block_sparse_attention import api  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.cuda
def test_cudnn_bsa_computes_msa_at_each_tiles_last_query_on_cuda():
    """BSA attends non-causally inside a block; a tile's last query sees its whole own block
    under MSA too, so there the two agree, at both BSA block sizes. The runner then times it."""
    if not _bsa_importable():
        pytest.skip(f"cudnn.block_sparse_attention is not importable; {peers.BSA_INSTALL}")
    from cudnn.block_sparse_attention import api as bsa

    inputs = make_inputs(ProblemSpec((2048,) * 2, pack=True), M3, torch.device("cuda"), "tiled", seed=6)
    reference, _ = torch.ops.msa.forward(inputs.q, inputs.k, inputs.v, inputs.block_indices, *inputs.document_args,
                                         128, 128 ** -0.5)
    tile_last = torch.arange(127, 4096, 128, device="cuda")
    for block in (128, 64):
        lists, counts = peers._bsa_block_lists(inputs, block)
        out = bsa.block_sparse_attention_forward(
            inputs.q.view(2, 2048, 64, 128), inputs.k.view(2, 2048, 4, 128), inputs.v.view(2, 2048, 4, 128), lists,
            lists.shape[-1], q2k_block_nums=counts, sparse_block_size=block, softmax_scale=128 ** -0.5,
            layout="bshd")["o_tensor"].reshape(4096, 64, 128)
        torch.testing.assert_close(out[tile_last], reference[tile_last], atol=2e-2, rtol=2e-2)
    result = ProblemResult(inputs.spec, inputs.work, "cudnn dense")
    progress = Progress("pack 2x2048", 3)
    config = _config(device=torch.device("cuda"), shape=M3, selection="tiled")
    for block in (128, 64):
        runner.run_subject(peers.bsa_subject(inputs, block), result, config, progress)
    assert {(r.impl, r.phase): r.status for r in result.rows} == {
        ("cuDNN BSA blk128", "fwd"): OK, ("cuDNN BSA blk128", "bwd"): OK, ("cuDNN BSA blk64", "fwd"): OK}


def _fake_long_context(monkeypatch, outcomes):
    """`benchmarks.long_context` on a pretend GPU whose lengths measure as `outcomes` says:
    a row's step time, or an exception to raise."""
    from benchmarks import long_context

    _pretend_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "pretend GPU")

    def measure_length(tokens, device, iters, dense):
        outcome = outcomes[tokens]
        if isinstance(outcome, BaseException):
            raise outcome
        row = {"tokens": tokens, "step_ms": outcome, "step_tflops": 1.0, "peak_above_inputs_gib": 1.0,
               "peak_above_inputs_kib_per_token": 1.0}
        return {**row, "dense_step_ms": 10 * outcome} if dense else row

    monkeypatch.setattr(long_context, "measure_length", measure_length)
    monkeypatch.setattr(long_context, "free_memory", lambda device: None)
    return long_context


def test_the_long_context_benchmark_extrapolates_dense_and_records_out_of_memory(monkeypatch, tmp_path):
    long_context = _fake_long_context(monkeypatch, {1024: 2.0, 2048: 5.0, 4096: torch.cuda.OutOfMemoryError("out of memory")})
    assert long_context.main(["--seqlens", "1K", "2K", "4K", "--dense-up-to", "1K", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "long_context.json").read_text())
    assert record["status"] == "complete" and not record["partial"]
    first, second, third = record["rows"]
    assert first["dense_step_ms"] == 20.0 and "dense_extrapolated" not in first
    assert second["dense_step_ms"] == 80.0 and second["dense_extrapolated"]
    assert third == {"tokens": 4096, "error": "out of memory: out of memory"}


def test_an_interrupted_long_context_run_leaves_a_partial_json(monkeypatch, tmp_path):
    long_context = _fake_long_context(monkeypatch, {1024: 2.0, 2048: KeyboardInterrupt()})
    assert long_context.main(["--seqlens", "1K", "2K", "--out", str(tmp_path)]) == 130
    record = json.loads((tmp_path / "long_context.json").read_text())
    assert record["status"] == "interrupted" and record["partial"]
    assert [row["tokens"] for row in record["rows"]] == [1024]


@pytest.mark.cuda
def test_the_long_context_benchmark_reports_time_memory_and_the_dense_peer(tmp_path):
    from benchmarks import long_context

    assert long_context.main(["--seqlens", "2K", "4K", "--dense-up-to", "2K", "--iters", "1", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "long_context.json").read_text())
    assert record["status"] == "complete"
    rows = record["rows"]
    assert [row["tokens"] for row in rows] == [2048, 4096]
    assert all(row["step_ms"] > 0 and row["peak_above_inputs_gib"] > 0 for row in rows)
    assert "dense_extrapolated" not in rows[0] and rows[1]["dense_extrapolated"]
    assert rows[1]["dense_step_ms"] == pytest.approx(rows[0]["dense_step_ms"] * 4)


def test_the_overhead_calls_run_and_the_varying_ones_change_length_every_call():
    """The calls `python -m benchmarks.overhead` times, on CPU (the reference backend): each step
    returns its gradients; the varying steps take packs of T +- T / 4 tokens, a new one each call."""
    from benchmarks import overhead

    fixed = overhead.calls(64, CPU, SMALL)
    assert list(fixed) == ["select_blocks", "build_plan", "forward, plan given", "forward + backward",
                           "msa_attention step", "step + index loss"]
    assert [g.shape[0] for g in fixed["msa_attention step"]()] == [64, 64, 64]
    grads = fixed["step + index loss"]()
    assert len(grads) == 5 and all(g.shape[0] == 64 and torch.isfinite(g).all() for g in grads)
    varying = overhead.varying_calls(64, CPU, SMALL, steps=3)
    lengths = [[g.shape[0] for g in varying["msa_attention step"]()] for _ in range(4)]
    assert all(len(set(step)) == 1 and 48 <= step[0] <= 80 for step in lengths), lengths
    assert lengths[3] == lengths[0] and len({step[0] for step in lengths[:3]}) > 1, lengths  # three packs in turn


def test_the_overhead_loop_queues_at_most_its_share_of_launches():
    from benchmarks import overhead

    assert overhead.loop_calls(20, 19) == 20  # an 8K step: 380 launches
    assert overhead.loop_calls(20, 37) == 13  # with the index loss: 481 of 740
    assert overhead.loop_calls(20, 155) == 3  # a 32K step over three query windows
    assert overhead.loop_calls(2, 19) == 2 and overhead.loop_calls(20, 5000) == 1


@pytest.mark.cuda
def test_the_overhead_benchmark_measures_every_call_five_ways():
    from benchmarks import overhead

    rows = overhead.measure(1024, torch.device("cuda"), iters=2)
    assert [row["call"] for row in rows] == ["select_blocks", "build_plan", "forward, plan given", "forward + backward",
                                             "msa_attention step", "step + index loss"]
    for row in rows:
        assert "graph_error" not in row, row  # every call is captured: no host sync, torch's current stream
        assert "loop_error" not in row, row  # no launch of the loop waited for the GPU
        assert all(row[key] > 0 for key in ("host_ms", "loop_ms", "gpu_ms", "launches", "wall_ms", "graph_ms")), row
    by_call = {row["call"]: row for row in rows}
    assert by_call["msa_attention step"]["launches"] > by_call["forward + backward"]["launches"]
    assert by_call["step + index loss"]["launches"] > by_call["msa_attention step"]["launches"]
    varying = overhead.measure(1024, torch.device("cuda"), iters=3, varying=True)
    assert [row["call"] for row in varying] == ["msa_attention step", "step + index loss"]
    assert all(row["host_ms"] > 0 and row.get("loop_ms", 0) > 0 and row["graph_error"] == "the length changes every call"
               for row in varying), varying
