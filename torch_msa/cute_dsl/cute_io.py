"""How torch tensors reach the CuTe DSL kernels of torch_msa (the neutral preprocess, tasks and
postprocess kernels of this package, the SM100 backward, the SM90 forward).

Every tensor is passed as contiguous "rows": only the leading extent is dynamic, the inner extents
are compile-time constants, so the kernels know every stride and can use 16-byte accesses.
`fake_rows` describes such a tensor to `cute.compile`, `cute_rows` converts a real one at launch;
tests check that the two have the same type. cutlass is imported only inside the functions.
"""

import math

import torch

from ..diagnostics import logger

ACCESS_BYTES = 16  # one vectorised global access (128 bits)


def cutlass_dtype(dtype: torch.dtype):
    """The CuTe DSL numeric type of a torch dtype."""
    import cutlass

    types = {
        torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
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


def cute_rows(tensor: torch.Tensor):
    """A contiguous tensor as the CuTe argument `fake_rows(tensor.dtype, tensor.shape[1:])` describes."""
    from cutlass.cute.runtime import from_dlpack

    alignment = row_alignment(tensor.dtype, tuple(tensor.shape[1:]))
    if not tensor.is_contiguous() or tensor.data_ptr() % alignment:
        raise ValueError(f"expected a contiguous tensor aligned to {alignment} bytes, got strides {tensor.stride()}")
    return from_dlpack(tensor.detach(), assumed_align=alignment).mark_compact_shape_dynamic(
        mode=0, stride_order=tensor.dim_order()
    )


def aligned_operand(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied only if it is not contiguous or its storage is not 16-byte aligned."""
    if tensor.is_contiguous() and tensor.data_ptr() % ACCESS_BYTES == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def cute_stream(device: torch.device):
    """The CUstream of torch's current stream on `device`."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def compile_options(arch: str | None, dump_dir: str | None, listings: bool = False) -> str:
    """`cute.compile` options: a target other than this host's GPU, where to keep the cubin, and
    with `listings` the PTX and SASS next to it. Called once per compile, it says so on the
    `torch_msa` logger (INFO): a CuTe DSL compile takes seconds."""
    logger.info("compiling a CuTe DSL kernel for %s (once per process and shape)", arch or "this GPU")
    options = []
    if arch is not None:
        options.append(f"--gpu-arch {arch}")
    if dump_dir is not None:
        options.append(f"--keep-cubin --dump-dir {dump_dir}")
    if listings:
        if dump_dir is None:
            raise ValueError("listings: needs a dump_dir to write the PTX and SASS to")
        options.append("--keep-ptx --keep-sass")
    return " ".join(options)


def check_index_tensor(name: str, tensor: torch.Tensor, dims: int, device: torch.device | None = None) -> None:
    """Refuse anything but an int32 CUDA tensor of `dims` dims (on `device` when given)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32 or tensor.dim() != dims:
        got = f"{tensor.dtype} with {tensor.dim()} dims" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{name}: expected an int32 tensor with {dims} dims, got {got}")
    if tensor.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor (the SM100 kernels run on the GPU), got {tensor.device}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
