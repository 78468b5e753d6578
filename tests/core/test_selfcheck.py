"""`python -m torch_msa`: the command line, and that its float64 checks do catch wrong results."""

import dataclasses
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_msa
from tests.support.documents import backend_arguments
from tests.support.terminal import FakeTerminal, screen
from torch_msa import __main__ as selfcheck
from torch_msa import flops

REPOSITORY = Path(__file__).resolve().parents[2]

# A tiny topology (not M3) so the in-process checks run in well under a second.
SMALL = selfcheck.Shape(query_heads=4, kv_heads=2, head_dim=64, index_dim=64, block_size=64, topk=2)
# Up to 5 visible blocks for topk 2, so selection really rejects blocks; one suffix document.
SMALL_DOCUMENTS = [selfcheck.Document(150, 260), selfcheck.Document(64, 64), selfcheck.Document(1, 1)]
STAGES = ("select_blocks", "forward", "backward")
ABOUT = r"(\d\.\d s|\d+ s|\d+:\d\d)"  # the forms of `__main__.about`: 0.4 s, 12 s, 1:05


def _run_cli(*args, timeout=120, pythonpath=(), cwd=REPOSITORY):
    """`python -m torch_msa ARGS` from `cwd` (the checkout: its torch_msa comes first on the module
    path), with `pythonpath` ahead of the environment's PYTHONPATH."""
    env = {key: value for key, value in os.environ.items() if key != "TORCH_MSA_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "torch_msa", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def _installed_elsewhere(site: Path, *, editable: bool = True, version: str = "9.9") -> Path:
    """Metadata of a torch_msa distribution installed by pip in `site` (for an editable install,
    from the checkout `site/elsewhere`); returns the package folder that install serves."""
    info = site / f"torch_msa-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_msa\nVersion: {version}\n")
    (info / "RECORD").write_text(f"torch_msa-{version}.dist-info/METADATA,,\n")
    if editable:
        (info / "direct_url.json").write_text(
            '{"dir_info": {"editable": true}, "url": "%s"}' % (site / "elsewhere").as_uri())
        return site / "elsewhere" / "torch_msa"
    return site / "torch_msa"


def _started_and_ended(lines: list[str], label: str) -> tuple[str, str]:
    """The line that says `label` started (with its expected time) and the one with its time."""
    start = next((i for i, line in enumerate(lines) if line.startswith(f"{label} ...")), None)
    assert start is not None, f"no line starts {label!r}:\n" + "\n".join(lines)
    end = next((line for line in lines[start + 1:] if re.fullmatch(rf"{re.escape(label)}: \d+\.\d ms", line)), None)
    assert end is not None, f"no time for {label!r} after its start:\n" + "\n".join(lines)
    return lines[start], end


@pytest.fixture(scope="module")
def small_cli_run(tmp_path_factory):
    """A small CPU run from the checkout's root while another torch_msa 9.9 is installed."""
    site = tmp_path_factory.mktemp("site")
    elsewhere = _installed_elsewhere(site)
    return _run_cli("--seqlen", "200", "--dtype", "fp32", "--device", "cpu", pythonpath=[site]), elsewhere


def test_small_run_passes(small_cli_run):
    result, _ = small_cli_run
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "self-check: PASS"
    for start in ("  device     cpu", "  backends   select_blocks=", "  dtype      fp32",
                  "  documents  Lk [151, 25, 15, 9]  Lq [129, 25, 15, 9]", "time (ms)    select_blocks", "keys read"):
        assert any(line.startswith(start) for line in lines), f"no line starts with {start!r}:\n{result.stdout}"
    for name in ("selection", "out", "lse", "dq", "sum dv", "sum dk"):
        assert any(line.startswith(f"  {name} ") and " PASS" in line for line in lines), \
            f"no PASS line for {name}:\n{result.stdout}"
    assert "running the ops:" not in result.stderr  # stderr is a pipe: no progress display


def test_each_stage_says_when_it_starts_and_how_long_it_should_take(small_cli_run):
    """Off a terminal too: the warm-up times the stages, and every stage of the run starts with a
    line giving its expected time."""
    lines = small_cli_run[0].stdout.splitlines()
    warm_up = lines.index("warm-up on 32 queries of the first document, to time the stages")
    run = next(i for i, line in enumerate(lines) if line.startswith("running the ops (expected about "))
    assert re.fullmatch(rf"running the ops \(expected about {ABOUT} with the float64 check\)", lines[run])
    for stage in STAGES:
        started, _ = _started_and_ended(lines[warm_up:run], f"  {stage}")
        assert started == f"  {stage} ..."  # nothing to expect yet
        started, _ = _started_and_ended(lines[run:], f"  {stage}")
        assert re.fullmatch(rf"  {stage} \.\.\. \(expected about {ABOUT}\)", started), started
    check = next(line for line in lines if line.startswith("float64 check of "))
    assert re.fullmatch(rf"float64 check of \d+ sampled tokens and the dk/dv sums \.\.\. \(expected about {ABOUT}\)", check)


def test_the_header_names_the_checked_package_and_warns_when_it_is_not_the_installed_one(small_cli_run):
    result, elsewhere = small_cli_run
    checkout = (REPOSITORY / "torch_msa").resolve()
    assert f"  torch_msa  {torch_msa.__version__} at {checkout} (not the installed copy: see the warning)" \
        in result.stdout.splitlines()
    assert (f"warning: this checks the torch_msa {torch_msa.__version__} at {checkout}, imported from the current "
            f"directory ahead of the installed torch_msa 9.9 at {elsewhere} (an editable install); run from another "
            f"directory to check the installed one") in result.stderr.splitlines()


def test_stage_lines_are_flushed_before_the_stage_runs(monkeypatch):
    """A log or a pipe shows each stage as it starts: its line is flushed before the op runs."""

    class Recorder(io.StringIO):
        flushed = ""

        def flush(self):
            self.flushed = self.getvalue()

    stdout = Recorder()
    monkeypatch.setattr("sys.stdout", stdout)
    seen_by_op = {}
    for name, stage in (("select_blocks", "select_blocks"), ("sparse_attention", "forward")):
        original = getattr(torch_msa, name)

        def spy(*args, _original=original, _stage=stage, **kwargs):
            seen_by_op[_stage] = stdout.flushed
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch_msa, name, spy)
    problem = selfcheck.make_problem(SMALL_DOCUMENTS, torch.float32, torch.device("cpu"), seed=0, shape=SMALL)
    selfcheck.run_ops(problem, step="  ", expected_s={"select_blocks": 1.0, "forward": 2.0, "backward": 5.0})
    assert seen_by_op["select_blocks"].splitlines() == ["  select_blocks ... (expected about 1.0 s)"]
    assert seen_by_op["forward"].splitlines()[-1] == "  forward ... (expected about 2.0 s)"
    assert stdout.flushed == stdout.getvalue()


def test_progress_on_a_terminal_names_each_stage_with_its_expected_time(monkeypatch, capsys):
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    expected = {"select_blocks": 1.0, "forward": 2.0, "backward": 5.0}
    started = {}
    start = selfcheck.Progress.start

    def spy(progress, step, expected_s=None):
        started[step] = expected_s
        start(progress, step, expected_s)

    monkeypatch.setattr(selfcheck.Progress, "start", spy)
    problem = selfcheck.make_problem(SMALL_DOCUMENTS, torch.float32, torch.device("cpu"), seed=0, shape=SMALL)
    selfcheck.run_ops(problem, step="  ", expected_s=expected)
    assert started == expected
    raw = terminal.getvalue()
    assert re.search(r"running the ops: 0/3 done, select_blocks, \d+:\d\d elapsed", raw)
    assert re.search(r"running the ops: 2/3 done, backward, \d+:\d\d elapsed, about 0:0[45] left", raw)
    assert screen(terminal) == [""]  # the display is cleared once the ops ran
    out = capsys.readouterr().out.splitlines()
    assert out[::2] == [f"  {stage} ... (expected about {expected[stage]:.1f} s)" for stage in STAGES]
    assert [line.split(":")[0] for line in out[1::2]] == [f"  {stage}" for stage in STAGES]


def test_help_lists_the_options_and_says_how_long_a_run_takes():
    result = _run_cli("--help")
    assert result.returncode == 0
    for option in ("--device", "--seqlen", "--queries", "--dtype", "--backend", "--seed"):
        assert option in result.stdout
    for dtype in ("bf16", "fp16", "fp32", "fp64"):
        assert dtype in result.stdout
    text = " ".join(result.stdout.split())
    assert "split into 4 documents (default: 4096)" in text
    assert "the default run takes 10 to 20 s on two cores and under a minute on two cores that a test suite also " \
           "uses" in text
    assert f"on CPU, where the time grows with the queries, {selfcheck.CPU_DEFAULT_QUERIES}," in text


def test_unknown_backend_is_refused():
    result = _run_cli("--backend", "no_such_backend")
    assert result.returncode != 0
    assert "unknown backend 'no_such_backend'" in result.stderr
    assert "reference" in result.stderr  # the message lists the registered backends
    assert "self-check" not in result.stdout  # refused before any work


def test_document_layout():
    layout = selfcheck.document_layout(4096)
    assert [d.keys for d in layout] == [3072, 512, 320, 192]
    assert [d.queries for d in layout] == [2612, 512, 320, 192]
    for seqlen in (4, 5, 37, 600):
        layout = selfcheck.document_layout(seqlen)
        assert sum(d.keys for d in layout) == seqlen
        assert all(1 <= d.queries <= d.keys for d in layout)
    with pytest.raises(ValueError, match="seqlen"):
        selfcheck.document_layout(3)


@pytest.mark.parametrize("queries", [4, 5, 100, 640, 3000, 3635, 3636])
def test_fewer_queries_are_shared_in_proportion_and_keep_every_key(queries):
    full = selfcheck.document_layout(4096)
    layout = selfcheck.document_layout(4096, queries)
    assert [d.keys for d in layout] == [d.keys for d in full]
    assert sum(d.queries for d in layout) == queries
    for document, whole in zip(layout, full):
        assert 1 <= document.queries <= whole.queries
        assert abs(document.queries - whole.queries * queries / 3636) < 2


@pytest.mark.parametrize("queries", [0, 3, 3637])
def test_a_query_count_the_layout_cannot_hold_is_refused(queries, capsys):
    with pytest.raises(ValueError, match=f"queries: expected 4 .* to 3636 .*, got {queries}"):
        selfcheck.document_layout(4096, queries)
    with pytest.raises(SystemExit) as exit_info:
        selfcheck.parse_args(["--device", "cpu", "--queries", str(queries)])
    assert exit_info.value.code == 2
    assert "argument --queries: expected 4 (one per document) to 3636" in capsys.readouterr().err


def _attention_flops(documents) -> int:
    """Forward and backward FLOPs the reference spends: every query reads topk * block_size keys."""
    pairs = sum(d.queries for d in documents) * selfcheck.M3.topk * selfcheck.M3.block_size
    return (flops.attention_forward(selfcheck.M3.query_heads, selfcheck.M3.head_dim, pairs)
            + flops.attention_backward(selfcheck.M3.query_heads, selfcheck.M3.head_dim, pairs))


def test_the_default_cpu_run_is_a_fraction_of_the_full_one_and_still_selects():
    """The cost guard (machine independent): on CPU the default run does at most a fifth of the
    attention work of the full layout a GPU runs, which took 8.5 minutes on two cores shared with
    other work. Its first document still holds more keys than a query reads, and every one of its
    queries chooses among more blocks than it keeps."""
    args = selfcheck.parse_args(["--device", "cpu"])
    assert (args.seqlen, args.queries) == (4096, selfcheck.CPU_DEFAULT_QUERIES)
    assert selfcheck.default_queries(torch.device("cuda"), 4096) is None  # a GPU runs the full layout
    cpu, full = selfcheck.document_layout(args.seqlen, args.queries), selfcheck.document_layout(args.seqlen)
    assert _attention_flops(cpu) <= _attention_flops(full) / 5
    long = cpu[0]
    reads = selfcheck.M3.topk * selfcheck.M3.block_size
    assert long.keys > reads and long.keys - long.queries >= reads  # its first query sees 17 or more blocks
    assert long.queries >= 256
    # Small problems keep their full layout.
    assert selfcheck.parse_args(["--device", "cpu", "--seqlen", "200"]).queries == 178


@pytest.mark.parametrize("cores, load, current, threads", [
    (2, 0.1, 2, 2),  # idle: every core
    (2, 0.6, 2, 1),  # one core busy
    (2, 5.0, 2, 1),  # busy: one thread, never zero
    (16, 3.2, 16, 13),
    (16, 0.0, 8, 8),  # never more than torch chose
    (1, 0.0, 4, 1),  # never more than the cores this process gets
])
def test_cpu_threads_are_the_free_cores(cores, load, current, threads):
    assert selfcheck.cpu_threads(cores, load, current) == threads


def test_cpu_threads_follow_the_load_unless_omp_num_threads_is_set(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    monkeypatch.setattr(selfcheck, "available_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (4.6, 3.0, 1.0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert selfcheck.size_cpu_threads() == "1 thread: 2 cores, load 4.6"
    assert chosen == [1]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert selfcheck.size_cpu_threads().endswith("threads, from OMP_NUM_THREADS")
    assert chosen == [1]


def test_package_report(tmp_path):
    checkout = tmp_path / "checkout"
    imported = checkout / "torch_msa"
    installed = selfcheck.InstalledCopy
    line, warning = selfcheck.package_report(imported, "0.1.0", installed("0.1.0", imported, editable=True), checkout)
    assert (line, warning) == (f"0.1.0 at {imported} (an editable install)", None)
    line, warning = selfcheck.package_report(imported, "0.1.0", None, checkout)
    assert (line, warning) == (f"0.1.0 at {imported} (not installed: imported from the current directory)", None)
    site = tmp_path / "site" / "torch_msa"
    line, warning = selfcheck.package_report(imported, "0.1.0", installed("0.0.9", site, editable=False), checkout)
    assert line == f"0.1.0 at {imported} (not the installed copy: see the warning)"
    assert warning == (f"warning: this checks the torch_msa 0.1.0 at {imported}, imported from the current directory "
                       f"ahead of the installed torch_msa 0.0.9 at {site} (installed); run from another directory to "
                       f"check the installed one")
    _, warning = selfcheck.package_report(imported, "0.1.0", installed("0.0.9", site, editable=False), tmp_path)
    assert warning is not None and "imported from the module path" in warning and "PYTHONPATH" in warning


def test_installed_copy_reads_the_installer_metadata_and_skips_a_build_folder(tmp_path, monkeypatch):
    build = tmp_path / "checkout" / "torch_msa.egg-info"  # what building a checkout leaves: no RECORD
    build.mkdir(parents=True)
    (build / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: torch_msa\nVersion: 0.0.1\n")
    package_dir = _installed_elsewhere(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.syspath_prepend(str(tmp_path / "checkout"))
    assert selfcheck.installed_copy() == selfcheck.InstalledCopy("9.9", package_dir, editable=True)
    package_dir = _installed_elsewhere(tmp_path / "site2", editable=False, version="9.8")
    monkeypatch.syspath_prepend(str(tmp_path / "site2"))
    assert selfcheck.installed_copy() == selfcheck.InstalledCopy("9.8", package_dir, editable=False)


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
def test_the_default_cpu_run_passes_with_a_sparse_selection():
    """The README's install check on the CPU reference (M3 shapes, bf16, select + forward +
    backward), as a newcomer runs it. Its cost is guarded by the FLOP count above, not by the
    clock; the timeout only catches a hang."""
    result = _run_cli("--device", "cpu", timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "self-check: PASS"
    assert f"q [{selfcheck.CPU_DEFAULT_QUERIES}, 64, 128]" in result.stdout
    keys_read = re.search(r"keys read .* \((\d+\.\d)%\)", result.stdout)
    assert keys_read and float(keys_read.group(1)) < 100.0, result.stdout


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
