"""How torch tensors reach the CuTe DSL kernels of torch_msa (the neutral preprocess, tasks and
postprocess kernels of this package, the SM100 backward, the SM90 forward and backward).

Every kernel is compiled for the CuTe DSL's TVM-FFI calling convention (`compile_kernel`), and
`launcher` gives the function to call at each launch: it takes torch tensors (`None` where the
kernel was compiled for `None`) and Python ints and floats, in the compiled order, and nothing
else. apache-tvm-ffi converts the tensors in C through torch's DLPack exchange API, so a launch
builds no Python object per tensor, and the kernel runs on the tensors' device, on torch's
current stream there (the stream is not an argument), so CUDA-graph capture records it.

Every tensor is passed as contiguous "rows": only the leading extent is dynamic, the inner
extents are compile-time constants, so the kernels know every stride and can use 16-byte
accesses. `fake_rows` describes such a tensor to `cute.compile`. At each call, before anything
launches, the compiled function checks every tensor against its description and raises a
`ValueError` naming the argument (a `TypeError` for a tensor where `None` was compiled, or the
reverse, or a wrong argument count): its dtype, rank and inner extents, strides of a contiguous
tensor (dimensions of extent 1 excepted), the base alignment `row_alignment` assumes, a leading
extent within int32, and one CUDA device for all of them; integer scalars must fit int32. It does
not relate the leading extents of different operands (each is a runtime value of its own): the
host code sizes those. cutlass is imported only inside the functions.
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


def aligned_operand(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied only if it is not contiguous or its storage is not 16-byte aligned."""
    if tensor.is_contiguous() and tensor.data_ptr() % ACCESS_BYTES == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def compile_options(arch: str | None, dump_dir: str | None, listings: bool = False) -> str:
    """`cute.compile` options: the TVM-FFI calling convention, a target other than this host's GPU,
    where to keep the cubin, and with `listings` the PTX and SASS next to it. Called once per
    compile, it says so on the `torch_msa` logger (INFO): a CuTe DSL compile takes seconds."""
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
    """`cute.compile` the host function `kernel` (whose last parameter is its stream) for `args`,
    fakes and scalars standing for every parameter but the stream, with `compile_options(arch,
    dump_dir, listings)`. The stream is compiled as the TVM-FFI environment's: the compiled
    function takes no stream and launches on torch's current one.

    Returns the compiled function (its `artifacts` hold the cubin); launch it through `launcher`.
    """
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    return cute.compile(kernel, *args, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=compile_options(arch, dump_dir, listings))


def launcher(compiled):
    """The function that launches `compiled` (from `compile_kernel`): its TVM-FFI function, which
    takes the arguments positionally, without the CuTe DSL's Python wrapper around it."""
    import tvm_ffi

    return compiled if isinstance(compiled, tvm_ffi.Function) else compiled.__tvm_ffi_object__()


def check_index_tensor(name: str, tensor: torch.Tensor, dims: int, device: torch.device | None = None) -> None:
    """Refuse anything but an int32 CUDA tensor of `dims` dims (on `device` when given)."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int32 or tensor.dim() != dims:
        got = f"{tensor.dtype} with {tensor.dim()} dims" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{name}: expected an int32 tensor with {dims} dims, got {got}")
    if tensor.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor (the SM100 kernels run on the GPU), got {tensor.device}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
