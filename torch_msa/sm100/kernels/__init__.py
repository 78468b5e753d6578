"""SM100 (Blackwell) kernels of torch_msa and the two gates they share.

The kernel modules of this package (the backward preprocess, task build, main kernel and
postprocess) are CuTe DSL source: their decorators and module constants need `cutlass` and
`cuda.bindings` while the module loads. Each of them calls `require_cute_dsl()` before its first
DSL import, so a host without the extras gets torch_msa's `UnavailableError` (naming the install
command) instead of a bare `ModuleNotFoundError`. `require_sm100(device)` is the device twin of
that gate: it runs before anything is compiled or launched.

Importing this package imports neither cutlass nor triton; only `require_cute_dsl` does.
"""

import functools
import importlib

import torch

from ...backends import UnavailableError

INSTALL_COMMAND = 'pip install "torch_msa[msa,cute]"'
CUTE_DSL_MODULES = ("cutlass", "cuda.bindings.driver")
SM100_CAPABILITY = (10, 0)


def require_cute_dsl() -> None:
    """Import the CuTe DSL toolchain, or explain what to install.

    Raises:
        UnavailableError: if `cutlass` (nvidia-cutlass-dsl) or `cuda.bindings.driver`
            (cuda-bindings) cannot be imported; the message names every missing module and the
            install command.
    """
    missing = []
    for name in CUTE_DSL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as error:
            missing.append(f"{name} ({error})")
    if missing:
        raise UnavailableError(
            "the SM100 MSA kernels need the CuTe DSL (nvidia-cutlass-dsl==4.6.2) and cuda-bindings; "
            f"cannot import {', '.join(missing)}. Install them with: {INSTALL_COMMAND}"
        )


def _cuda_index(device: torch.device | str | int) -> int:
    """The explicit index of a CUDA device; a bare `cuda` means the current device."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


# Memoized per device index: a device's capability and SM count never change, and the backend
# asks for them on every op call (`get_device_capability` alone costs about 1.6 us).
@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


@functools.cache
def _sm_count_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_capability(device: torch.device | str | int) -> tuple[int, int]:
    """The `(major, minor)` compute capability of a CUDA device, looked up once per device."""
    return _capability_of(_cuda_index(device))


def sm_count(device: torch.device | str | int) -> int:
    """The number of streaming multiprocessors of a CUDA device, looked up once per device."""
    return _sm_count_of(_cuda_index(device))


def require_sm100(device: torch.device | str | int) -> None:
    """Refuse, before compiling or launching anything, a device the SM100 kernels are not built for.

    Raises:
        NotImplementedError: unless `device` is a CUDA device of compute capability 10.0
            (B200 / GB200); the message names the device and what it is.
    """
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type != "cuda":
        raise NotImplementedError(
            f"the SM100 MSA kernels need a CUDA device of compute capability 10.0; got a {resolved.type} device ({resolved})"
        )
    capability = sm_capability(resolved)
    if capability != SM100_CAPABILITY:
        raise NotImplementedError(
            "the SM100 MSA kernels need compute capability 10.0 (they are built for sm_100a); "
            f"{resolved} has compute capability {capability[0]}.{capability[1]}"
        )
