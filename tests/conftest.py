import os

import pytest
import torch

from tests.support.determinism import deterministic_algorithms as _deterministic_algorithms

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


def pytest_collection_modifyitems(config, items):
    """Run the tests marked `slow` first, so that the workers of `pytest -n` start the long ones
    early and finish together; skip the tests marked `cuda` on a host without CUDA (pyproject.toml
    declares both markers)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def deterministic_algorithms():
    """`torch.use_deterministic_algorithms(True)` for the test, the previous setting after it."""
    with _deterministic_algorithms():
        yield
