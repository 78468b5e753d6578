"""`msa::backward_with_index_loss` composed of the separate ops: the attention backward, then the
index branch's KL loss and its backward.

A backend whose attention backward cannot emit the KL's teacher serves the fused op this way;
the teacher is then recomputed by the KL loss's own pass over the selected keys (`Q K^T` for every
query head). The `sm90` backend fuses instead: its backward kernel writes the teacher where it
recomputes `P` (`torch_msa/sm90/index_loss.py`).
"""

from collections.abc import Callable

from . import backends
from .documents import Documents


def by_registry(op: str) -> Callable:
    """`msa::op`'s implementation as the registry serves it on its inputs' device (the second
    argument's for the KL backward, the first's otherwise)."""
    anchor = 1 if op == "indexer_kl_backward" else 0
    return lambda *args: backends.call(op, args[anchor].device, *args)


def separate(backward: Callable, indexer_kl: Callable, indexer_kl_backward: Callable, grad_out, grad_loss, q, k, v,
             out, lse, index_q, index_k, block_indices, documents: Documents, block_size, softmax_scale,
             index_softmax_scale, grad_lse=None, plan=None):
    """`(dq, dk, dv, d_index_q, d_index_k, loss)`: `backward`, `indexer_kl` and
    `indexer_kl_backward` (implementations of those ops, in the backends' form) one after another;
    the KL's teacher is `q`, `k` and the attention's `lse`, constants of the loss."""
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse,
                          plan)
    loss, _, index_lse, mass, teacher_index_keys, teacher_index_queries = indexer_kl(
        q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale, index_softmax_scale)
    d_index_q, d_index_k = indexer_kl_backward(grad_loss, index_q, index_k, index_lse, mass, teacher_index_keys,
                                               teacher_index_queries, block_indices, documents, block_size,
                                               index_softmax_scale)
    return dq, dk, dv, d_index_q, d_index_k, loss
