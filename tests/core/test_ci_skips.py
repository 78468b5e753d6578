"""The skip policy of `tests/conftest.py`: under CI (`CI=true`) only the hardware may skip a test;
elsewhere a skip stays a skip. Checked on a tiny suite run by pytest in a subprocess with the
repository's hooks."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

REPOSITORY = Path(__file__).resolve().parents[2]

CONFTEST = "from tests.conftest import pytest_collection_modifyitems, pytest_make_collect_report, pytest_runtest_makereport\n"
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
'''
MODULE_SKIP = '''
import pytest

pytest.importorskip("nothing_here_for_the_skip_policy", reason="needs nothing_here; install it with: pip install it")


def test_never_collected():
    pass
'''


def _outcomes(tmp_path: Path, ci: str | None) -> dict[str, tuple[str, str]]:
    """`{test name: (outcome, message)}` of the tiny suite run with `CI=ci` (None: unset); a
    module's collection is named after the module."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_tiny.py").write_text(TESTS)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {key: value for key, value in os.environ.items() if key not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY), env.get("PYTHONPATH")]))
    if ci is not None:
        env["CI"] = ci
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    "--continue-on-collection-errors", f"--junitxml={report}", "--rootdir", str(tmp_path), str(tmp_path)],
                   capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = case.get("name") or case.get("classname")
        # A collection error keeps its text in the element, a test's outcome in its message.
        results = [(child.tag, child.get("message") if child.get("message") != "collection failure" else child.text or "")
                   for child in case if child.tag in ("skipped", "failure", "error")]
        outcomes[name] = results[0] if results else ("passed", "")
    return outcomes


NO_CUDA_SKIP = "needs a CUDA device (torch.cuda.is_available() is False)"


@pytest.fixture(scope="module")
def under_ci(tmp_path_factory):
    return _outcomes(tmp_path_factory.mktemp("ci"), "true")


@pytest.fixture(scope="module")
def off_ci(tmp_path_factory):
    return _outcomes(tmp_path_factory.mktemp("not_ci"), None)


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
