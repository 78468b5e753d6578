"""torch_msa: MiniMax Sparse Attention as `torch.ops.msa.*` custom ops.

`import torch_msa` registers the ops with their reference kernels, fake kernels and autograd; it
imports neither triton, cutlass nor transformers (backends bind on first use).
"""

from . import (
    integrations,
    ops,  # noqa: F401  (registers torch.ops.msa.*)
)
from .api import (
    AttentionOutput,
    MSAAttentionOutput,
    MSABlocksIndexLossOutput,
    MSABlocksOutput,
    MSAIndexLossOutput,
    MSALseBlocksOutput,
    MSALseIndexLossOutput,
    MSAResult,
    build_plan,
    indexer_kl_loss,
    indexer_kl_loss_dense,
    msa_attention,
    select_blocks,
    sparse_attention,
    validate_inputs,
)
from .backends import BACKEND_ENV, Backend, BackendError, UnavailableError, UnsupportedInputs, register_backend, resolve
from .diagnostics import TorchMSAWarning
from .padding import check_padding_mask, pad_input, padded_cu_seqlens, unpad_input
from .validation import DEBUG_ENV

# HF's attn_implementation="torch_msa", now or through an import hook (never imports transformers).
integrations.register_with_transformers()

__version__ = "0.1.0"

__all__ = [
    "BACKEND_ENV",
    "DEBUG_ENV",
    "AttentionOutput",
    "Backend",
    "BackendError",
    "MSAAttentionOutput",
    "MSABlocksIndexLossOutput",
    "MSABlocksOutput",
    "MSAIndexLossOutput",
    "MSALseBlocksOutput",
    "MSALseIndexLossOutput",
    "MSAResult",
    "UnavailableError",
    "TorchMSAWarning",
    "UnsupportedInputs",
    "build_plan",
    "check_padding_mask",
    "indexer_kl_loss",
    "indexer_kl_loss_dense",
    "msa_attention",
    "pad_input",
    "padded_cu_seqlens",
    "register_backend",
    "resolve",
    "select_blocks",
    "sparse_attention",
    "unpad_input",
    "validate_inputs",
]
