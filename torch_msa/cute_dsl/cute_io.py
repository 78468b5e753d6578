"""How torch tensors reach the CuTe DSL kernels: compiled for TVM-FFI (`compile_kernel`), called
through `launcher` with torch tensors (or `None`) and scalars in compiled order, on torch's current
stream. Tensors are contiguous rows with a dynamic leading extent (`fake_rows`); each call checks
them against their descriptions (`ValueError`; `TypeError` for a tensor/`None` mismatch or a wrong
argument count) but does not relate operands' leading extents: the host code sizes those.
"""

import math

import torch

from ..diagnostics import logger

ACCESS_BYTES = 16  # one vectorised global access (128 bits)


def cutlass_dtype(dtype: torch.dtype):
    """The CuTe DSL numeric type of a torch dtype (`TypeError` for another)."""
    import cutlass

    types = {
        torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32, torch.int64: cutlass.Int64,
    }
    if dtype not in types:
        raise TypeError(f"dtype: expected one of {list(types)}, got {dtype}")
    return types[dtype]


def row_alignment(dtype: torch.dtype, inner: tuple[int, ...]) -> int:
    """Bytes the base pointer (and so every row) of a rows tensor is assumed aligned to."""
    return math.gcd(ACCESS_BYTES, math.prod(inner) * dtype.itemsize) if inner else dtype.itemsize


def fake_rows(dtype: torch.dtype, inner: tuple[int, ...] = ()):
    """Compile-time stand-in of a contiguous `[N, *inner]` tensor with dynamic `N`."""
    import cutlass.cute as cute

    shape = (cute.sym_int(), *inner)
    return cute.runtime.make_fake_compact_tensor(
        cutlass_dtype(dtype), shape, stride_order=tuple(reversed(range(len(shape)))),
        assumed_align=row_alignment(dtype, inner),
    )


def aligned_operand(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied only if it is not contiguous or its storage is not 16-byte aligned."""
    if tensor.is_contiguous() and tensor.data_ptr() % ACCESS_BYTES == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def compile_options(arch: str | None, dump_dir: str | None, listings: bool = False) -> str:
    """`cute.compile` options: TVM-FFI, `arch` (None: this GPU), the cubin (with `listings` PTX and
    SASS) kept in `dump_dir`. Logs the compile (INFO): it takes seconds.

    Raises:
        ValueError: `listings` without `dump_dir`.
    """
    logger.info("compiling a CuTe DSL kernel for %s (once per process and shape)", arch or "this GPU")
    options = ["--enable-tvm-ffi"]
    if arch is not None:
        options.append(f"--gpu-arch {arch}")
    if dump_dir is not None:
        options.append(f"--keep-cubin --dump-dir {dump_dir}")
    if listings:
        if dump_dir is None:
            raise ValueError("listings: needs a dump_dir to write the PTX and SASS to")
        options.append("--keep-ptx --keep-sass")
    return " ".join(options)


def compile_kernel(kernel, *args, arch: str | None = None, dump_dir: str | None = None, listings: bool = False):
    """`cute.compile` the host function `kernel` for `args` (fakes and scalars for every parameter
    but its last, the stream, which becomes torch's current one). Returns the compiled function;
    launch it through `launcher`."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(kernel, *args, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=compile_options(arch, dump_dir, listings))


def launcher(compiled):
    """`compiled`'s TVM-FFI function (positional arguments, without the CuTe DSL's Python wrapper)."""
    import tvm_ffi

    return compiled if isinstance(compiled, tvm_ffi.Function) else compiled.__tvm_ffi_object__()


def check_index_tensor(name: str, tensor: torch.Tensor, dims: int, device: torch.device | None = None) -> None:
    """Check an int32 CUDA tensor of `dims` dims (on `device` when given).

    Raises:
        TypeError: not an int32 tensor of `dims` dims.
        ValueError: not on CUDA, or not on `device`.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32 or tensor.dim() != dims:
        got = f"{tensor.dtype} with {tensor.dim()} dims" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{name}: expected an int32 tensor with {dims} dims, got {got}")
    if tensor.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor (the SM100 kernels run on the GPU), got {tensor.device}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
