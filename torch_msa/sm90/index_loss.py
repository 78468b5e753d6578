"""`msa::backward_with_index_loss` on Hopper: the attention backward kernel writes the index
branch's KL teacher where it recomputes `P`, and the KL loss and its gradients are computed from
that teacher alone (no second `Q K^T`).

The teacher is fp16 `[Tq, Hkv, topk, 128]` (16 KiB per token at MiniMax-M3), written by
the backward kernel's `emit_teacher` variant (`backward_kernel.py`), default or deterministic;
the Triton kernels `torch_msa.triton.kl_kernel.index_loss_from_teacher` (or, under
`torch.use_deterministic_algorithms(True)`, `kl_deterministic.index_loss_from_teacher`) then form
the loss and the gradients of `index_q` and `index_k`. Index inputs those kernels do not serve
run the `sm90` backward and the registry's separate KL ops instead (`torch_msa/index_loss.py`).

Importing this module imports neither cutlass nor triton.
"""

import importlib

import torch

from ..backends import UnsupportedInputs
from ..index_loss import by_registry, separate
from ..triton import check_dtype_and_group


def backward_with_index_loss(grad_out, grad_loss, q, k, v, out, lse, index_q, index_k, block_indices, documents,
                             block_size, softmax_scale, index_softmax_scale, grad_lse=None, plan=None):
    """Same contract as `torch_msa.index_loss.separate`: `(dq, dk, dv, d_index_q, d_index_k, loss)`.

    Raises:
        UnsupportedInputs: the attention inputs are outside the `sm90` kernels' configuration
            (`torch_msa.sm90.backward_host.check_inputs`); nothing launched.
    """
    from ..triton.kl_kernel import check_inputs as check_kl_inputs
    from . import backward
    from .backward_host import check_inputs, new_teacher

    check_inputs(grad_out, q, k, v, block_size)
    # Decided per call, like the backward's variant: the flag may change between steps.
    deterministic = torch.are_deterministic_algorithms_enabled()
    host = importlib.import_module(f"{__package__}.{'backward_deterministic' if deterministic else 'backward_host'}")
    kl = importlib.import_module(f"torch_msa.triton.{'kl_deterministic' if deterministic else 'kl_kernel'}")
    try:
        check_dtype_and_group("index_q", index_q.dtype)
        check_kl_inputs(True, index_q)
    except UnsupportedInputs:
        return separate(backward, by_registry("indexer_kl"), by_registry("indexer_kl_backward"), grad_out, grad_loss,
                        q, k, v, out, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale,
                        index_softmax_scale, grad_lse, plan)
    teacher = new_teacher(q.shape[0], k.shape[1], block_indices.shape[-1], q.device)
    with torch.cuda.device(q.device):
        dq, dk, dv = host.backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale,
                                   grad_lse, plan, teacher=teacher)
        loss, d_index_q, d_index_k = kl.index_loss_from_teacher(teacher, grad_loss, index_q, index_k, block_indices,
                                                                documents, block_size, index_softmax_scale)
    return dq, dk, dv, d_index_q, d_index_k, loss
