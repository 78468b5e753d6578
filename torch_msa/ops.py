"""Registration of the `msa::` ops: schemas, kernels, fake kernels, autograd, autocast and
FLOP formulas.

The schemas are defined here unless the process already holds them (the C++ stub of
`csrc_stub/`, loaded to deserialise an exported artifact without Python); in that case the
existing schemas are checked against `_schemas.SCHEMAS` and the Python kernels, fakes and
autograd are attached to them.

One kernel per op is registered for every device (`CompositeExplicitAutograd`): it validates
metadata, runs the value checks in debug mode, then asks the backend registry which
implementation to call. Because it runs at execution time, never while tracing, the choice of
backend adds no guard and no graph break.
"""

from collections.abc import Callable

import torch
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.forward_ad import _set_fwd_grad_enabled

from . import backends, flops, validation
from ._schemas import NAMESPACE, SCHEMAS
from .contract import INDEX_DTYPE, compute_dtype
from .reference_kl import loss_dtype
from .schedule import plan_numel

_DISPATCH_KEY = "CompositeExplicitAutograd"
# The schemas are defined on a library of their own that outlives a reload of this module
# (importlib.reload): destroying the library that defined them would deregister them. The
# kernels' library is replaced on a reload, the earlier one destroyed first so that its
# registrations make way.
_schema_library = globals().get("_schema_library") or torch.library.Library(NAMESPACE, "FRAGMENT")
if "_library" in globals():
    globals()["_library"]._destroy()
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
        _schema_library.define(SCHEMAS[name], tags=(torch.Tag.pt2_compliant_tag,))
        return
    expected = str(torch._C.parse_schema(f"{NAMESPACE}::{SCHEMAS[name]}")).split("::", 1)[1]
    if existing != expected:
        raise RuntimeError(
            f"{NAMESPACE}::{name} is already registered with a different schema (an outdated csrc_stub?):\n"
            f"  registered: {existing}\n  torch_msa:  {expected}\nRebuild the stub from this torch_msa version."
        )


for _name in SCHEMAS:
    _define(_name)


def _select_blocks_kernel(index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size,
                          fragment_documents=None, fragment_starts=None):
    fragments = (fragment_documents, fragment_starts)
    validation.check_select_blocks(index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size,
                                   *fragments)
    if validation.debug_enabled():
        validation.check_values(cu_seqlens_q, cu_seqlens_k, index_q.shape[0], index_k.shape[0], max_seqlen_q, max_seqlen_k,
                                None, None, *fragments)
    return backends.call(
        "select_blocks", index_q.device,
        index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size, *fragments,
    )


def _plan_kernel(block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_keys, block_size,
                 entries_per_item, fragment_documents=None, fragment_starts=None):
    fragments = (fragment_documents, fragment_starts)
    args = (block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_keys, block_size, entries_per_item)
    validation.check_plan_args(*args, *fragments)
    if validation.debug_enabled():
        validation.check_values(cu_seqlens_q, cu_seqlens_k, block_indices.shape[1], num_keys, max_seqlen_q, max_seqlen_k,
                                block_indices, block_size, *fragments)
    return backends.call("plan", block_indices.device, *args, *fragments)


def _check_plan(plan, block_indices, k, cu_seqlens_k, block_size):
    validation.check_plan(plan, block_indices, k.shape[0], cu_seqlens_k.shape[0] - 1, block_size)


def _check_values_with_plan(plan, block_indices, cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k,
                            block_size, fragments):
    validation.check_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                            block_indices, block_size, *fragments)
    if plan is not None:
        validation.check_plan_values(plan, block_indices, cu_seqlens_q, cu_seqlens_k, k.shape[0], block_size, *fragments)


def _forward_kernel(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale,
                    plan=None, fragment_documents=None, fragment_starts=None):
    fragments = (fragment_documents, fragment_starts)
    args = (q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale)
    validation.check_forward(*args, *fragments)
    _check_plan(plan, block_indices, k, cu_seqlens_k, block_size)
    if validation.debug_enabled():
        _check_values_with_plan(plan, block_indices, cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k,
                                block_size, fragments)
    return backends.call("forward", q.device, *args, plan, *fragments)


def _backward_kernel(grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, block_size, softmax_scale, grad_lse=None, plan=None,
                     fragment_documents=None, fragment_starts=None):
    fragments = (fragment_documents, fragment_starts)
    args = (grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, block_size, softmax_scale, grad_lse)
    validation.check_backward(*args, *fragments)
    _check_plan(plan, block_indices, k, cu_seqlens_k, block_size)
    if validation.debug_enabled():
        _check_values_with_plan(plan, block_indices, cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k,
                                block_size, fragments)
    return backends.call("backward", q.device, *args, plan, *fragments)


def _indexer_kl_kernel(q, k, lse, index_q, index_k, block_indices, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, block_size, softmax_scale, index_softmax_scale,
                       fragment_documents=None, fragment_starts=None):
    args = (q, k, lse, index_q, index_k, block_indices, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, block_size, softmax_scale, index_softmax_scale, fragment_documents, fragment_starts)
    validation.check_indexer_kl(*args)
    if validation.debug_enabled():
        validation.check_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, block_indices,
                                block_size, fragment_documents, fragment_starts)
    return backends.call("indexer_kl", q.device, *args)


def _indexer_kl_backward_kernel(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                                teacher_index_queries, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, block_size, index_softmax_scale, fragment_documents=None,
                                fragment_starts=None):
    args = (grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys, teacher_index_queries,
            block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, index_softmax_scale,
            fragment_documents, fragment_starts)
    validation.check_indexer_kl_backward(*args)
    if validation.debug_enabled():
        validation.check_values(cu_seqlens_q, cu_seqlens_k, index_q.shape[0], index_k.shape[0], max_seqlen_q, max_seqlen_k,
                                block_indices, block_size, fragment_documents, fragment_starts)
    return backends.call("indexer_kl_backward", index_q.device, *args)


# Fake kernels: contiguous outputs, exactly as every backend returns them.
def _select_blocks_fake(index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size,
                        fragment_documents=None, fragment_starts=None):
    validation.check_select_blocks(index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size,
                                   fragment_documents, fragment_starts)
    return index_q.new_empty((index_q.shape[1], index_q.shape[0], topk), dtype=torch.int32)


def _plan_fake(block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_keys, block_size,
               entries_per_item, fragment_documents=None, fragment_starts=None):
    validation.check_plan_args(block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_keys, block_size,
                               entries_per_item, fragment_documents, fragment_starts)
    numel = plan_numel(block_indices.shape, num_keys, cu_seqlens_k.shape[0] - 1, block_size, entries_per_item)
    return block_indices.new_empty((numel,), dtype=INDEX_DTYPE)


def _forward_fake(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale,
                  plan=None, fragment_documents=None, fragment_starts=None):
    validation.check_forward(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size,
                             softmax_scale, fragment_documents, fragment_starts)
    _check_plan(plan, block_indices, k, cu_seqlens_k, block_size)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=compute_dtype(q.dtype))


def _backward_fake(grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, block_size, softmax_scale, grad_lse=None, plan=None,
                   fragment_documents=None, fragment_starts=None):
    validation.check_backward(grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, block_size, softmax_scale, grad_lse,
                              fragment_documents, fragment_starts)
    _check_plan(plan, block_indices, k, cu_seqlens_k, block_size)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _indexer_kl_fake(q, k, lse, index_q, index_k, block_indices, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, block_size, softmax_scale, index_softmax_scale,
                     fragment_documents=None, fragment_starts=None):
    validation.check_indexer_kl(q, k, lse, index_q, index_k, block_indices, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, block_size, softmax_scale, index_softmax_scale,
                                fragment_documents, fragment_starts)
    dtype = loss_dtype(index_q.dtype)
    per_index_head = index_q.shape[:2]
    return (q.new_empty((), dtype=dtype), q.new_empty(q.shape[:2], dtype=compute_dtype(q.dtype)),
            q.new_empty(per_index_head, dtype=dtype), q.new_empty(per_index_head, dtype=dtype),
            q.new_empty(index_q.shape, dtype=dtype), q.new_empty((index_k.shape[0], 1, index_q.shape[2]), dtype=dtype))


def _indexer_kl_backward_fake(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                              teacher_index_queries, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, block_size, index_softmax_scale, fragment_documents=None,
                              fragment_starts=None):
    validation.check_indexer_kl_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                                         teacher_index_queries, block_indices, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, block_size, index_softmax_scale,
                                         fragment_documents, fragment_starts)
    return index_q.new_empty(index_q.shape), index_k.new_empty(index_k.shape)


def _forward_setup_context(ctx, inputs, output):
    # Trailing optional arguments the caller left out are absent from `inputs`.
    (q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale, plan,
     fragment_documents, fragment_starts) = [*inputs] + [None] * (13 - len(inputs))
    out, lse = output
    # The plan travels with the saved tensors, so the backward reuses the forward's schedule.
    ctx.save_for_backward(q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k, plan,
                          fragment_documents, fragment_starts)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.block_size, ctx.softmax_scale = block_size, softmax_scale
    # Unused outputs then arrive as None: a loss that ignores lse costs no zero-filled grad_lse.
    ctx.set_materialize_grads(False)


def _forward_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k, plan, *fragments = ctx.saved_tensors
    if grad_out is None and grad_lse is None:
        return (None,) * 13
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.msa.backward(
        grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
        ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_size, ctx.softmax_scale, grad_lse, plan, *fragments,
    )
    return (dq, dk, dv) + (None,) * 10


def _indexer_kl_setup_context(ctx, inputs, output):
    # Trailing optional arguments the caller left out are absent from `inputs`.
    padded = tuple(inputs) + (None,) * (15 - len(inputs))
    (_, _, _, index_q, index_k, block_indices, cu_seqlens_q, cu_seqlens_k,
     max_seqlen_q, max_seqlen_k, block_size, _, index_softmax_scale, fragment_documents, fragment_starts) = padded
    _, _, index_lse, teacher_mass, teacher_index_keys, teacher_index_queries = output
    # The teacher's share of the gradient was reduced by the forward: q, k and lse are not kept.
    ctx.save_for_backward(index_q, index_k, index_lse, teacher_mass, teacher_index_keys, teacher_index_queries,
                          block_indices, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.block_size, ctx.index_softmax_scale = block_size, index_softmax_scale
    ctx.set_materialize_grads(False)


def _indexer_kl_backward(ctx, grad_loss, *unused_grads):
    """Gradients reach index_q and index_k only: the teacher (q, k, lse) is a constant of the loss,
    and the auxiliary outputs are not differentiable."""
    if grad_loss is None:
        return (None,) * 15
    *saved, fragment_documents, fragment_starts = ctx.saved_tensors
    d_index_q, d_index_k = torch.ops.msa.indexer_kl_backward(
        grad_loss, *saved, ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_size, ctx.index_softmax_scale,
        fragment_documents, fragment_starts,
    )
    return (None, None, None, d_index_q, d_index_k) + (None,) * 10


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "msa::backward and msa::indexer_kl_backward are not differentiable: double backward through "
        "them is not supported"
    )


def _backward_setup_context(ctx, inputs, output):
    pass


def _no_forward_ad(op: str):
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            f"torch_msa: {op} does not support forward-mode AD (torch.func.jvp, jacfwd, "
            "torch.autograd.forward_ad); use reverse mode (backward(), torch.func.grad, vjp or jacrev)"
        )

    return staticmethod(jvp)


def _below_autograd(op):
    def forward(grad_modes, *args):
        # autograd.Function runs its forward with grad modes off; the outer levels of nested
        # torch.func transforms must see the caller's, or they would record nothing.
        backward_ad, forward_ad = grad_modes
        with torch.set_grad_enabled(backward_ad), _set_fwd_grad_enabled(forward_ad), \
                torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    return staticmethod(forward)


def _without_grad_modes(setup_context):
    return staticmethod(lambda ctx, inputs, output: setup_context(ctx, inputs[1:], output))


def _no_grad_for_grad_modes(backward):
    return staticmethod(lambda ctx, *grads: (None, *backward(ctx, *grads)))


# The Autograd kernels are single-level autograd Functions (forward and setup_context apart)
# applied from inside the dispatcher, as the graph nodes of built-in ops are. That is what lets
# torch.func.grad / vjp / jacrev differentiate the ops level by level; the Function that
# `torch.library.register_autograd` generates combines forward and ctx, which torch.func
# rejects. Forward-mode AD has no formula: `jvp` raises instead of leaving a zero tangent.
class _ForwardAutograd(torch.autograd.function._SingleLevelFunction):
    forward = _below_autograd(torch.ops.msa.forward.default)
    setup_context = _without_grad_modes(_forward_setup_context)
    backward = _no_grad_for_grad_modes(_forward_backward)
    jvp = _no_forward_ad("msa::forward")


class _BackwardAutograd(torch.autograd.function._SingleLevelFunction):
    forward = _below_autograd(torch.ops.msa.backward.default)
    setup_context = _without_grad_modes(_backward_setup_context)
    backward = staticmethod(_no_double_backward)
    jvp = _no_forward_ad("msa::backward")


class _IndexerKLAutograd(torch.autograd.function._SingleLevelFunction):
    forward = _below_autograd(torch.ops.msa.indexer_kl.default)
    setup_context = _without_grad_modes(_indexer_kl_setup_context)
    backward = _no_grad_for_grad_modes(_indexer_kl_backward)
    jvp = _no_forward_ad("msa::indexer_kl")


class _IndexerKLBackwardAutograd(torch.autograd.function._SingleLevelFunction):
    forward = _below_autograd(torch.ops.msa.indexer_kl_backward.default)
    setup_context = _without_grad_modes(_backward_setup_context)
    backward = staticmethod(_no_double_backward)
    jvp = _no_forward_ad("msa::indexer_kl_backward")


# The differentiable ops' autograd Functions (select_blocks and plan return integers).
_AUTOGRAD_FUNCTIONS = {
    "forward": _ForwardAutograd,
    "backward": _BackwardAutograd,
    "indexer_kl": _IndexerKLAutograd,
    "indexer_kl_backward": _IndexerKLBackwardAutograd,
}


def _differentiated(args) -> bool:
    """Whether autograd must see this call: an input requires grad (in grad mode) or carries a
    forward-mode tangent, or a torch.func transform is active (its tensors are wrapped)."""
    tensors = [x for x in args if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return True
    if torch._C._are_functorch_transforms_active():
        return True
    return any(torch.autograd.forward_ad.unpack_dual(x).tangent is not None for x in tensors)


def _autograd_kernel(function, op):
    def kernel(keyset, *args):
        if _differentiated(args):
            grad_modes = (torch.is_grad_enabled(), torch._C._is_fwd_grad_enabled())
            with enable_single_level_autograd_function():
                return function.apply(grad_modes, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    return kernel


# Autocast follows scaled_dot_product_attention: the attention forward runs in the autocast
# dtype (q, k, v cast like any lower-precision op: floating, not fp64); the selection and the
# backward run with autocast off, so selection scores, lse and grad_lse stay fp32.
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def _autocast_kernel(op, device_type: str, cast_args: tuple[int, ...]):
    def kernel(*args):
        if cast_args:
            dtype = torch.get_autocast_dtype(device_type)
            args = tuple(
                x.to(dtype) if i in cast_args and _autocast_eligible(x, device_type) else x for i, x in enumerate(args)
            )
        with torch.autocast(device_type, enabled=False):
            return op(*args)

    return kernel


def _autocast_eligible(x: torch.Tensor, device_type: str) -> bool:
    return x.device.type == device_type and x.is_floating_point() and x.dtype != torch.float64


# One row per op of `_schemas.SCHEMAS`: its kernel (every device), its fake kernel, and the
# positions of the arguments autocast casts.
_IMPLEMENTATIONS: dict[str, tuple[Callable[..., object], Callable[..., object], tuple[int, ...]]] = {
    "select_blocks": (_select_blocks_kernel, _select_blocks_fake, ()),
    "plan": (_plan_kernel, _plan_fake, ()),
    "forward": (_forward_kernel, _forward_fake, (0, 1, 2)),
    "backward": (_backward_kernel, _backward_fake, ()),
    "indexer_kl": (_indexer_kl_kernel, _indexer_kl_fake, ()),
    "indexer_kl_backward": (_indexer_kl_backward_kernel, _indexer_kl_backward_fake, ()),
}
if _IMPLEMENTATIONS.keys() != SCHEMAS.keys():
    raise RuntimeError(f"torch_msa.ops: implementations {sorted(_IMPLEMENTATIONS)} do not match the schemas {sorted(SCHEMAS)}")


def _register() -> None:
    for name, (kernel, fake, _) in _IMPLEMENTATIONS.items():
        # With the C++ stub loaded, this replaces its "import torch_msa" kernel on the same key.
        _library.impl(name, kernel, _DISPATCH_KEY)
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_library)
    for name, function in _AUTOGRAD_FUNCTIONS.items():
        op = getattr(torch.ops.msa, name).default
        _library.impl(name, _autograd_kernel(function, op), "Autograd", with_keyset=True)
    for name, (_, _, cast_args) in _IMPLEMENTATIONS.items():
        op = getattr(torch.ops.msa, name).default
        for device_type in _AUTOCAST_DEVICE_TYPES:
            key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
            _library.impl(name, _autocast_kernel(op, device_type, cast_args), key)
    flops.register()


_register()
