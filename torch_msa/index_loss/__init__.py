"""How a call serves the index loss (`README.md`), and its Triton kernels."""

import functools
import inspect
from collections.abc import Callable

import torch

from .. import backends
from ..contract import compute_dtype
from ..documents import Documents

FUSED_OP = "backward_with_index_loss"


def by_registry(op: str) -> Callable:
    """`msa::op` as the registry serves it on its inputs' device (the second argument's for
    `indexer_kl_backward`, the first's otherwise), called as `(*args, plan=None)`: `plan`, the
    step's plan for these arguments, goes to an implementation that takes a `plan` keyword."""
    anchor = 1 if op == "indexer_kl_backward" else 0

    def served(*args, plan=None):
        return backends.call(op, args[anchor].device, *args,
                             implementation=lambda backend: _walking(backend.implementation(op), plan))

    return served


def _takes_plan(implementation: Callable) -> bool:
    try:
        parameter = inspect.signature(implementation).parameters.get("plan")
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return False
    return parameter is not None and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)


def _walking(implementation: Callable, plan) -> Callable:
    if plan is None or not _takes_plan(implementation):
        return implementation
    return functools.partial(implementation, plan=plan)


def separate(backward: Callable, indexer_kl: Callable, indexer_kl_backward: Callable, grad_out, grad_loss, q, k, v,
             out, lse, index_q, index_k, block_indices, documents: Documents, block_size, softmax_scale,
             index_softmax_scale, grad_lse=None, plan=None):
    """`(dq, dk, dv, d_index_q, d_index_k, loss)`: `backward`, `indexer_kl` and
    `indexer_kl_backward` (those ops in the backends' form, the loss's as `by_registry` makes them)
    in turn, each given `plan`; the index loss's teacher (`q`, `k`, the attention's `lse`) is a
    constant of the loss."""
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse,
                          plan)
    loss, _, index_lse, mass, teacher_index_keys, teacher_index_queries = indexer_kl(
        q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale, index_softmax_scale,
        plan=plan)
    d_index_q, d_index_k = indexer_kl_backward(grad_loss, index_q, index_k, index_lse, mass, teacher_index_keys,
                                               teacher_index_queries, block_indices, documents, block_size,
                                               index_softmax_scale, plan=plan)
    return dq, dk, dv, d_index_q, d_index_k, loss


def _served_by(backend: backends.Backend) -> Callable:
    """`backend`'s `msa::backward_with_index_loss`: its fused op where it declares one, falling back
    to its backward and the registry's loss ops for inputs the fused op declines."""
    composed = functools.partial(separate, backend.implementation("backward"), by_registry("indexer_kl"),
                                 by_registry("indexer_kl_backward"))
    if FUSED_OP not in backend.ops:
        return composed
    fused = backend.implementation(FUSED_OP)

    def fused_or_composed(*args):
        try:
            return fused(*args)
        except backends.UnsupportedInputs:
            return composed(*args)  # declines again for attention inputs its backward does not serve

    return fused_or_composed


def backward_with_index_loss(grad_out, grad_loss, q, *args):
    """`msa::backward_with_index_loss` in the backends' form, on the backends of `msa::backward`."""
    return backends.call(FUSED_OP, q.device, grad_out, grad_loss, q, *args, implementation=_served_by)


def attention_with_index_loss(q, k, v, index_q, index_k, block_indices, docs, block_size: int,
                               softmax_scale: float, plan, fragments, index_loss_value=None):
    """`(out, lse, kl, kl_value)`: the attention over `block_indices` and the index loss on that
    selection and the attention's lse (student scale `Di ** -0.5`), as `msa_attention(...,
    index_loss=True)` computes them (its docstring says when `kl` is a placeholder). The
    arguments are the ops' (checked by the caller); `docs` and `fragments` are the ops' four
    document and two fragment arguments.

    Raises:
        ValueError: `index_loss_value` under torch.func transforms with the loss served separately.
    """
    index_scale = index_q.shape[-1] ** -0.5
    if fused_in_backward(index_q, index_k, index_loss_value):
        if index_loss_value is None:
            index_loss_value = torch.zeros((), dtype=compute_dtype(index_q.dtype), device=q.device)
        out, lse, kl = torch.ops.msa.forward_with_index_loss(
            q, k, v, index_q, index_k, block_indices, *docs, block_size, softmax_scale, index_scale,
            index_loss_value, plan, *fragments)
        return out, lse, kl, index_loss_value
    out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, block_size, softmax_scale, plan, *fragments)
    kl, *_ = torch.ops.msa.indexer_kl(q.detach(), k.detach(), lse.detach(), index_q, index_k, block_indices, *docs,
                                      block_size, softmax_scale, index_scale, *fragments)
    kl_value = kl.detach()
    if index_loss_value is not None:
        if torch._C._are_functorch_transforms_active():
            raise ValueError("index_loss_value: not served under torch.func transforms (a transformed value cannot "
                             "be copied into it); there kl holds the loss's value, read it instead")
        with torch.no_grad():
            index_loss_value.copy_(kl_value)
        kl_value = index_loss_value
    return out, lse, kl, kl_value


def fused_in_backward(index_q, index_k, index_loss_value) -> bool:
    """Whether `msa_attention`'s index loss is computed by the backward: in training, outside
    torch.func transforms, and under torch.compile only with an `index_loss_value` tensor."""
    training = torch.is_grad_enabled() and (index_q.requires_grad or index_k.requires_grad)
    if not training or torch._C._are_functorch_transforms_active():
        return False
    return index_loss_value is not None or not torch.compiler.is_compiling()
