"""Bindings to the official MiniMax MSA kernels (at `common.OFFICIAL_MSA_REVISION`) and to our SM100 backward.

`kernels()` is the one place torch_msa reaches into the official package: on first call it
imports the official entry points and our backward, applies the two compatibility patches the
pinned revision needs (`_patch_fmax`, numerical; `_patch_jit_gencode`, build only; `README.md`)
and caches the bundle. `fmha_sm100.sparse` imports MSA's CuTe DSL sources as top-level modules
(`src.*`), so a same-named module elsewhere can shadow them: each patch refuses (`ImportError`)
to touch a module that is not MSA's own.
"""

import dataclasses
import functools
import importlib
import os
import re
import subprocess
import threading
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

from ..backends import UnavailableError
from ..cute_dsl import CUTE_DSL_DISTRIBUTION, CUTE_DSL_REQUIREMENT, cute_dsl_version_served, require_cute_dsl
from .common import INSTALL_COMMAND

OFFICIAL_PACKAGE = "fmha_sm100"
BACKWARD_MODULE = "torch_msa.sm100.backward_host"

_SPARSE_MODULE = "fmha_sm100.sparse"
_JIT_MODULE = "fmha_sm100.jit"
_UTILS_MODULE = "src.common.utils"
_UTILS_PATH_FROM_SPARSE_DIR = Path("cute", "src", "common", "utils.py")
_SM103A_TARGET = "-gencode=arch=compute_103a,code=sm_103a"
_MIN_SM103A_NVCC = (12, 9)

# Set on a patched callable, so a second call recognises its own work.
_PATCH_MARKER = "__torch_msa_compat_patch__"


@dataclasses.dataclass(frozen=True, slots=True)
class MSAKernels:
    """The launchers the SM100 backend calls: the official key-to-query CSR builder and flat sparse
    forward (`fmha_sm100.sparse`), and our `backward_host.run_backward`."""

    build_k2q_csr: Callable[..., Any]
    sparse_atten_func: Callable[..., Any]
    run_backward: Callable[..., Any]


_bundle: MSAKernels | None = None
_bind_lock = threading.Lock()


def kernels() -> MSAKernels:
    """Bind the launchers once per process, patching the official package on the way.

    Raises:
        UnavailableError: the official package, the CuTe DSL or cuda-bindings is missing, or
            the installed CuTe DSL lies outside the served range (`CUTE_DSL_REQUIREMENT`); the
            message names the install steps (`common.INSTALL_COMMAND`).
        ImportError: a module a patch must own (`fmha_sm100.jit`, MSA's `src.common.utils`) is
            shadowed by a foreign one, or our backward module is missing from this install.
    """
    global _bundle
    if _bundle is None:
        with _bind_lock:
            if _bundle is None:
                _bundle = _bind()
    return _bundle


def _bind() -> MSAKernels:
    _require_cute_dsl_version()
    require_cute_dsl()
    sparse, jit = _import_official()
    entry_points = {name: _entry_point(sparse, name) for name in ("build_k2q_csr", "sparse_atten_func")}
    run_backward = _import_backward()
    _patch_fmax(sparse)
    _patch_jit_gencode(jit)
    return MSAKernels(run_backward=run_backward, **entry_points)


def _require_cute_dsl_version() -> None:
    try:
        installed = metadata.version(CUTE_DSL_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise UnavailableError(
            f"the SM100 MSA backend needs {CUTE_DSL_REQUIREMENT}, which is not installed. "
            f"Install it with: {INSTALL_COMMAND}"
        ) from None
    try:
        served = cute_dsl_version_served(installed)
    except ValueError:
        served = False
    if not served:
        raise UnavailableError(
            f"the SM100 MSA backend needs {CUTE_DSL_REQUIREMENT} (the fmax compatibility patch for the pinned MSA "
            f"revision is tested at both ends of that range); found {CUTE_DSL_DISTRIBUTION} {installed}. "
            f"Install it with: {INSTALL_COMMAND}"
        )


def _import_official() -> tuple[ModuleType, ModuleType]:
    """`(fmha_sm100.sparse, fmha_sm100.jit)`; an ImportError inside them means the extras are incomplete."""
    try:
        importlib.import_module(OFFICIAL_PACKAGE)
        return importlib.import_module(_SPARSE_MODULE), importlib.import_module(_JIT_MODULE)
    except ImportError as error:
        raise UnavailableError(
            f"the SM100 MSA backend needs the official MiniMax MSA package ({OFFICIAL_PACKAGE}, at the revision below) "
            f"with its dependencies; importing it failed: {error}. Install it with: {INSTALL_COMMAND}"
        ) from error


def _entry_point(module: ModuleType, name: str) -> Callable[..., Any]:
    function = getattr(module, name, None)
    if not callable(function):
        raise UnavailableError(
            f"the installed {module.__name__} has no {name}(): it is not the MSA revision torch_msa is written for. "
            f"Install the pinned one with: {INSTALL_COMMAND}"
        )
    return function


def _import_backward() -> Callable[..., Any]:
    try:
        module = importlib.import_module(BACKWARD_MODULE)
    except ModuleNotFoundError as error:
        if error.name == BACKWARD_MODULE:
            raise ImportError(f"{BACKWARD_MODULE} is missing from this torch_msa install; reinstall torch_msa") from error
        raise UnavailableError(
            f"the SM100 MSA backward needs {error.name}, which is not installed. Install it with: {INSTALL_COMMAND}"
        ) from error
    run_backward = getattr(module, "run_backward", None)
    if not callable(run_backward):
        raise ImportError(f"{BACKWARD_MODULE} defines no run_backward(); this torch_msa install is broken")
    return run_backward


def _is_patched(function: object) -> bool:
    return getattr(function, _PATCH_MARKER, False) is True


# --- numerical patch -------------------------------------------------------------------------


def _msa_utils(sparse_module: ModuleType) -> ModuleType:
    """MSA's own `src.common.utils`, proven by its file lying where the pinned layout puts it."""
    sparse_file = getattr(sparse_module, "__file__", None)
    if getattr(sparse_module, "__name__", None) != _SPARSE_MODULE or not sparse_file:
        raise ImportError(f"the fmax compatibility patch needs MSA's own {_SPARSE_MODULE} module, got {sparse_module!r}")
    expected = Path(sparse_file).resolve().parent / _UTILS_PATH_FROM_SPARSE_DIR
    try:
        utils = importlib.import_module(_UTILS_MODULE)
    except ImportError as error:
        raise ImportError(
            f"the fmax compatibility patch needs MSA's own {_UTILS_MODULE} ({expected}), which cannot be imported "
            f"({error}); another top-level `src` package may be shadowing MSA's"
        ) from error
    location = getattr(utils, "__file__", None)
    if getattr(utils, "__name__", None) != _UTILS_MODULE or location is None or Path(location).resolve() != expected:
        raise ImportError(
            f"the fmax compatibility patch refuses to touch {_UTILS_MODULE} from {location}: MSA's own is {expected}. "
            "Another top-level `src` package is shadowing MSA's; rename or uninstall it"
        )
    for name in ("fmax", "dsl_user_op", "Float32", "nvvm"):
        if not hasattr(utils, name):
            raise ImportError(f"MSA's {_UTILS_MODULE} ({expected}) has no {name}: not the layout of the pinned revision")
    return utils


def _patch_fmax(sparse_module: ModuleType) -> None:
    """Rebind MSA's scalar `fmax` helper to the served CuTe DSL's `nvvm.fmax(a, b, *, c=None)`, once.

    The replacement keeps the helper's contract (fp32 operands and result, optional third operand,
    `loc`/`ip`, `dsl_user_op`). MSA's softmax code looks the helper up through the module, so
    rebinding the attribute reaches every caller without touching installed files.

    Raises:
        ImportError: `sparse_module` is not `fmha_sm100.sparse`, or `src.common.utils` is not
            the file of that package (a foreign `src` shadows it).
    """
    utils = _msa_utils(sparse_module)
    if _is_patched(utils.fmax):
        return
    float32, nvvm = utils.Float32, utils.nvvm

    def fmax(a, b, c=None, *, loc=None, ip=None):
        """fp32 maximum of two or three operands through `nvvm.fmax(a, b, *, c=None)` (result type inferred)."""
        third = None if c is None else float32(c).ir_value(loc=loc, ip=ip)
        return float32(
            nvvm.fmax(
                float32(a).ir_value(loc=loc, ip=ip),
                float32(b).ir_value(loc=loc, ip=ip),
                c=third,
                loc=loc,
                ip=ip,
            )
        )

    patched = utils.dsl_user_op(fmax)
    setattr(patched, _PATCH_MARKER, True)
    setattr(utils, "fmax", patched)  # noqa: B010  (ModuleType declares no attributes to the type checker)


# --- build-only patch ------------------------------------------------------------------------


def _parse_nvcc_release(version_text: str) -> tuple[int, int]:
    """`(major, minor)` from `nvcc --version` output ("Cuda compilation tools, release 12.8, V12.8.93")."""
    found = re.search(r"release (\d+)\.(\d+)", version_text)
    if found is None:
        raise RuntimeError(f"cannot read the CUDA release from this `nvcc --version` output: {version_text!r}")
    return int(found.group(1)), int(found.group(2))


def _nvcc_release(cuda_home: str) -> tuple[int, int]:
    """The `(major, minor)` release of the nvcc MSA's JIT invokes (`<cuda_home>/bin/nvcc`)."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        result = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"MSA's JIT compiles with {nvcc}, which cannot be run ({error}); set CUDA_HOME") from error
    return _parse_nvcc_release(result.stdout)


def _without_sm103a(flags):
    """The nvcc flags (MSA joins them into one string) without the sm_103a target."""
    if isinstance(flags, str):
        return " ".join(flag for flag in flags.split(" ") if flag != _SM103A_TARGET)
    if isinstance(flags, (list, tuple)):
        return type(flags)(flag for flag in flags if flag != _SM103A_TARGET)
    return flags


def _patch_jit_gencode(jit_module: ModuleType) -> None:
    """Drop the sm_103a target from MSA's JIT flags whenever the local nvcc is older than 12.9.

    Wraps `fmha_sm100.jit._get_nvcc_flags`. nvcc is asked for its version only when MSA builds a
    kernel (once per CUDA home), so a host with a warm JIT cache and no nvcc still binds and runs.

    Raises:
        ImportError: `jit_module` is not MSA's own `fmha_sm100.jit` (wrong name, not a file of
            the imported `fmha_sm100` package, or without `_get_nvcc_flags`/`_get_cuda_home`).
    """
    _require_msa_jit(jit_module)
    original = jit_module._get_nvcc_flags
    if _is_patched(original):
        return
    releases: dict[str, tuple[int, int]] = {}

    @functools.wraps(original)
    def _get_nvcc_flags(*args, **kwargs):
        flags = original(*args, **kwargs)
        cuda_home = jit_module._get_cuda_home()
        if cuda_home not in releases:
            releases[cuda_home] = _nvcc_release(cuda_home)
        return flags if releases[cuda_home] >= _MIN_SM103A_NVCC else _without_sm103a(flags)

    setattr(_get_nvcc_flags, _PATCH_MARKER, True)
    setattr(jit_module, "_get_nvcc_flags", _get_nvcc_flags)  # noqa: B010  (as for fmax above)


def _require_msa_jit(jit_module: ModuleType) -> None:
    try:
        package = importlib.import_module(OFFICIAL_PACKAGE)
    except ImportError as error:
        raise ImportError(
            f"the sm_103a build patch needs the imported {OFFICIAL_PACKAGE} package to prove {_JIT_MODULE} is MSA's: {error}"
        ) from error
    package_file = getattr(package, "__file__", None)
    jit_file = getattr(jit_module, "__file__", None)
    owned = (
        getattr(jit_module, "__name__", None) == _JIT_MODULE
        and package_file is not None
        and jit_file is not None
        and Path(jit_file).resolve().parent == Path(package_file).resolve().parent
    )
    if not owned:
        raise ImportError(
            f"the sm_103a build patch refuses to touch {getattr(jit_module, '__name__', jit_module)!r} from {jit_file}: "
            f"it is not the jit module of the imported {OFFICIAL_PACKAGE} package ({package_file})"
        )
    for name in ("_get_nvcc_flags", "_get_cuda_home"):
        if not callable(getattr(jit_module, name, None)):
            raise ImportError(f"MSA's {_JIT_MODULE} ({jit_file}) has no {name}(): not the layout of the pinned revision")
