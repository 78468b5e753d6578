"""Run `tests/triton/kernels` (the Triton kernels vs the reference) under the Triton interpreter on CPU.

The interpreter is chosen when triton is imported, so the cases run in a fresh interpreter
process with `TRITON_INTERPRET=1`, one process per kernel test file (so that the files spread over
the test workers); every commit thereby tests the kernels' logic without a GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import install

pytest.importorskip("triton", reason=install.TRITON)

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = sorted(path.name for path in (ROOT / "tests" / "triton" / "kernels").glob("test_*.py"))


def test_the_kernel_test_files_are_found():
    # An empty list would leave the parametrised test below with nothing to run, silently.
    assert {"test_attention_kernels.py", "test_selection_kernel.py", "test_kl_dense_kernel.py"} <= set(KERNEL_TESTS), KERNEL_TESTS


@pytest.mark.slow
@pytest.mark.parametrize("test_file", KERNEL_TESTS)
def test_triton_kernels_under_the_interpreter(test_file):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/triton/kernels/{test_file}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "skipped" not in result.stdout, tail
