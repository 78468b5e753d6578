"""The SM90 (Hopper) backend: `msa::forward` by a CuTe DSL wgmma/TMA kernel (`forward_sm90.py`).

It serves a CUDA device of compute capability 9.0 with the `cute` extra (nvidia-cutlass-dsl,
cuda-bindings) and triton (the partials are merged by the Triton combine kernel) installed, and
within that the configuration the kernel is built for: 16 query heads per KV head, D = 128,
block_size = 128, bf16 or fp16 (MiniMax-M3). Other inputs raise `UnsupportedInputs` before any
work, and the registry falls back to the Triton backend with a one-time warning. The backward and
the block selection stay with the Triton backend.

Importing this package imports neither cutlass nor triton; the kernel compiles on first use (one
executable per process, dtype and KV head count; sequence lengths are runtime arguments).
"""

import functools
import importlib
import importlib.util

import torch

from ..backends import Backend, register_backend
from ..cute_dsl import sm_capability

NAME = "sm90"
PRIORITY = 15  # above the portable Triton backend (10), below SM100 (20), which other devices get
SM90_CAPABILITY = (9, 0)
_REQUIRED_MODULES = ("cutlass", "cuda.bindings.driver", "triton")


def available(device: torch.device) -> bool:
    """True on a CUDA device of compute capability 9.0 with the cute extra and triton installed.

    Only looks the modules up (`importlib.util.find_spec`); nothing heavy is imported.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if sm_capability(device) != SM90_CAPABILITY:
        return False
    return _extras_installed()


@functools.cache
def _extras_installed() -> bool:
    return all(_importable(name) for name in _REQUIRED_MODULES)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def forward(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale):
    """`msa::forward` through the SM90 kernel; see `torch_msa.sm90.forward_sm90.forward`."""
    module = importlib.import_module(f"{__name__}.forward_sm90")
    module.check_served(q, k, v, block_size)
    with torch.cuda.device(q.device):
        return module.forward(
            q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale
        )


BACKEND = Backend(
    name=NAME,
    ops={"forward": forward},
    priority=PRIORITY,
    device_types=("cuda",),
    available=available,
)


def register() -> Backend:
    """Add the SM90 backend to the registry (idempotent: it replaces itself by name)."""
    register_backend(BACKEND)
    return BACKEND
