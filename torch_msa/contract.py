"""Facts of the MSA op contract shared by validation, fake kernels and every backend, and the
MiniMax-M3 configuration (`M3`) that the public API's defaults and the M3-only kernels derive from."""

import dataclasses

import torch

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_BLOCK_SIZES = (64, 128)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPE = torch.int32  # block_indices and cu_seqlens



@dataclasses.dataclass(frozen=True)
class Shape:
    """Head counts and block parameters of an MSA layer; the defaults are MiniMax-M3's."""

    query_heads: int = 64
    kv_heads: int = 4
    head_dim: int = 128
    index_dim: int = 128
    block_size: int = 128
    topk: int = 16

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.query_heads // self.kv_heads


M3 = Shape()  # MiniMax-M3's sparse layers

# The public API's defaults.
DEFAULT_TOPK = M3.topk
DEFAULT_BLOCK_SIZE = M3.block_size


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype, also `lse`'s: fp64 for fp64 inputs (exact fp64 gradient checks), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
