import os
import shutil
import sys
import tempfile

import pytest
import torch

from tests.support.determinism import deterministic_algorithms as _deterministic_algorithms
from tests.support.uninitialized import allocate_with, junk_buffer

# The Triton kernel cases run natively on a CUDA host, or under the interpreter in the
# subprocess of tests/triton/test_interpret.py; anywhere else that subprocess covers them.
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    collect_ignore = ["triton/kernels"]


def _share_the_cores_among_workers():
    """Under `pytest -n N`, give each worker (and the subprocesses it starts) its share of the cores.

    Every worker's torch otherwise sizes its thread pool to the whole machine: with two workers on
    two cores, a CPU-bound test runs 2.2x slower than on one thread, its threads and the other
    worker's preempting each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores_among_workers()

# The run's temporary folder (see `_one_temporary_folder_for_the_run`), named for the xdist workers
# and the subprocesses the tests start, which inherit it.
RUN_TEMP_ENV = "TORCH_MSA_TEST_TMPDIR"


def _one_temporary_folder_for_the_run() -> str | None:
    """Point the temporary folder (`TMPDIR`, `tempfile.tempdir`) of this run, its xdist workers
    and every process they start at one new folder, and return it (None in a worker, which
    inherits it). Everything the tests leave in a temporary folder lands there: pytest's
    `tmp_path` folders, torch.compile's inductor cache, the folders AOTInductor unpacks packages
    into, the C++ stub's build. `pytest_sessionfinish` removes it when the run passes."""
    if RUN_TEMP_ENV in os.environ:
        return None
    folder = tempfile.mkdtemp(prefix="torch_msa_tests_")
    os.environ[RUN_TEMP_ENV] = os.environ["TMPDIR"] = tempfile.tempdir = folder
    return folder


_RUN_TEMP_FOLDER = _one_temporary_folder_for_the_run()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Remove the run's temporary folder if the run passed; otherwise keep it for the failed
    tests' files and say where it is."""
    if _RUN_TEMP_FOLDER is None:
        return
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        shutil.rmtree(_RUN_TEMP_FOLDER, ignore_errors=True)
    else:
        print(f"\nthe run's temporary files are kept in {_RUN_TEMP_FOLDER}", file=sys.stderr)


# The skips that a host's hardware explains: under CI they are the only ones allowed
# (`pytest_runtest_makereport`). Every other skip reason names what is missing and the command
# that installs it.
NO_CUDA = "needs a CUDA device"
HARDWARE_SKIPS = (
    NO_CUDA,  # this reason (torch.cuda.is_available() is False)
    "needs a GPU of compute capability",  # a CUDA device of another generation
    "needs a host without a CUDA device",  # a check of what a command says where there is none
)


def under_ci() -> bool:
    """Whether the run is CI's: the `CI` variable set to anything but empty, 0, false or no (CI
    services and `.ci/run` set `CI=true`)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_collection_modifyitems(config, items):
    """Run the tests marked `slow` first, so that the workers of `pytest -n` start the long ones
    early and finish together; skip the tests marked `cuda` on a host without CUDA (pyproject.toml
    declares both markers), whatever else they need: that skip comes first."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skipif(True, reason=f"{NO_CUDA} (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(no_cuda, append=False)  # the first skipif pytest evaluates


def _skip_reason(report) -> str:
    """The reason of a skipped test's or module's report (pytest keeps `(path, line, reason)`)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_a_skip_under_ci(report) -> None:
    """Under CI, turn `report`'s skip into a failure unless the hardware explains it: there a
    skip can only mean a broken install (a test extra that did not install or import)."""
    if not report.skipped or hasattr(report, "wasxfail") or not under_ci():
        return
    reason = _skip_reason(report)
    if reason.startswith(HARDWARE_SKIPS):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI (CI={os.environ['CI']}), where only a missing or different GPU may skip "
                       f"a test: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_a_skip_under_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a module skipped as a whole (`pytest.importorskip` at its top)."""
    outcome = yield
    _fail_a_skip_under_ci(outcome.get_result())


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def junk_in_uninitialized_buffers(monkeypatch):
    """Every buffer the code under test takes from `torch_msa.uninitialized` starts out as junk (NaN,
    an integer's largest value: `tests/support/uninitialized.py`), so that a kernel that reads what
    nobody wrote fails its test."""
    allocate_with(monkeypatch, junk_buffer)


@pytest.fixture
def deterministic_algorithms():
    """`torch.use_deterministic_algorithms(True)` for the test, the previous setting after it."""
    with _deterministic_algorithms():
        yield
