"""The SM90 (Hopper) backend: `msa::forward` and `msa::backward` by CuTe DSL wgmma/TMA kernels.

Each kernel is a class in its own module, which imports cutlass at the top: `forward_kernel.py`,
`backward_kernel.py`. Their shared device code: `tile_scheduler.py` (the persistent walk over the
plan's items), `pipeline.py` (the TMA load pipelines, on `cutlass.pipeline`), `mask.py`,
`softmax.py` and `tiles.py` (tile layouts and loads). Its host side, torch only, holds
the input checks, buffers, launch, compile cache and the functions this package calls:
`forward_host.py`, `backward_host.py`. `common.py` holds what all of them share: the served
configuration, the tile shape, the schedule operands. The bitwise-reproducible backward is
composed of the SM90 key pass and the Triton stages: `backward_deterministic.py`.
The forward runs over windows of queries when its partials would pass
`query_windows.PARTIAL_BYTES` (`torch_msa/query_windows.py`), so its memory stays bounded.

It serves a CUDA device of compute capability 9.0 with the `cute` extra (nvidia-cutlass-dsl,
cuda-bindings) and triton (the forward's partials are merged, and the backward's delta computed,
by Triton kernels: `torch_msa.triton.stages`) installed, and within that the configuration the
kernels are built for: 16 query heads per KV head, D = 128, block_size = 128, bf16 or fp16
(MiniMax-M3). Other inputs raise
`UnsupportedInputs` before any work, and the registry falls back to the Triton backend with a
one-time warning. The block selection and the plan stay with the Triton backend.

It serves the forward, the backward and the backward with the fused index loss by default on
such devices (priority above the Triton backend). The backward kernel adds with atomics;
under `torch.use_deterministic_algorithms(True)` its bitwise-reproducible variant serves (the kernel
without dQ for dK/dV, the Triton deterministic backward's reduction and query-outer dQ).
`TORCH_MSA_BACKEND=triton` forces the Triton kernels.

Importing this package imports neither cutlass nor triton; a kernel compiles on first use (one
executable per process, dtype and KV head count; sequence lengths are runtime arguments).
"""

import functools
import importlib

import torch

from ..backends import Backend, register_backend
from ..cute_dsl import CUTE_DSL_MODULES, INSTALL_COMMAND, device_unavailable_reason, importable, sm_capability
from ..query_windows import forward_in_windows

NAME = "sm90"
PRIORITY = 15  # above the portable Triton backend (10), below SM100 (20), which other devices get
SM90_CAPABILITY = (9, 0)
_REQUIRED_MODULES = (*CUTE_DSL_MODULES, "triton")


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
    return all(importable(name) for name in _REQUIRED_MODULES)


def unavailable_reason(device: torch.device) -> str | None:
    """Why the backend cannot serve `device` (no CUDA device, its capability, missing extras), or None."""
    return device_unavailable_reason(device, SM90_CAPABILITY, "the SM90 kernel needs", "H100/H200/H800", _REQUIRED_MODULES,
                                     f"install the CuTe DSL: {INSTALL_COMMAND}")


def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan=None):
    """`msa::forward` through the SM90 kernel; see `torch_msa.sm90.forward_host.forward`."""
    module = importlib.import_module(f"{__name__}.forward_host")
    with torch.cuda.device(q.device):
        return forward_in_windows(module.forward, q, k, v, block_indices, documents, block_size, softmax_scale, plan)


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None, plan=None):
    """`msa::backward` through the SM90 kernel (`torch_msa.sm90.backward_host.backward`), or, under
    `torch.use_deterministic_algorithms(True)`, through its bitwise-reproducible variant
    (`torch_msa.sm90.backward_deterministic.backward`): the kernel adds dQ, dK and dV with atomics,
    whose order varies."""
    # Decided per call, like torch's own kernels: the flag may change between steps.
    deterministic = torch.are_deterministic_algorithms_enabled()
    module = importlib.import_module(f"{__name__}.{'backward_deterministic' if deterministic else 'backward_host'}")
    with torch.cuda.device(q.device):
        return module.backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale,
                               grad_lse, plan)


def backward_with_index_loss(*args):
    """`msa::backward_with_index_loss` with the KL's teacher written by the SM90 backward kernel;
    see `torch_msa.sm90.index_loss.backward_with_index_loss`."""
    return importlib.import_module(f"{__name__}.index_loss").backward_with_index_loss(*args)


BACKEND = Backend(
    name=NAME,
    ops={"forward": forward, "backward": backward, "backward_with_index_loss": backward_with_index_loss},
    priority=PRIORITY,
    device_types=("cuda",),
    available=available,
    unavailable_reason=unavailable_reason,
)


def register() -> None:
    """Add the backend to the registry (`import torch_msa` does)."""
    register_backend(BACKEND)
