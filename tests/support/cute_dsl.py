"""What the CuTe DSL tests share: the skip marker (the `cute` extra; CI installs it with `test`),
the nvdisasm check of the SASS listings, the warning filter of the compile tests, arguments for a
compiled kernel's argument checks on any host, the guard against Python tensor conversions at
launch, and the import-hygiene check."""

import contextlib
import subprocess
import sys
import warnings

import pytest
import torch

from torch_msa import UnavailableError


def cute_dsl_unavailable_reason() -> str | None:
    """Why the CuTe DSL toolchain cannot be imported (each module that fails, with its error, and
    the install command), or None when it can."""
    from torch_msa.cute_dsl import require_cute_dsl

    try:
        require_cute_dsl()
    except UnavailableError as error:
        return str(error)
    return None


_CUTE_DSL_UNAVAILABLE = cute_dsl_unavailable_reason()
requires_cute = pytest.mark.skipif(_CUTE_DSL_UNAVAILABLE is not None, reason=str(_CUTE_DSL_UNAVAILABLE))

SASS_INSTALL_HINT = 'pip install "nvidia-cutlass-dsl-libs-base[sass]"'
"""What brings nvdisasm from CuTe DSL 4.8 on (the `test` extra installs it); earlier releases depend on it."""


def skip_without_nvdisasm() -> None:
    """Skip the calling test or fixture, naming `SASS_INSTALL_HINT`, when the CuTe DSL finds no
    nvdisasm: a compile that keeps its listings writes the SASS with it and fails without it.

    The question goes to the DSL's own lookup (`cutlass.base_dsl.env_manager._find_nvdisasm_binary`,
    in every served release), so the answer is the one the compile will get."""
    from cutlass.base_dsl.common import DSLUserCodeError
    from cutlass.base_dsl.env_manager import _find_nvdisasm_binary

    try:
        _find_nvdisasm_binary()
    except DSLUserCodeError:
        pytest.skip(f"the SASS listings need nvdisasm, which the CuTe DSL cannot find; install it with: {SASS_INSTALL_HINT}")


@contextlib.contextmanager
def deprecated_dsl_use_is_an_error():
    """Within the block, a DeprecationWarning attributed to a torch_msa module raises: what a
    deprecated CuTe DSL name warns where torch_msa's code uses it, which users would otherwise see
    at every first compile."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=DeprecationWarning, module=r"torch_msa\.")
        yield


def device_argument(tensor: torch.Tensor):
    """`tensor` as a CUDA argument of a compiled CuTe kernel: a copy on the GPU where there is one
    (of its whole storage, so that its strides and storage offset, and with them its alignment,
    stay those of `tensor`), else a `tvm_ffi.Tensor` over its host memory that says it is on cuda:0.

    A compiled kernel checks every argument against its compiled description (dtype, rank,
    extents, strides, alignment, device) before it touches the GPU, so without one such tensors
    exercise those checks. Never pass a set that passes them all: the launch needs a GPU.
    """
    if tensor.is_cuda:
        return tensor
    if torch.cuda.is_available():
        elements = tensor.untyped_storage().nbytes() // tensor.element_size()
        storage = torch.empty(elements, dtype=tensor.dtype).set_(tensor.untyped_storage(), 0, (elements,), (1,))
        return storage.cuda().as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    import ctypes

    import tvm_ffi

    class DLDevice(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DLTensorHead(ctypes.Structure):  # the first fields of DLPack's DLTensor
        _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice)]

    capsule = torch.utils.dlpack.to_dlpack(tensor)
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    head = DLTensorHead.from_address(get_pointer(capsule, b"dltensor"))  # a DLManagedTensor starts with its DLTensor
    head.device = DLDevice(2, 0)  # kDLCUDA, device 0
    return tvm_ffi.from_dlpack(capsule)


def forbid_python_conversions(monkeypatch) -> None:
    """Make `cutlass.cute.runtime.from_dlpack` fail for the rest of the test: the launches pass
    torch tensors to the compiled kernels unconverted (`torch_msa/cute_dsl/cute_io.py`)."""
    import cutlass.cute.runtime as runtime

    def from_dlpack(*args, **kwargs):
        raise AssertionError("a launch converted a tensor with cutlass.cute.runtime.from_dlpack")

    monkeypatch.setattr(runtime, "from_dlpack", from_dlpack)


def assert_refused(function, args, position: int, message: str) -> None:
    """`function(*args)` (a compiled kernel's launcher) raises, before any launch, a ValueError or
    TypeError for argument `position` whose message contains `message`."""
    with pytest.raises((ValueError, TypeError)) as caught:
        function(*args)
    assert f"argument #{position} " in str(caught.value) and message in str(caught.value), str(caught.value)


def assert_imports_without(statements: str, forbidden: tuple[str, ...]) -> None:
    """`statements` run in a fresh interpreter import none of the `forbidden` modules."""
    checks = "".join(f"assert {name!r} not in sys.modules, 'the import loaded {name}'\n" for name in forbidden)
    code = f"import sys\n{statements}\n{checks}print('ok')\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
