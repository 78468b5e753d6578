"""What the Triton kernels share: which inputs they serve and how their GEMMs round."""

import torch

from ..backends import UnsupportedInputs

SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_served(name: str, dtype: torch.dtype, group_size: int = 1) -> None:
    """Decline, before any launch, inputs the Triton kernels do not handle."""
    if dtype not in SERVED_DTYPES:
        raise UnsupportedInputs(f"{name} dtype {dtype} (the Triton kernels take bf16, fp16 or fp32)")
    if group_size > 128:
        raise UnsupportedInputs(f"Hq / Hkv = {group_size} query heads per KV head (the Triton kernels take at most 128)")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), not TF32, so they match the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"
