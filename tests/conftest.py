import os

import pytest
import torch

# The Triton kernel cases run natively on a CUDA host, or under the interpreter in the
# subprocess of tests/triton/test_interpret.py; anywhere else that subprocess covers them.
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    collect_ignore = ["triton/kernels"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
