"""The SM90 (Hopper) backend: CuTe DSL kernels for `msa::forward`, `msa::backward` and the
backward with the index loss; its ops are in `interface.py`, its design in `README.md`.

Serves compute capability 9.0 with the `cute` extra and triton installed, and only 16 query heads
per KV head, D = 128, block_size = 128, bf16 or fp16; other inputs raise `UnsupportedInputs`.
"""

import functools

import torch

from ..backends import Backend
from ..cute_dsl import CUTE_DSL_MODULES, INSTALL_COMMAND, device_unavailable_reason, importable, sm_capability

NAME = "sm90"
PRIORITY = 15  # above the portable Triton backend (10), below SM100 (20), which other devices get
SM90_CAPABILITY = (9, 0)
_REQUIRED_MODULES = (*CUTE_DSL_MODULES, "triton")


def available(device: torch.device) -> bool:
    """True on a CUDA device of compute capability 9.0 with the cute extra and triton installed."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if sm_capability(device) != SM90_CAPABILITY:
        return False
    return _extras_installed()


@functools.cache
def _extras_installed() -> bool:
    return all(importable(name) for name in _REQUIRED_MODULES)


def unavailable_reason(device: torch.device) -> str | None:
    """Why the backend cannot serve `device` (no CUDA device, its capability, missing extras), or None."""
    return device_unavailable_reason(device, SM90_CAPABILITY, "the SM90 kernel needs", "H100/H200/H800", _REQUIRED_MODULES,
                                     f"install the CuTe DSL: {INSTALL_COMMAND}")


BACKEND = Backend(
    name=NAME,
    ops={op: f"{__name__}.interface:{op}" for op in ("forward", "backward", "backward_with_index_loss")},
    priority=PRIORITY,
    device_types=("cuda",),
    available=available,
    unavailable_reason=unavailable_reason,
)
