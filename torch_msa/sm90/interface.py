"""The SM90 backend's ops (`torch_msa.backends.Backend` form)."""

import torch

from ..query_windows import forward_in_windows
from ..stages import query_outer
from . import backward_deterministic, backward_host, forward_host, index_loss
from .common import check_served, runs_query_outer_by_default


def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan=None):
    with torch.cuda.device(q.device):
        block_indices, plan, window_arguments = query_outer.split_forward(
            q, block_indices, documents, k.shape[0], block_size, plan,
            check=lambda: check_served_with_query_outer(q, k, v, block_indices, block_size),
            by_default=runs_query_outer_by_default(q.device))
        return forward_in_windows(forward_host.forward, q, k, v, block_indices, documents, block_size, softmax_scale,
                                  plan, window_arguments=window_arguments)


def check_served_with_query_outer(q, k, v, block_indices, block_size) -> None:
    """Raises `UnsupportedInputs` for a call the forward with its query-outer part does not serve,
    before the part's groups are built."""
    check_served(q, k, v, block_size)
    forward_host.check_selection_entries(*block_indices.shape)


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None, plan=None):
    # Decided per call, like torch's own kernels: the flag may change between steps.
    module = backward_deterministic if torch.are_deterministic_algorithms_enabled() else backward_host
    with torch.cuda.device(q.device):
        return module.backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale,
                               grad_lse, plan)


backward_with_index_loss = index_loss.backward_with_index_loss
