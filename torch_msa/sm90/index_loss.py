"""`msa::backward_with_index_loss` on Hopper: the backward kernel writes the index loss's teacher,
from which the loss and index gradients are formed without a second `Q K^T`.
"""

import torch

from ..index_loss import sparse, sparse_deterministic
from ..triton_utils.common import check_dtype_and_group
from . import backward_deterministic, backward_host


def backward_with_index_loss(grad_out, grad_loss, q, k, v, out, lse, index_q, index_k, block_indices, documents,
                             block_size, softmax_scale, index_softmax_scale, grad_lse=None, plan=None):
    """Same contract as `torch_msa.index_loss.separate`: `(dq, dk, dv, d_index_q, d_index_k, loss)`.

    Raises:
        UnsupportedInputs: attention or index inputs the kernels do not serve; nothing launched.
    """
    backward_host.check_inputs(grad_out, q, k, v, block_size)
    check_dtype_and_group("index_q", index_q.dtype)
    sparse.check_inputs(True, index_q)
    # Decided per call, like the backward's variant: the flag may change between steps.
    deterministic = torch.are_deterministic_algorithms_enabled()
    host = backward_deterministic if deterministic else backward_host
    loss_kernels = sparse_deterministic if deterministic else sparse
    teacher = backward_host.new_teacher(q.shape[0], k.shape[1], block_indices.shape[-1], q.device)
    with torch.cuda.device(q.device):
        dq, dk, dv = host.backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale,
                                   grad_lse, plan, teacher=teacher)
        loss, d_index_q, d_index_k = loss_kernels.index_loss_from_teacher(
            teacher, grad_loss, index_q, index_k, block_indices, documents, block_size, index_softmax_scale, plan)
    return dq, dk, dv, d_index_q, d_index_k, loss
