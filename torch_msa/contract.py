"""Facts of the MSA op contract shared by validation, fake kernels and every backend."""

import torch

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (64, 128)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPE = torch.int32  # block_indices and cu_seqlens

# MiniMax-M3 defaults of the public API.
DEFAULT_TOPK = 16
DEFAULT_BLOCK_SIZE = 128


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype, also the dtype of `lse`: fp64 for fp64 inputs, fp32 otherwise.

    fp64 inputs keep an fp64 `lse` so that gradient checks in fp64 stay exact.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32
