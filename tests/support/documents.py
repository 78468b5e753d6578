"""Test-side constructors of `torch_msa.documents.Documents` and of backend-form arguments."""

import torch

from torch_msa.documents import Documents
from torch_msa.ops import backend_arguments

__all__ = ["Documents", "backend_arguments", "documents_of"]


def documents_of(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, fragment_documents=None,
                 fragment_starts=None) -> Documents:
    """The documents of these boundaries, with their longest lengths as `max_seqlen_*` (a host sync)."""
    longest = [int(cu.diff().max()) if cu.numel() > 1 else 0 for cu in (cu_seqlens_q, cu_seqlens_k)]
    return Documents(cu_seqlens_q, cu_seqlens_k, *longest, fragment_documents, fragment_starts)
