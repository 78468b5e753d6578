"""Backward preprocess: `delta = rowsum(dO * O) - grad_lse` by a CuTe DSL kernel (`preprocess_kernel.py`).

`delta` is the softmax-backward correction, `dS = P * (dP - delta)`; folding `grad_lse` in here
leaves the main kernel unchanged when the loss also depends on `lse`.
"""

import functools

import torch

from ..cute_dsl import require_cute_dsl
from ..cute_dsl.cute_io import aligned_operand, compile_kernel, cutlass_dtype, fake_rows, launcher

SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def prepare_delta(out: torch.Tensor, grad_out: torch.Tensor, grad_lse: torch.Tensor | None = None) -> torch.Tensor:
    """`delta[t, h] = sum_d grad_out[t, h, d] * out[t, h, d] - grad_lse[t, h]` in fp32.

    The quantity of `torch_msa.stages.delta.compute_delta`, summed in another order.

    Args:
        out, grad_out: `[Tq, Hq, D]` on a CUDA device, one dtype of bf16, fp16, fp32.
        grad_lse: optional `[Tq, Hq]` gradient of the forward's lse (any float dtype; read as fp32).

    Returns:
        fp32 `[Tq, Hq]`.

    Raises:
        ValueError: a shape or device mismatch, or a device other than CUDA.
        TypeError: `grad_out`'s dtype is not `out`'s, or not one of `SERVED_DTYPES`.
    """
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise ValueError(f"out: expected a [Tq, Hq, D] tensor, got {getattr(out, 'shape', type(out).__name__)}")
    if not isinstance(grad_out, torch.Tensor) or grad_out.shape != out.shape:
        raise ValueError(f"grad_out: expected the shape of out {tuple(out.shape)}, got {tuple(getattr(grad_out, 'shape', ()))}")
    if out.dtype not in SERVED_DTYPES or grad_out.dtype != out.dtype:
        raise TypeError(f"grad_out: expected out's dtype, one of {SERVED_DTYPES}; got out {out.dtype}, grad_out {grad_out.dtype}")
    if out.device.type != "cuda" or grad_out.device != out.device:
        raise ValueError(f"out, grad_out: expected one CUDA device, got {out.device} and {grad_out.device}")
    num_queries, num_heads, head_dim = out.shape
    if grad_lse is not None:
        if grad_lse.shape != (num_queries, num_heads) or grad_lse.device != out.device or not grad_lse.is_floating_point():
            raise ValueError(
                f"grad_lse: expected a float tensor of shape {(num_queries, num_heads)} on {out.device}, "
                f"got {grad_lse.dtype} {tuple(grad_lse.shape)} on {grad_lse.device}"
            )
        grad_lse = aligned_operand(grad_lse.to(torch.float32))
    require_cute_dsl()
    delta = torch.empty(num_queries, num_heads, dtype=torch.float32, device=out.device)
    if delta.numel() == 0:
        return delta
    kernel = _compiled_delta_kernel(out.dtype, head_dim, grad_lse is not None)
    kernel(
        aligned_operand(out).view(-1, head_dim),
        aligned_operand(grad_out).view(-1, head_dim),
        None if grad_lse is None else grad_lse.view(-1),
        delta.view(-1),
    )
    return delta


def compile_for_target(arch: str, dump_dir: str | None = None) -> dict:
    """Compile the preprocess at the contract's shapes (bf16, D=128; with and without grad_lse)
    for `arch` (`"sm_90a"`, `"sm_100a"`); no GPU is needed. Returns name -> compiled kernel."""
    return {
        "delta": compile_delta_kernel(torch.bfloat16, 128, False, arch, dump_dir),
        "delta_grad_lse": compile_delta_kernel(torch.bfloat16, 128, True, arch, dump_dir),
    }


@functools.cache
def _compiled_delta_kernel(dtype: torch.dtype, head_dim: int, with_grad_lse: bool):
    return launcher(compile_delta_kernel(dtype, head_dim, with_grad_lse))


def compile_delta_kernel(
    dtype: torch.dtype, head_dim: int, with_grad_lse: bool, arch: str | None = None, dump_dir: str | None = None
):
    """Compile the delta kernel for `[rows, head_dim]` operands of `dtype` (`arch=None`: this GPU)."""
    require_cute_dsl()
    from .preprocess_kernel import DeltaKernel

    return compile_kernel(
        DeltaKernel(cutlass_dtype(dtype).width, head_dim), fake_rows(dtype, (head_dim,)), fake_rows(dtype, (head_dim,)),
        fake_rows(torch.float32) if with_grad_lse else None, fake_rows(torch.float32), arch=arch, dump_dir=dump_dir,
    )
