"""The Triton backend: every MSA op on CUDA devices of compute capability 8.0 and newer, bf16,
fp16 or fp32, at most 128 query heads per KV head (`README.md`). Its ops are in `interface.py`.
"""

import functools
import importlib.util

import torch

from ..backends import Backend

NAME = "triton"
MIN_CAPABILITY = (8, 0)
INSTALL_COMMAND = "pip install triton"
OPS = ("select_blocks", "plan", "forward", "backward", "indexer_kl", "indexer_kl_backward")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _triton_installed() -> bool:
    # Every op call asks, and the lookup walks sys.path.
    return importlib.util.find_spec("triton") is not None


def unavailable_reason(device: torch.device) -> str | None:
    """Why the backend cannot serve `device`, or None if it can."""
    if device.type != "cuda":
        return f"it serves CUDA devices only, not {device.type}"
    if not _triton_installed():
        return f"triton is not installed ({INSTALL_COMMAND}; it ships with Linux x86_64 torch)"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = _capability(index)
    if capability < MIN_CAPABILITY:
        return (f"cuda:{index} has compute capability {capability[0]}.{capability[1]} < "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, the least the Triton kernels need")
    return None


def available(device: torch.device) -> bool:
    return unavailable_reason(device) is None


BACKEND = Backend(
    name=NAME,
    ops={op: f"{__name__}.interface:{op}" for op in OPS},
    priority=10,
    device_types=("cuda",),
    available=available,
    unavailable_reason=unavailable_reason,
)
