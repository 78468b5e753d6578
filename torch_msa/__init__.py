"""torch_msa: MiniMax Sparse Attention as `torch.ops.msa.*` custom ops.

`import torch_msa` registers the ops with their reference kernels, fake kernels and autograd;
it imports neither triton nor cutlass (optional backends bind on first use).
"""

from . import ops  # noqa: F401  (registers torch.ops.msa.*)
from .api import msa_attention, select_blocks, sparse_attention, validate_inputs
from .backends import BACKEND_ENV, Backend, BackendError, UnsupportedInputs, register_backend, resolve
from .validation import DEBUG_ENV

__version__ = "0.1.0"

__all__ = [
    "BACKEND_ENV",
    "DEBUG_ENV",
    "Backend",
    "BackendError",
    "UnsupportedInputs",
    "msa_attention",
    "register_backend",
    "resolve",
    "select_blocks",
    "sparse_attention",
    "validate_inputs",
]
