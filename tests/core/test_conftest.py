"""The hooks of `tests/conftest.py`: under CI (`CI=true`) only the hardware may skip a test
(elsewhere a skip stays a skip), and a run leaves nothing in the temporary folder. Checked on a
tiny suite run by pytest in a subprocess with the repository's conftest."""

import dataclasses
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

from tests.conftest import RUN_TEMP_ENV

REPOSITORY = Path(__file__).resolve().parents[2]

CONFTEST = "from tests.conftest import *  # noqa: F403 (its hooks)\n"
TESTS = '''
import pytest


@pytest.mark.cuda
def test_needs_cuda():
    pass


@pytest.mark.cuda
@pytest.mark.skipif(True, reason="needs nothing_here; install it with: pip install nothing_here")
def test_needs_cuda_and_a_package():
    pass


@pytest.mark.skipif(True, reason="needs a GPU of compute capability 9.0 (H100 / H200)")
def test_needs_another_gpu():
    pass


@pytest.mark.skipif(True, reason="needs a host without a CUDA device (with one it would run the benchmark)")
def test_needs_no_gpu():
    pass


def test_needs_a_package():
    pytest.importorskip("nothing_here_for_the_skip_policy", reason="needs nothing_here; install it with: pip install it")


@pytest.fixture
def toolchain():
    pytest.skip("needs a C++ compiler; install one, e.g. with: sudo apt-get install g++")


def test_needs_a_toolchain(toolchain):
    pass


def test_passes():
    pass


def test_writes_temporary_files(tmp_path):
    """Writes where a test's temporary files go: tmp_path, tempfile, a subprocess's tempfile, inductor's cache."""
    import os
    import subprocess
    import sys
    import tempfile

    (tmp_path / "file").write_text("x")
    folder = tempfile.mkdtemp()
    script = "import tempfile, torch._inductor.runtime.cache_dir_utils as c; print(tempfile.mkdtemp()); print(c.cache_dir())"
    child_folder, inductor_cache = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                                  check=True).stdout.split()
    with open(os.environ["TINY_SUITE_FOLDERS"], "w") as report:
        report.write("\\n".join([str(tmp_path), folder, child_folder, inductor_cache]))
'''
MODULE_SKIP = '''
import pytest

pytest.importorskip("nothing_here_for_the_skip_policy", reason="needs nothing_here; install it with: pip install it")


def test_never_collected():
    pass
'''


@dataclasses.dataclass
class TinyRun:
    outcomes: dict[str, tuple[str, str]]  # {test name: (outcome, message)}; a module's collection by its name
    temporary: Path  # the temporary folder the run was given
    folders: list[Path]  # where test_writes_temporary_files wrote: tmp_path, mkdtemp, a child's mkdtemp, inductor's cache
    stderr: str


def _run_tiny_suite(tmp_path: Path, ci: str | None) -> TinyRun:
    """The tiny suite run with `CI=ci` (None: unset) and `tmp_path / "temporary"` as its `TMPDIR`."""
    suite, temporary = tmp_path / "suite", tmp_path / "temporary"
    suite.mkdir()
    temporary.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_tiny.py").write_text(TESTS)
    (suite / "test_module_skip.py").write_text(MODULE_SKIP)
    # A fresh run's environment: without this run's temporary folder, nor the cache folders that
    # torch writes into the environment once it has used them (inductor's cache_dir() does).
    inherited = ("CI", "PYTEST_ADDOPTS", RUN_TEMP_ENV, "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    env = {key: value for key, value in os.environ.items() if key not in inherited}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), env.get("PYTHONPATH")]))
    env["TMPDIR"] = str(temporary)
    env["TINY_SUITE_FOLDERS"] = str(tmp_path / "folders.txt")
    if ci is not None:
        env["CI"] = ci
    report = tmp_path / "report.xml"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                             "--continue-on-collection-errors", f"--junitxml={report}", "--rootdir", str(suite), str(suite)],
                            capture_output=True, text=True, timeout=300, cwd=suite, env=env)
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = case.get("name") or case.get("classname")
        # A collection error keeps its text in the element, a test's outcome in its message.
        results = [(child.tag, child.get("message") if child.get("message") != "collection failure" else child.text or "")
                   for child in case if child.tag in ("skipped", "failure", "error")]
        outcomes[name] = results[0] if results else ("passed", "")
    folders = [Path(line) for line in (tmp_path / "folders.txt").read_text().splitlines()]
    return TinyRun(outcomes, temporary, folders, result.stderr)


NO_CUDA_SKIP = "needs a CUDA device (torch.cuda.is_available() is False)"


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    return _run_tiny_suite(tmp_path_factory.mktemp("ci"), "true")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _run_tiny_suite(tmp_path_factory.mktemp("not_ci"), None)


@pytest.fixture
def under_ci(ci_run):
    return ci_run.outcomes


@pytest.fixture
def off_ci(run):
    return run.outcomes


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without a CUDA device (the tiny suite's "
                                                      "cuda tests run on one)")
def test_without_cuda_the_cuda_tests_skip_for_that_reason_first(under_ci, off_ci):
    for outcomes in (under_ci, off_ci):
        assert outcomes["test_needs_cuda"] == ("skipped", NO_CUDA_SKIP)
        assert outcomes["test_needs_cuda_and_a_package"] == ("skipped", NO_CUDA_SKIP)


def test_under_ci_only_the_hardware_may_skip(under_ci):
    assert under_ci["test_needs_another_gpu"][0] == "skipped"
    assert under_ci["test_needs_no_gpu"][0] == "skipped"
    assert under_ci["test_passes"] == ("passed", "")
    outcome, message = under_ci["test_needs_a_package"]
    assert outcome == "failure"
    assert message.startswith("skipped under CI (CI=true), where only a missing or different GPU may skip a test: ")
    assert message.endswith("needs nothing_here; install it with: pip install it")
    outcome, message = under_ci["test_needs_a_toolchain"]  # a fixture's skip: an error of the setup
    assert outcome == "error" and "sudo apt-get install g++" in message
    module = next(outcome for name, outcome in under_ci.items() if "test_module_skip" in name)
    assert module[0] == "error" and "skipped under CI" in module[1], module


def test_elsewhere_a_skip_stays_a_skip_and_says_what_to_install(off_ci):
    for name in ("test_needs_another_gpu", "test_needs_no_gpu", "test_needs_a_package", "test_needs_a_toolchain"):
        assert off_ci[name][0] == "skipped", (name, off_ci[name])
    assert off_ci["test_needs_a_package"][1] == "needs nothing_here; install it with: pip install it"
    module = next(outcome for name, outcome in off_ci.items() if "test_module_skip" in name)
    assert module[0] == "skipped", module


@pytest.mark.parametrize("value, enforced", [("true", True), ("1", True), ("yes", True), ("", False), ("0", False),
                                             ("false", False), (None, False)])
def test_what_counts_as_ci(monkeypatch, value, enforced):
    from tests.conftest import under_ci

    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert under_ci() is enforced


def test_a_passing_run_leaves_nothing_in_the_temporary_folder(run):
    """Every temporary file of the run, its subprocesses' and torch's included, went to one
    folder inside TMPDIR, removed at the end."""
    assert run.outcomes["test_writes_temporary_files"] == ("passed", "")
    (folder,) = {path.relative_to(run.temporary).parts[0] for path in run.folders}
    assert folder.startswith("torch_msa_tests_")
    assert list(run.temporary.iterdir()) == []


def test_a_failed_run_keeps_its_temporary_folder_and_says_where(ci_run):
    (folder,) = run_folders = list(ci_run.temporary.iterdir())
    assert folder.name.startswith("torch_msa_tests_") and all(path.is_relative_to(folder) for path in ci_run.folders)
    assert f"the run's temporary files are kept in {folder}" in ci_run.stderr, (run_folders, ci_run.stderr)
