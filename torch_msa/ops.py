"""Registration of the `msa::` ops: schemas, kernels, fake kernels, autograd, autocast and
FLOP formulas.

Schemas already defined (by the C++ stub of `csrc_stub/`) are checked against `_schemas.SCHEMAS`
and get the Python kernels attached. One kernel per op serves every device: it checks metadata
(values in debug mode) and asks the registry for the backend at run time, never while tracing,
so the choice adds no guard and no graph break.
"""

from collections.abc import Callable

import torch
from torch._functorch.utils import enable_single_level_autograd_function
from torch.autograd.forward_ad import _set_fwd_grad_enabled

from . import backends, flops, index_loss, validation
from ._schemas import NAMESPACE, SCHEMAS
from .contract import INDEX_DTYPE, compute_dtype
from .documents import DOCUMENT_ARGUMENTS, Documents
from .plan.schedule import plan_numel
from .reference_index_loss import loss_dtype

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


def _schema_arguments(name: str) -> tuple[tuple[str, ...], tuple]:
    """The names of `msa::name`'s arguments and their defaults (None where there is none)."""
    arguments = torch._C.parse_schema(f"{NAMESPACE}::{SCHEMAS[name]}").arguments
    return tuple(a.name for a in arguments), tuple(a.default_value if a.has_default_value() else None for a in arguments)


def _backend_form(name: str) -> Callable[..., list]:
    """The converter of `msa::name`'s dispatched arguments (trailing defaults may be absent) to the
    backends' form: schema order, the six document arguments as one `Documents`."""
    names, defaults = _schema_arguments(name)
    at = {argument: i for i, argument in enumerate(names)}
    documents_at = tuple(at[argument] for argument in DOCUMENT_ARGUMENTS)
    first, after = documents_at[0], documents_at[3] + 1
    if documents_at != (*range(first, after), len(names) - 2, len(names) - 1):
        raise RuntimeError(f"{NAMESPACE}::{name}: expected the four document arguments together and the fragments last")

    def convert(args, kwargs) -> list:
        values = [*args, *defaults[len(args):]]
        for argument, value in kwargs.items():
            values[at[argument]] = value
        return [*values[:first], Documents(*values[first:after], *values[-2:]), *values[after:-2]]

    return convert


_BACKEND_FORMS = {name: _backend_form(name) for name in SCHEMAS}
_NUM_ARGUMENTS = {name: len(_schema_arguments(name)[0]) for name in SCHEMAS}


def backend_arguments(name: str, *args, **kwargs) -> list:
    """`msa::name`'s arguments (positional or by name) in the backends' form (`_backend_form`)."""
    return _BACKEND_FORMS[name](args, kwargs)


def _below_schema(name: str, function: Callable[..., object]) -> Callable[..., object]:
    """`function`, which takes the backends' form of `msa::name`'s arguments, as a kernel of the op."""
    convert = _BACKEND_FORMS[name]
    return lambda *args, **kwargs: function(*convert(args, kwargs))


class _Kernels:
    """Each op's kernel for every device, named after the op, in the form `_below_schema` gives:
    it checks the metadata, in debug mode the values, then runs the backend the registry picks."""

    @staticmethod
    def select_blocks(index_q, index_k, documents, topk, block_size):
        validation.check_select_blocks(index_q, index_k, documents, topk, block_size)
        if validation.debug_enabled():
            validation.check_values(documents, index_q.shape[0], index_k.shape[0])
        return backends.call("select_blocks", index_q.device, index_q, index_k, documents, topk, block_size)

    @staticmethod
    def plan(block_indices, documents, num_keys, block_size, entries_per_item):
        args = (block_indices, documents, num_keys, block_size, entries_per_item)
        validation.check_plan_args(*args)
        if validation.debug_enabled():
            validation.check_values(documents, block_indices.shape[1], num_keys, block_indices, block_size)
        return backends.call("plan", block_indices.device, *args)

    @staticmethod
    def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan):
        args = (q, k, v, block_indices, documents, block_size, softmax_scale, plan)
        validation.check_forward(*args)
        if validation.debug_enabled():
            _check_values_with_plan(plan, block_indices, documents, q, k, block_size)
        return backends.call("forward", q.device, *args)

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse, plan):
        args = (grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse, plan)
        validation.check_backward(*args)
        if validation.debug_enabled():
            _check_values_with_plan(plan, block_indices, documents, q, k, block_size)
        return backends.call("backward", q.device, *args)

    @staticmethod
    def indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale,
                   index_softmax_scale):
        args = (q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale, index_softmax_scale)
        validation.check_indexer_kl(*args)
        if validation.debug_enabled():
            validation.check_values(documents, q.shape[0], k.shape[0], block_indices, block_size)
        return backends.call("indexer_kl", q.device, *args)

    @staticmethod
    def indexer_kl_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                            teacher_index_queries, block_indices, documents, block_size, index_softmax_scale):
        args = (grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys, teacher_index_queries,
                block_indices, documents, block_size, index_softmax_scale)
        validation.check_indexer_kl_backward(*args)
        if validation.debug_enabled():
            validation.check_values(documents, index_q.shape[0], index_k.shape[0], block_indices, block_size)
        return backends.call("indexer_kl_backward", index_q.device, *args)

    @staticmethod
    def forward_with_index_loss(q, k, v, index_q, index_k, block_indices, documents, block_size, softmax_scale,
                                index_softmax_scale, loss_value, plan):
        validation.check_forward_with_index_loss(q, k, v, index_q, index_k, block_indices, documents, block_size,
                                                 softmax_scale, index_softmax_scale, loss_value, plan)
        if validation.debug_enabled():
            _check_values_with_plan(plan, block_indices, documents, q, k, block_size)
        # The forward's backend; the loss is the backward's to compute (`backward_with_index_loss`).
        out, lse = backends.call("forward", q.device, q, k, v, block_indices, documents, block_size, softmax_scale, plan)
        return out, lse, torch.zeros((), dtype=loss_dtype(index_q.dtype), device=q.device)

    @staticmethod
    def backward_with_index_loss(grad_out, grad_loss, q, k, v, out, lse, index_q, index_k, block_indices, documents,
                                 block_size, softmax_scale, index_softmax_scale, grad_lse, plan):
        args = (grad_out, grad_loss, q, k, v, out, lse, index_q, index_k, block_indices, documents, block_size,
                softmax_scale, index_softmax_scale, grad_lse, plan)
        validation.check_backward_with_index_loss(*args)
        if validation.debug_enabled():
            _check_values_with_plan(plan, block_indices, documents, q, k, block_size)
        return index_loss.backward_with_index_loss(*args)


def _check_values_with_plan(plan, block_indices, documents, q, k, block_size):
    validation.check_values(documents, q.shape[0], k.shape[0], block_indices, block_size)
    if plan is not None:
        validation.check_plan_values(plan, block_indices, documents, k.shape[0], block_size)


class _Fakes:
    """Each op's fake kernel, named after the op, in the form `_below_schema` gives: the metadata
    checks, then contiguous outputs, exactly as every backend returns them."""

    @staticmethod
    def select_blocks(index_q, index_k, documents, topk, block_size):
        validation.check_select_blocks(index_q, index_k, documents, topk, block_size)
        return index_q.new_empty((index_q.shape[1], index_q.shape[0], topk), dtype=torch.int32)

    @staticmethod
    def plan(block_indices, documents, num_keys, block_size, entries_per_item):
        validation.check_plan_args(block_indices, documents, num_keys, block_size, entries_per_item)
        numel = plan_numel(block_indices.shape, num_keys, documents.num_documents, block_size, entries_per_item)
        return block_indices.new_empty((numel,), dtype=INDEX_DTYPE)

    @staticmethod
    def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan):
        validation.check_forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan)
        return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=compute_dtype(q.dtype))

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse, plan):
        validation.check_backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale,
                                  grad_lse, plan)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @staticmethod
    def indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale,
                   index_softmax_scale):
        validation.check_indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale,
                                    index_softmax_scale)
        dtype = loss_dtype(index_q.dtype)
        per_index_head = index_q.shape[:2]
        return (q.new_empty((), dtype=dtype), q.new_empty(q.shape[:2], dtype=compute_dtype(q.dtype)),
                q.new_empty(per_index_head, dtype=dtype), q.new_empty(per_index_head, dtype=dtype),
                q.new_empty(index_q.shape, dtype=dtype), q.new_empty((index_k.shape[0], 1, index_q.shape[2]), dtype=dtype))

    @staticmethod
    def indexer_kl_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                            teacher_index_queries, block_indices, documents, block_size, index_softmax_scale):
        validation.check_indexer_kl_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                                             teacher_index_queries, block_indices, documents, block_size,
                                             index_softmax_scale)
        return index_q.new_empty(index_q.shape), index_k.new_empty(index_k.shape)

    @staticmethod
    def forward_with_index_loss(q, k, v, index_q, index_k, block_indices, documents, block_size, softmax_scale,
                                index_softmax_scale, loss_value, plan):
        validation.check_forward_with_index_loss(q, k, v, index_q, index_k, block_indices, documents, block_size,
                                                 softmax_scale, index_softmax_scale, loss_value, plan)
        return (q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=compute_dtype(q.dtype)),
                q.new_empty((), dtype=loss_dtype(index_q.dtype)))

    @staticmethod
    def backward_with_index_loss(grad_out, grad_loss, q, k, v, out, lse, index_q, index_k, block_indices, documents,
                                 block_size, softmax_scale, index_softmax_scale, grad_lse, plan):
        validation.check_backward_with_index_loss(grad_out, grad_loss, q, k, v, out, lse, index_q, index_k,
                                                  block_indices, documents, block_size, softmax_scale,
                                                  index_softmax_scale, grad_lse, plan)
        return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), index_q.new_empty(index_q.shape),
                index_k.new_empty(index_k.shape), q.new_empty((), dtype=loss_dtype(index_q.dtype)))


def _forward_setup_context(ctx, inputs, output):
    q, k, v, block_indices, documents, block_size, softmax_scale, plan = _BACKEND_FORMS["forward"](inputs, {})
    out, lse = output
    # The plan travels with the saved tensors, so the backward reuses the forward's schedule.
    ctx.save_for_backward(q, k, v, out, lse, block_indices, documents.cu_seqlens_q, documents.cu_seqlens_k, plan,
                          *documents.fragments)
    ctx.max_seqlen_q, ctx.max_seqlen_k = documents.max_seqlen_q, documents.max_seqlen_k
    ctx.block_size, ctx.softmax_scale = block_size, softmax_scale
    # Unused outputs then arrive as None: a loss that ignores lse costs no zero-filled grad_lse.
    ctx.set_materialize_grads(False)


def _forward_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k, plan, *fragments = ctx.saved_tensors
    if grad_out is None and grad_lse is None:
        return (None,) * _NUM_ARGUMENTS["forward"]
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.msa.backward(
        grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
        ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_size, ctx.softmax_scale, grad_lse, plan, *fragments,
    )
    return (dq, dk, dv) + (None,) * (_NUM_ARGUMENTS["forward"] - 3)


def _indexer_kl_setup_context(ctx, inputs, output):
    (_, _, _, index_q, index_k, block_indices, documents, block_size, _,
     index_softmax_scale) = _BACKEND_FORMS["indexer_kl"](inputs, {})
    _, _, index_lse, teacher_mass, teacher_index_keys, teacher_index_queries = output
    # The teacher's share of the gradient was reduced by the forward: q, k and lse are not kept.
    ctx.save_for_backward(index_q, index_k, index_lse, teacher_mass, teacher_index_keys, teacher_index_queries,
                          block_indices, documents.cu_seqlens_q, documents.cu_seqlens_k, *documents.fragments)
    ctx.max_seqlen_q, ctx.max_seqlen_k = documents.max_seqlen_q, documents.max_seqlen_k
    ctx.block_size, ctx.index_softmax_scale = block_size, index_softmax_scale
    ctx.set_materialize_grads(False)


def _indexer_kl_backward(ctx, grad_loss, *unused_grads):
    """Gradients reach index_q and index_k only: the teacher (q, k, lse) is a constant of the loss,
    and the auxiliary outputs are not differentiable."""
    if grad_loss is None:
        return (None,) * _NUM_ARGUMENTS["indexer_kl"]
    *saved, fragment_documents, fragment_starts = ctx.saved_tensors
    d_index_q, d_index_k = torch.ops.msa.indexer_kl_backward(
        grad_loss, *saved, ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_size, ctx.index_softmax_scale,
        fragment_documents, fragment_starts,
    )
    return (None, None, None, d_index_q, d_index_k) + (None,) * (_NUM_ARGUMENTS["indexer_kl"] - 5)


def _forward_with_index_loss_setup_context(ctx, inputs, output):
    (q, k, v, index_q, index_k, block_indices, documents, block_size, softmax_scale, index_softmax_scale,
     loss_value, plan) = _BACKEND_FORMS["forward_with_index_loss"](inputs, {})
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, index_q, index_k, block_indices, documents.cu_seqlens_q,
                          documents.cu_seqlens_k, plan, *documents.fragments)
    # Held, not saved: every backward writes it, which a saved tensor's version check would refuse
    # on the next backward through the same graph.
    ctx.loss_value = loss_value
    ctx.max_seqlen_q, ctx.max_seqlen_k = documents.max_seqlen_q, documents.max_seqlen_k
    ctx.block_size, ctx.softmax_scale, ctx.index_softmax_scale = block_size, softmax_scale, index_softmax_scale
    ctx.set_materialize_grads(False)


def _forward_with_index_loss_backward(ctx, grad_out, grad_lse, grad_loss):
    """Gradients to q, k, v and (the index loss's) to index_q, index_k; the value goes into
    `loss_value`. Without a gradient of the loss term only the attention backward runs."""
    q, k, v, out, lse, index_q, index_k, block_indices, cu_seqlens_q, cu_seqlens_k, plan, *fragments = ctx.saved_tensors
    loss_value = ctx.loss_value
    num_arguments = _NUM_ARGUMENTS["forward_with_index_loss"]
    if grad_loss is None:
        if grad_out is None and grad_lse is None:
            return (None,) * num_arguments
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv = torch.ops.msa.backward(
            grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
            ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_size, ctx.softmax_scale, grad_lse, plan, *fragments,
        )
        return (dq, dk, dv) + (None,) * (num_arguments - 3)
    attention_grads = grad_out is not None or grad_lse is not None
    if grad_out is None:
        # The op's one contract takes an attention gradient; on Hopper the teacher is formed where the
        # attention backward recomputes P, so the backward runs even for the loss alone.
        grad_out = torch.zeros_like(out)
    dq, dk, dv, d_index_q, d_index_k, loss = torch.ops.msa.backward_with_index_loss(
        grad_out, grad_loss, q, k, v, out, lse, index_q, index_k, block_indices, cu_seqlens_q, cu_seqlens_k,
        ctx.max_seqlen_q, ctx.max_seqlen_k, ctx.block_size, ctx.softmax_scale, ctx.index_softmax_scale, grad_lse,
        plan, *fragments,
    )
    with torch.no_grad():
        loss_value.copy_(loss)
    if not attention_grads:
        dq = dk = dv = None
    return (dq, dk, dv, d_index_q, d_index_k) + (None,) * (num_arguments - 5)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "msa::backward, msa::indexer_kl_backward and msa::backward_with_index_loss are not differentiable: "
        "double backward through them is not supported"
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
def _autograd_function(name: str, setup_context, backward) -> type:
    op = getattr(torch.ops.msa, name).default
    return type(f"_{name}_autograd", (torch.autograd.function._SingleLevelFunction,), {
        "forward": _below_autograd(op),
        "setup_context": _without_grad_modes(setup_context),
        "backward": backward,
        "jvp": _no_forward_ad(f"{NAMESPACE}::{name}"),
    })


# The differentiable ops' `(setup_context, backward)`; the others (select_blocks, plan) return
# integers. The backward ops themselves are not differentiable.
_GRADIENTS = {
    "forward": (_forward_setup_context, _no_grad_for_grad_modes(_forward_backward)),
    "backward": (_backward_setup_context, staticmethod(_no_double_backward)),
    "indexer_kl": (_indexer_kl_setup_context, _no_grad_for_grad_modes(_indexer_kl_backward)),
    "indexer_kl_backward": (_backward_setup_context, staticmethod(_no_double_backward)),
    "forward_with_index_loss": (_forward_with_index_loss_setup_context,
                                _no_grad_for_grad_modes(_forward_with_index_loss_backward)),
    "backward_with_index_loss": (_backward_setup_context, staticmethod(_no_double_backward)),
}
_AUTOGRAD_FUNCTIONS = {name: _autograd_function(name, *_GRADIENTS[name]) for name in SCHEMAS if name in _GRADIENTS}


def differentiated(args) -> bool:
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
        if differentiated(args):
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


# The positions of the arguments autocast casts, by op (none where absent).
_AUTOCAST_ARGUMENTS = {"forward": (0, 1, 2), "forward_with_index_loss": (0, 1, 2)}
for _table in (_GRADIENTS, _AUTOCAST_ARGUMENTS):
    if not _table.keys() <= SCHEMAS.keys():
        raise RuntimeError(f"torch_msa.ops: {sorted(_table)} names ops that have no schema ({sorted(SCHEMAS)})")


def _register() -> None:
    for name in SCHEMAS:
        # With the C++ stub loaded, this replaces its "import torch_msa" kernel on the same key.
        _library.impl(name, _below_schema(name, getattr(_Kernels, name)), _DISPATCH_KEY)
        torch.library.register_fake(f"{NAMESPACE}::{name}", _below_schema(name, getattr(_Fakes, name)), lib=_library)
        op = getattr(torch.ops.msa, name).default
        if name in _AUTOGRAD_FUNCTIONS:
            _library.impl(name, _autograd_kernel(_AUTOGRAD_FUNCTIONS[name], op), "Autograd", with_keyset=True)
        for device_type in _AUTOCAST_DEVICE_TYPES:
            key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
            _library.impl(name, _autocast_kernel(op, device_type, _AUTOCAST_ARGUMENTS.get(name, ())), key)
    flops.register()


_register()
