"""What the CuTe DSL kernels of torch_msa (`torch_msa.sm90`, `torch_msa.sm100`) share.

* `require_cute_dsl()`: every host module calls it before it imports a kernel module (a
  `*_kernel.py`, which imports cutlass at the top), so a host without the extras gets
  torch_msa's `UnavailableError` (naming the install command) instead of a bare
  `ModuleNotFoundError`.
* `sm_capability(device)`, `sm_count(device)`: memoized device facts the backends ask per call.
* `cute_io`: how torch tensors reach the kernels: fake compile-time tensors, the compile for the
  TVM-FFI calling convention (torch tensors in, torch's current stream) and its launcher.
* The architecture-neutral kernels of the backward pipeline: `preprocess` (delta), `task_tables` (task
  tables and the aligned K/V workspace), `postprocess` (gradient cast and un-align), each a host
  module (checks, launch, compile cache) whose kernel classes are in `preprocess_kernel`,
  `task_tables_kernel`, `postprocess_kernel`. They compile for sm_90a and sm_100a alike.
* `ptx`: inline-PTX reductions the kernel modules share.
* `token_tiles`: the token boxes and slots by which the SM90 and SM100 kernels load a query-side
  operand tile one token at a time.
* `compat`: the CuTe DSL names that moved inside the served version range
  (`CUTE_DSL_REQUIREMENT`); the kernel modules import them from there.

The package is named `cute_dsl`, not `cute`, so that it is never confused with `cutlass.cute`,
which the kernel modules import as `cute`. Importing it imports neither cutlass nor triton; only
`require_cute_dsl` does.
"""

import functools
import importlib
import importlib.util
import re

import torch

from ..backends import UnavailableError

CUTE_DSL_DISTRIBUTION = "nvidia-cutlass-dsl"
OLDEST_CUTE_DSL = (4, 6, 2)
"""The oldest CuTe DSL release the kernels are built and tested for (CI compiles them with it)."""
FIRST_UNSERVED_CUTE_DSL = (4, 9)
"""The first CuTe DSL release past the served range; the newest below it is what `pip install` picks."""
CUTE_DSL_REQUIREMENT = (
    f"{CUTE_DSL_DISTRIBUTION}>={'.'.join(map(str, OLDEST_CUTE_DSL))},<{'.'.join(map(str, FIRST_UNSERVED_CUTE_DSL))}"
)
"""The served range as a requirement; the `cute` and `test` extras of pyproject.toml carry this string."""
INSTALL_COMMAND = ('pip install ".[cute]" in the torch_msa checkout '
                   f'(or: pip install "{CUTE_DSL_REQUIREMENT}" cuda-bindings "apache-tvm-ffi>=0.1.11,<0.2")')
"""How to install the CuTe DSL: the `cute` extra of a checkout, or its three packages by name."""
CUTE_DSL_MODULES = ("cutlass", "cuda.bindings.driver", "tvm_ffi")
"""What the CuTe DSL kernels import: the DSL, its CUDA driver bindings, and apache-tvm-ffi, through
which every kernel is called (`cute_io`)."""


def cute_dsl_version_served(version: str) -> bool:
    """Whether a `nvidia-cutlass-dsl` version string (`"4.8.1"`, `"4.9.0rc1"`) lies in the served range.

    Only the leading release numbers count, so a pre-release of the first unserved version is
    outside the range and a post-release of the oldest inside it.

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
        UnavailableError: if `cutlass` (nvidia-cutlass-dsl), `cuda.bindings.driver`
            (cuda-bindings) or `tvm_ffi` (apache-tvm-ffi) cannot be imported; the message names
            every missing module and the install command.
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
    """Whether module `name` can be found, without importing it (nothing heavy is loaded)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def device_unavailable_reason(device: torch.device, capability: tuple[int, int], who_needs: str, gpus: str,
                              modules: tuple[str, ...], install_hint: str) -> str | None:
    """Why a CuTe backend cannot serve `device`, or None: not CUDA, no CUDA device, another compute
    capability than `capability` (`who_needs` it, e.g. 'the SM100 kernels need'; `gpus` have it),
    or `modules` missing (then `install_hint`, e.g. 'install the CuTe DSL: pip install ...')."""
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
