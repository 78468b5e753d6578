"""Registration of the `msa::` ops: schemas, kernels, fake kernels and autograd.

The schemas are defined here unless the process already holds them (the C++ stub of
`csrc_stub/`, loaded to deserialise an exported artifact without Python); in that case the
existing schemas are checked against `_schemas.SCHEMAS` and the Python kernels, fakes and
autograd are attached to them.

One kernel per op is registered for every device (`CompositeExplicitAutograd`): it validates
metadata, runs the value checks in debug mode, then asks the backend registry which
implementation to call. Because it runs at execution time, never while tracing, the choice of
backend adds no guard and no graph break.
"""

import torch

from . import backends, validation
from ._schemas import NAMESPACE, SCHEMAS
from .contract import INDEX_DTYPE, compute_dtype
from .plan import plan_numel

_DISPATCH_KEY = "CompositeExplicitAutograd"
_library = torch.library.Library(NAMESPACE, "FRAGMENT")


def _existing_schema(name: str) -> str | None:
    try:
        op = getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return None
    return str(op.default._schema).split("::", 1)[1]


def _define(name: str) -> None:
    existing = _existing_schema(name)
    if existing is None:
        _library.define(SCHEMAS[name], tags=(torch.Tag.pt2_compliant_tag,))
        return
    expected = str(torch._C.parse_schema(f"{NAMESPACE}::{SCHEMAS[name]}")).split("::", 1)[1]
    if existing != expected:
        raise RuntimeError(
            f"{NAMESPACE}::{name} is already registered with a different schema (an outdated csrc_stub?):\n"
            f"  registered: {existing}\n  torch_msa:  {expected}\nRebuild the stub from this torch_msa version."
        )


for _name in SCHEMAS:
    _define(_name)


def _select_blocks_kernel(index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size):
    validation.check_select_blocks(index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size)
    if validation.debug_enabled():
        validation.check_values(cu_seqlens_q, cu_seqlens_k, index_q.shape[0], index_k.shape[0], max_seqlen_q, max_seqlen_k)
    return backends.call(
        "select_blocks", index_q.device,
        index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size,
    )


def _plan_kernel(block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_keys, block_size,
                 entries_per_item):
    args = (block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_keys, block_size, entries_per_item)
    validation.check_plan_args(*args)
    if validation.debug_enabled():
        validation.check_values(cu_seqlens_q, cu_seqlens_k, block_indices.shape[1], num_keys, max_seqlen_q, max_seqlen_k,
                                block_indices, block_size)
    return backends.call("plan", block_indices.device, *args)


def _forward_kernel(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale,
                    plan=None):
    args = (q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale)
    validation.check_forward(*args)
    validation.check_plan(plan, block_indices)
    if validation.debug_enabled():
        validation.check_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, block_indices, block_size)
    return backends.call("forward", q.device, *args, plan)


def _backward_kernel(grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, block_size, softmax_scale, grad_lse=None, plan=None):
    args = (grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, block_size, softmax_scale, grad_lse)
    validation.check_backward(*args)
    validation.check_plan(plan, block_indices)
    if validation.debug_enabled():
        validation.check_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, block_indices, block_size)
    return backends.call("backward", q.device, *args, plan)


# Fake kernels: contiguous outputs, exactly as every backend returns them.
def _select_blocks_fake(index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size):
    validation.check_select_blocks(index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size)
    return index_q.new_empty((index_q.shape[1], index_q.shape[0], topk), dtype=torch.int32)


def _plan_fake(block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_keys, block_size,
               entries_per_item):
    validation.check_plan_args(block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_keys, block_size,
                     entries_per_item)
    numel = plan_numel(block_indices.shape, num_keys, cu_seqlens_q.shape[0] - 1, block_size, entries_per_item)
    return block_indices.new_empty((numel,), dtype=INDEX_DTYPE)


def _forward_fake(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale,
                  plan=None):
    validation.check_forward(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale)
    validation.check_plan(plan, block_indices)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=compute_dtype(q.dtype))


def _backward_fake(grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, block_size, softmax_scale, grad_lse=None, plan=None):
    validation.check_backward(grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, block_size, softmax_scale, grad_lse)
    validation.check_plan(plan, block_indices)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _forward_setup_context(ctx, inputs, output):
    q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale, plan = inputs
    out, lse = output
    # The plan travels with the saved tensors, so the backward reuses the forward's schedule.
    ctx.save_for_backward(q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k, plan)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.block_size, ctx.softmax_scale = block_size, softmax_scale
    # Unused outputs then arrive as None: a loss that ignores lse costs no zero-filled grad_lse.
    ctx.set_materialize_grads(False)


def _forward_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k, plan = ctx.saved_tensors
    if grad_out is None and grad_lse is None:
        return (None,) * 11
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.msa.backward(
        grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
        ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_size, ctx.softmax_scale, grad_lse, plan,
    )
    return (dq, dk, dv) + (None,) * 8


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "msa::backward is not differentiable: double backward through MSA attention is not supported"
    )


def _backward_setup_context(ctx, inputs, output):
    pass


def _register() -> None:
    kernels = {"select_blocks": _select_blocks_kernel, "plan": _plan_kernel, "forward": _forward_kernel,
               "backward": _backward_kernel}
    fakes = {"select_blocks": _select_blocks_fake, "plan": _plan_fake, "forward": _forward_fake, "backward": _backward_fake}
    for name in SCHEMAS:
        # With the C++ stub loaded, this replaces its "import torch_msa" kernel on the same key.
        _library.impl(name, kernels[name], _DISPATCH_KEY)
    for name in SCHEMAS:
        torch.library.register_fake(f"{NAMESPACE}::{name}", fakes[name], lib=_library)
    torch.library.register_autograd(
        f"{NAMESPACE}::forward", _forward_backward, setup_context=_forward_setup_context, lib=_library
    )
    torch.library.register_autograd(
        f"{NAMESPACE}::backward", _no_double_backward, setup_context=_backward_setup_context, lib=_library
    )


_register()
