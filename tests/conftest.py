import os

import pytest
import torch

from tests.support.determinism import deterministic_algorithms as _deterministic_algorithms

# The Triton kernel cases run natively on a CUDA host, or under the interpreter in the
# subprocess of tests/triton/test_interpret.py; anywhere else that subprocess covers them.
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    collect_ignore = ["triton/kernels"]


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
