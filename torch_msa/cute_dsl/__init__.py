"""What the CuTe DSL kernels (`torch_msa.sm90`, `torch_msa.sm100`) share: the served CuTe DSL range,
`require_cute_dsl`, memoized device facts, and `cute_io`, `ptx`, `token_tiles`, `compat`. Named
`cute_dsl` so as not to be confused with `cutlass.cute`.
"""

import functools
import importlib
import importlib.util
import re

import torch

from ..backends import UnavailableError

CUTE_DSL_DISTRIBUTION = "nvidia-cutlass-dsl"
OLDEST_CUTE_DSL = (4, 6, 2)
"""The oldest CuTe DSL release served (CI compiles the kernels with it)."""
FIRST_UNSERVED_CUTE_DSL = (4, 9)
"""The first CuTe DSL release past the served range."""
CUTE_DSL_REQUIREMENT = (
    f"{CUTE_DSL_DISTRIBUTION}>={'.'.join(map(str, OLDEST_CUTE_DSL))},<{'.'.join(map(str, FIRST_UNSERVED_CUTE_DSL))}"
)
"""The served range as a requirement (the string in pyproject.toml's `cute` and `test` extras)."""
INSTALL_COMMAND = ('pip install ".[cute]" in the torch_msa checkout '
                   f'(or: pip install "{CUTE_DSL_REQUIREMENT}" cuda-bindings "apache-tvm-ffi>=0.1.11,<0.2")')
CUTE_DSL_MODULES = ("cutlass", "cuda.bindings.driver", "tvm_ffi")
"""The DSL, its CUDA driver bindings and apache-tvm-ffi (every kernel is called through it)."""


def cute_dsl_version_served(version: str) -> bool:
    """Whether a `nvidia-cutlass-dsl` version (`"4.8.1"`, `"4.9.0rc1"`) lies in the served range; only
    the leading release numbers count.

    Raises:
        ValueError: `version` does not start with dotted release numbers.
    """
    release = re.match(r"\d+(\.\d+)*", version)
    if release is None:
        raise ValueError(f"version: expected a release such as '4.8.1', got {version!r}")
    numbers = tuple(int(part) for part in release.group().split("."))
    return OLDEST_CUTE_DSL <= numbers < FIRST_UNSERVED_CUTE_DSL


def require_cute_dsl() -> None:
    """Import the CuTe DSL toolchain, or explain what to install.

    Raises:
        UnavailableError: a module of `CUTE_DSL_MODULES` cannot be imported; the message names
            each missing one and `INSTALL_COMMAND`.
    """
    missing = []
    for name in CUTE_DSL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as error:
            missing.append(f"{name} ({error})")
    if missing:
        raise UnavailableError(
            f"the CuTe DSL MSA kernels need the CuTe DSL ({CUTE_DSL_REQUIREMENT}), cuda-bindings and apache-tvm-ffi; "
            f"cannot import {', '.join(missing)}. Install them with: {INSTALL_COMMAND}"
        )


def importable(name: str) -> bool:
    """Whether module `name` can be found, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def device_unavailable_reason(device: torch.device, capability: tuple[int, int], who_needs: str, gpus: str,
                              modules: tuple[str, ...], install_hint: str) -> str | None:
    """Why a CuTe backend cannot serve `device` (not CUDA, no device, not `capability`, `modules`
    missing), or None; `who_needs`, `gpus` and `install_hint` word the message."""
    if device.type != "cuda":
        return f"it serves CUDA devices only, not {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    actual = sm_capability(device)
    if actual != capability:
        return (f"{device} has compute capability {actual[0]}.{actual[1]}; {who_needs} "
                f"{capability[0]}.{capability[1]} ({gpus})")
    missing = [name for name in modules if not importable(name)]
    if missing:
        return f"cannot find {', '.join(missing)}; {install_hint}"
    return None


def _cuda_index(device: torch.device | str | int) -> int:
    """The explicit index of a CUDA device; a bare `cuda` means the current device."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


# Memoized per device index: they never change, and the backends ask on every op call.
@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


@functools.cache
def _sm_count_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_capability(device: torch.device | str | int) -> tuple[int, int]:
    """The `(major, minor)` compute capability of a CUDA device."""
    return _capability_of(_cuda_index(device))


def sm_count(device: torch.device | str | int) -> int:
    """The number of streaming multiprocessors of a CUDA device."""
    return _sm_count_of(_cuda_index(device))
