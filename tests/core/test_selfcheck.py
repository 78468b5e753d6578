"""`python -m torch_msa`: the command line, and that its float64 checks do catch wrong results."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support.documents import backend_arguments
from tests.support.terminal import FakeTerminal, screen
from torch_msa import __main__ as selfcheck

# A tiny topology (not M3) so the in-process checks run in well under a second.
SMALL = selfcheck.Shape(query_heads=4, kv_heads=2, head_dim=64, index_dim=64, block_size=64, topk=2)
# Up to 5 visible blocks for topk 2, so selection really rejects blocks; one suffix document.
SMALL_DOCUMENTS = [selfcheck.Document(150, 260), selfcheck.Document(64, 64), selfcheck.Document(1, 1)]


def _run_cli(*args, timeout=120):
    env = {key: value for key, value in os.environ.items() if key != "TORCH_MSA_BACKEND"}
    return subprocess.run([sys.executable, "-m", "torch_msa", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_small_run_passes():
    result = _run_cli("--seqlen", "200", "--dtype", "fp32", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "self-check: PASS"
    for start in ("  device     cpu", "  backends   select_blocks=", "  dtype      fp32",
                  "  documents  Lk [151, 25, 15, 9]  Lq [129, 25, 15, 9]", "time (ms)    select_blocks", "keys read"):
        assert any(line.startswith(start) for line in lines), f"no line starts with {start!r}:\n{result.stdout}"
    for name in ("selection", "out", "lse", "dq", "sum dv", "sum dk"):
        assert any(line.startswith(f"  {name} ") and " PASS" in line for line in lines), \
            f"no PASS line for {name}:\n{result.stdout}"
    for stage in ("select_blocks", "forward", "backward"):
        assert any(re.fullmatch(rf"  {stage}: \d+\.\d ms", line) for line in lines), f"no {stage} line:\n{result.stdout}"
    assert "running the ops:" not in result.stderr  # stderr is a pipe: no progress display


def test_progress_on_a_terminal_names_each_stage_and_expects_the_backward_to_take_2_5_forwards(monkeypatch, capsys):
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    expected = {}
    start = selfcheck.Progress.start

    def spy(progress, step, expected_s=None):
        expected[step] = expected_s
        start(progress, step, expected_s)

    monkeypatch.setattr(selfcheck.Progress, "start", spy)
    problem = selfcheck.make_problem(SMALL_DOCUMENTS, torch.float32, torch.device("cpu"), seed=0, shape=SMALL)
    results = selfcheck.run_ops(problem, step="  ")
    assert expected == {"select_blocks": None, "forward": None,
                        "backward": pytest.approx(2.5 * results.stage_ms["forward"] / 1e3)}
    raw = terminal.getvalue()
    assert re.search(r"running the ops: 0/3 done, select_blocks, \d+:\d\d elapsed, \? left", raw)
    assert re.search(r"running the ops: 1/3 done, forward, \d+:\d\d elapsed, \? left", raw)
    assert re.search(r"running the ops: 2/3 done, backward, \d+:\d\d elapsed, about \d+:\d\d left", raw)
    assert screen(terminal) == [""]  # the display is cleared once the ops ran
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == [
        "  select_blocks", "  forward", "  backward"]


def test_help_lists_the_options():
    result = _run_cli("--help")
    assert result.returncode == 0
    for option in ("--device", "--seqlen", "--dtype", "--backend", "--seed"):
        assert option in result.stdout
    for dtype in ("bf16", "fp16", "fp32", "fp64"):
        assert dtype in result.stdout


def test_unknown_backend_is_refused():
    result = _run_cli("--backend", "no_such_backend")
    assert result.returncode != 0
    assert "unknown backend 'no_such_backend'" in result.stderr
    assert "reference" in result.stderr  # the message lists the registered backends
    assert "self-check" not in result.stdout  # refused before any work


def test_document_layout():
    layout = selfcheck.document_layout(4096)
    assert [d.keys for d in layout] == [3072, 512, 320, 192]
    assert layout[0].queries < layout[0].keys and all(d.queries == d.keys for d in layout[1:])
    for seqlen in (4, 5, 37, 600):
        layout = selfcheck.document_layout(seqlen)
        assert sum(d.keys for d in layout) == seqlen
        assert all(1 <= d.queries <= d.keys for d in layout)
    with pytest.raises(ValueError, match="seqlen"):
        selfcheck.document_layout(3)


def test_sampled_tokens_cover_every_document():
    tokens = selfcheck.sample_tokens(SMALL_DOCUMENTS)
    for first, last in ((0, 149), (150, 213), (214, 214)):
        assert first in tokens and last in tokens


@pytest.fixture(scope="module")
def small_run():
    problem = selfcheck.make_problem(SMALL_DOCUMENTS, torch.float32, torch.device("cpu"), seed=0, shape=SMALL)
    results = selfcheck.run_ops(problem, timed=False)
    return problem, results, selfcheck.sample_tokens(SMALL_DOCUMENTS)


def _failed(problem, results, tokens):
    checks = selfcheck.run_checks(problem, results, tokens, torch.float32)
    return {check.name for check in checks if not check.passed}


def test_correct_results_pass(small_run):
    assert _failed(*small_run) == set()


def _with(results, **changes):
    return dataclasses.replace(results, **changes)


@pytest.mark.parametrize("name, expected", [("out", "out"), ("lse", "lse"), ("dq", "dq"),
                                            ("dv", "sum dv"), ("dk", "sum dk")])
def test_checks_detect_a_wrong_value(small_run, name, expected):
    problem, results, tokens = small_run
    wrong = getattr(results, name).clone()
    # One row (a sampled token; for dk/dv a key) off by 5% of the largest entry.
    wrong[tokens[len(tokens) // 2]] += 0.05 * wrong.abs().max()
    assert _failed(problem, _with(results, **{name: wrong}), tokens) == {expected}


def test_checks_detect_nan(small_run):
    problem, results, tokens = small_run
    out = results.out.clone()
    out[tokens[0], 0, 0] = float("nan")
    assert "out" in _failed(problem, _with(results, out=out), tokens)


def _sparse_row(problem, results, tokens):
    """(head, token) of a sampled query that keeps some non-local blocks and rejects others."""
    _, position = problem.query_layout()
    for token in tokens:
        if position[token] // SMALL.block_size + 1 > SMALL.topk:
            return 0, token
    raise AssertionError("no sampled token chooses among blocks")


def test_checks_detect_a_wrong_selection(small_run):
    problem, results, tokens = small_run
    head, token = _sparse_row(problem, results, tokens)
    block_indices = results.block_indices.clone()
    chosen = set(block_indices[head, token].tolist())
    local = block_indices[head, token, SMALL.topk - 1].item()
    rejected = next(b for b in range(local) if b not in chosen)
    block_indices[head, token, 0] = rejected  # swap a chosen block for a rejected one
    check = selfcheck.check_selection(problem, block_indices, tokens, selfcheck.TOLERANCES[torch.float32])
    assert not check.passed and check.error < float("inf"), check.line()


def test_checks_detect_a_broken_id_contract(small_run):
    problem, results, tokens = small_run
    head, token = _sparse_row(problem, results, tokens)
    block_indices = results.block_indices.clone()
    block_indices[head, token, 0] = block_indices[head, token, 1]  # a duplicate id
    check = selfcheck.check_selection(problem, block_indices, tokens, selfcheck.TOLERANCES[torch.float32])
    assert not check.passed and "break the id contract" in check.note, check.line()


@pytest.mark.slow
def test_m3_run_with_sparse_selection_is_usable_on_cpu():
    """The README's first command on the CPU reference (M3 shapes, bf16, select + forward +
    backward), at 2816 tokens instead of its default 4096: the longest document (2112 keys) still
    passes the 16 x 128 selected keys, so the selection drops blocks, in a third of the default's
    time. The default's cost is the same code on more tokens, guarded by the FLOP counts below
    (linear in the length), not by the clock; the timeout only catches a hang."""
    result = _run_cli("--device", "cpu", "--seqlen", "2816", timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "self-check: PASS"
    assert "q [2500, 64, 128]" in result.stdout
    keys_read = re.search(r"keys read .* \((\d+\.\d)%\)", result.stdout)
    assert keys_read and float(keys_read.group(1)) < 100.0, result.stdout


def test_the_default_run_is_4096_tokens():
    assert "(default: 4096)" in " ".join(_run_cli("--help").stdout.split())


def _reference_flops(seqlen: int) -> dict[str, int]:
    """FLOPs of the reference's own functions (the ops themselves count nominal formulas) for one
    document of `seqlen` tokens with a contract-valid selection."""
    from torch.utils.flop_counter import FlopCounterMode

    from torch_msa import reference
    from torch_msa.testing import cu_seqlens, random_block_indices

    heads, kv_heads, dim, block_size, topk = 2, 1, 64, 64, 2
    cu_q, cu_k = cu_seqlens([seqlen])
    docs = (cu_q, cu_k, seqlen, seqlen)
    q, k, v = torch.randn(seqlen, heads, dim), torch.randn(seqlen, kv_heads, dim), torch.randn(seqlen, kv_heads, dim)
    block_indices = random_block_indices(cu_q, cu_k, kv_heads, topk, block_size)
    counts = {}
    for name, call in (
        ("select", lambda: reference.select_blocks(*backend_arguments("select_blocks", torch.randn(seqlen, kv_heads, 32),
                                                                      torch.randn(seqlen, 1, 32), *docs, topk, block_size))),
        ("forward", lambda: reference.forward(*backend_arguments("forward", q, k, v, block_indices, *docs, block_size, 0.125))),
        ("backward", lambda: reference.backward(*backend_arguments("backward", q, q, k, v, q, torch.zeros(seqlen, heads),
                                                                   block_indices, *docs, block_size, 0.125))),
    ):
        with FlopCounterMode(display=False) as counter:
            call()
        counts[name] = counter.get_total_flops()
    return counts


def test_reference_work_is_linear_in_the_sequence_length():
    """Doubling the length doubles the attention work (each query reads topk * block_size keys):
    a T x T path would quadruple it. Selection scores every visible key, so it may grow with
    T^2, but by no more than the candidate blocks it scores."""
    short, long = _reference_flops(256), _reference_flops(512)
    assert long["forward"] == 2 * short["forward"] > 0
    assert long["backward"] == 2 * short["backward"] > 0
    assert 0 < long["select"] <= 4 * short["select"]
