"""The public Python API: typed wrappers over `torch.ops.msa.*` with the M3 defaults.

Packed layouts: `q [Tq, Hq, D]`, `k, v [Tk, Hkv, D]`, `index_q [Tq, Hkv, Di]`, `index_k [Tk, 1, Di]`,
`block_indices` int32 `[Hkv, Tq, topk]`; documents are delimited by int32 `cu_seqlens_q`,
`cu_seqlens_k` `[B + 1]` (omitted: one document), queries being the causal suffix of their
document's keys, or by query fragments (`fragment_documents`, `fragment_starts`, int32 `[F]`).
`max_seqlen_q`, `max_seqlen_k` default to `Tq`, `Tk`. Everything but `validate_inputs` traces
under `torch.compile(fullgraph=True)` and `torch.export` without a host sync. Details, and the
conversions from flash-attn's, fla's and HF's layouts: docs/api.md.
"""

import warnings
from typing import Literal, NamedTuple, overload

import torch

from . import ops as _ops  # registers torch.ops.msa.*
from . import validation
from .contract import DEFAULT_BLOCK_SIZE, DEFAULT_TOPK
from .diagnostics import TorchMSAWarning
from .documents import FRAGMENT_ARGUMENTS, Documents
from .index_loss import attention_with_index_loss
from .plan.schedule import entries_per_item

# The ops' positional document arguments: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
# and the trailing (fragment_documents, fragment_starts); together the fields of `Documents`.
_DocumentArgs = tuple[torch.Tensor, torch.Tensor, int, int]
_FragmentArgs = tuple[torch.Tensor | None, torch.Tensor | None]


class AttentionOutput(NamedTuple):
    """What `sparse_attention(..., return_lse=True)` and `msa_attention(..., return_lse=True)` return.

    Attributes:
        out: `[Tq, Hq, D]` in q's dtype.
        lse: `[Tq, Hq]` fp32 (fp64 for fp64 inputs), the natural-log log-sum-exp of each query
            head's scaled scores, `-inf` for a query that read no key; differentiable in q and k.
    """

    out: torch.Tensor
    lse: torch.Tensor


class MSABlocksOutput(NamedTuple):
    """What `msa_attention(..., return_block_indices=True)` returns: fields as in `MSAAttentionOutput`."""

    out: torch.Tensor
    block_indices: torch.Tensor


class MSALseBlocksOutput(NamedTuple):
    """`msa_attention(..., return_lse=True, return_block_indices=True)`'s result (`MSAAttentionOutput`'s fields)."""

    out: torch.Tensor
    lse: torch.Tensor
    block_indices: torch.Tensor


class MSAIndexLossOutput(NamedTuple):
    """What `msa_attention(..., index_loss=True)` returns: fields as in `MSAAttentionOutput`."""

    out: torch.Tensor
    kl: torch.Tensor
    kl_value: torch.Tensor


class MSALseIndexLossOutput(NamedTuple):
    """`msa_attention(..., return_lse=True, index_loss=True)`'s result (`MSAAttentionOutput`'s fields)."""

    out: torch.Tensor
    lse: torch.Tensor
    kl: torch.Tensor
    kl_value: torch.Tensor


class MSABlocksIndexLossOutput(NamedTuple):
    """`msa_attention(..., return_block_indices=True, index_loss=True)`'s result (`MSAAttentionOutput`'s fields)."""

    out: torch.Tensor
    block_indices: torch.Tensor
    kl: torch.Tensor
    kl_value: torch.Tensor


class MSAAttentionOutput(NamedTuple):
    """What `msa_attention(..., return_lse=True, return_block_indices=True, index_loss=True)` returns.

    With fewer flags the result is the named tuple of `out` and just the fields asked for, in this
    order (`AttentionOutput`, `MSABlocksOutput`, ...).

    Attributes:
        out: `[Tq, Hq, D]` in q's dtype.
        lse: `[Tq, Hq]` as in `AttentionOutput.lse`.
        block_indices: the int32 `[Hkv, Tq, topk]` selection the attention used.
        kl: the index loss on this call's selection and lse, 0-D, differentiable in `index_q`
            and `index_k` only; in training a placeholder of value 0 (docs/api.md).
        kl_value: a 0-D tensor without autograd history that holds the loss's value (in training,
            once the backward has run).
    """

    out: torch.Tensor
    lse: torch.Tensor
    block_indices: torch.Tensor
    kl: torch.Tensor
    kl_value: torch.Tensor


# Any of `msa_attention`'s results with a flag set (the type of a call whose flags are plain bools).
MSAResult = (AttentionOutput | MSABlocksOutput | MSALseBlocksOutput | MSAIndexLossOutput | MSALseIndexLossOutput
             | MSABlocksIndexLossOutput | MSAAttentionOutput)

_MSA_RESULT_TYPES: dict[tuple[bool, bool, bool], type[MSAResult]] = {
    # (return_lse, return_block_indices, index_loss)
    (True, False, False): AttentionOutput,
    (False, True, False): MSABlocksOutput,
    (True, True, False): MSALseBlocksOutput,
    (False, False, True): MSAIndexLossOutput,
    (True, False, True): MSALseIndexLossOutput,
    (False, True, True): MSABlocksIndexLossOutput,
    (True, True, True): MSAAttentionOutput,
}


def _msa_result(out: torch.Tensor, *, return_lse: bool, return_block_indices: bool, index_loss: bool,
                **fields: torch.Tensor) -> torch.Tensor | MSAResult:
    """`out` alone without a flag, else the named tuple of `out` and the asked fields from `fields`."""
    if not (return_lse or return_block_indices or index_loss):
        return out
    result_type = _MSA_RESULT_TYPES[return_lse, return_block_indices, index_loss]
    return result_type(out, *(fields[name] for name in result_type._fields[1:]))


# torch.export.save and AOTInductor packages serialise a program's output structure; a named
# tuple needs a registered name for that, or a program that returns one could not be saved.
for _output in _MSA_RESULT_TYPES.values():
    torch.utils._pytree._register_namedtuple(_output, serialized_type_name=f"torch_msa.{_output.__name__}")


def _document_args(num_queries, num_keys, device, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   block_size, topk=None, softmax_scale=None) -> _DocumentArgs:
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        validation.check_optional_tensor(name, cu, "int32 [B + 1]")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens_q"
        raise ValueError(f"{missing}: expected a tensor when the other cu_seqlens is given (or neither), got None")
    if cu_seqlens_q is None:
        # [0, T] built from a shape, so it stays symbolic under dynamic-shape tracing.
        steps = torch.arange(2, dtype=torch.int32, device=device)
        cu_seqlens_q, cu_seqlens_k = steps * num_queries, steps * num_keys
    max_seqlen_q = num_queries if max_seqlen_q is None else max_seqlen_q
    max_seqlen_k = num_keys if max_seqlen_k is None else max_seqlen_k
    validation.check_host_args(max_seqlen_q, max_seqlen_k, block_size, topk, softmax_scale)
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k


def _fragments(fragment_documents, fragment_starts, cu_seqlens_q) -> _FragmentArgs:
    """The ops' two trailing fragment arguments, checked to come together with `cu_seqlens`."""
    for name, x in zip(FRAGMENT_ARGUMENTS, (fragment_documents, fragment_starts)):
        validation.check_optional_tensor(name, x, "int32 [F]")
    if (fragment_documents is None) != (fragment_starts is None):
        missing, other = FRAGMENT_ARGUMENTS if fragment_documents is None else reversed(FRAGMENT_ARGUMENTS)
        raise ValueError(f"{missing}: expected a tensor when {other} is given (or neither), got None")
    if fragment_documents is not None and cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q: expected the fragments' [F + 1] boundaries when fragment_documents is given, "
                         "got None")
    return fragment_documents, fragment_starts


def _rows(name, x, layout) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name}: expected a tensor {layout}, got a 0-D tensor")
    return x.shape[0]


def _attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, topk,
                             softmax_scale) -> _DocumentArgs:
    return _document_args(_rows("q", q, "[Tq, Hq, D]"), _rows("k", k, "[Tk, Hkv, D]"), q.device,
                          cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, topk, softmax_scale)


def _scale(q, softmax_scale) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def select_blocks(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    topk: int = DEFAULT_TOPK,
    block_size: int = DEFAULT_BLOCK_SIZE,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Choose the key blocks each query attends to (the MSA index branch's selection).

    Scores `Di^-0.5 <index_q[t, r], index_k[j]>` in fp32 over the visible keys `j <= p(t)`,
    max-pools them per block, and keeps the `min(topk - 1, nvb - 1)` best non-local blocks (lower
    id first on ties) then the local block `nvb - 1`, where `nvb = p(t) // block_size + 1`.

    Args:
        index_q: `[Tq, Hi, Di]` index queries, bf16/fp16/fp32/fp64, `Di >= 1`.
        index_k: `[Tk, 1, Di]` index keys (one shared index head), index_q's dtype and device.
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]` boundaries (`cu_seqlens_q` `[F + 1]` with
            fragments), both or neither (one document).
        max_seqlen_q, max_seqlen_k: host ints bounding the documents; default `Tq` and `Tk`.
        topk: blocks kept per query, the local one included, `>= 1`.
        block_size: keys per block, 64 or 128.
        fragment_documents, fragment_starts: int32 `[F]` query fragments, both or neither.

    Returns:
        int32 `[Hi, Tq, topk]`: per (index head, query) the document-local block ids, valid ids
        first, `-1` after. Not differentiable.

    Raises:
        TypeError, ValueError: an argument outside the contract, named in the message (values are
            checked only by `validate_inputs` and `TORCH_MSA_DEBUG=1`).
        torch_msa.BackendError: `TORCH_MSA_BACKEND` forces a backend that cannot serve the device.
    """
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    docs = _document_args(_rows("index_q", index_q, "[Tq, Hi, Di]"), _rows("index_k", index_k, "[Tk, 1, Di]"),
                          index_q.device, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, topk)
    return torch.ops.msa.select_blocks(index_q.detach(), index_k.detach(), *docs, topk, block_size, *fragments)


def build_plan(
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    num_keys: int,
    num_heads: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The key-to-query schedule of `block_indices`, to share between `sparse_attention` calls.

    Args:
        block_indices: int32 `[Hkv, Tq, topk]`, e.g. from `select_blocks`.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: the documents, as in
            `select_blocks` (`max_seqlen_k` defaults to `num_keys`).
        num_keys: `Tk`, rows of the packed keys, `>= 0`.
        num_heads: `Hq`, query heads, `>= 1`.
        block_size: keys per block, 64 or 128.
        fragment_documents, fragment_starts: int32 `[F]` query fragments, as in `select_blocks`.

    Returns:
        A 1-D int32 tensor on block_indices' device (layout in `torch_msa/plan/schedule.py`),
        valid for these `block_indices`, documents, `Tk` and `block_size`. Only its length is
        checked per call; a stale plan is caught by `TORCH_MSA_DEBUG=1` and `validate_inputs`.

    Raises:
        TypeError, ValueError: an argument outside the contract, named in the message (values are
            checked only by `validate_inputs` and `TORCH_MSA_DEBUG=1`).
        torch_msa.BackendError: `TORCH_MSA_BACKEND` forces a backend that cannot serve the device.
    """
    _rows("block_indices", block_indices, "[Hkv, Tq, topk]")
    # Checked before num_keys stands in for max_seqlen_k's default.
    validation.check_host_int("num_keys", num_keys, 0)
    validation.check_host_int("num_heads", num_heads, 1)
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    num_queries = block_indices.shape[1] if block_indices.dim() == 3 else 0  # msa::plan names a wrong rank
    docs = _document_args(num_queries, num_keys, block_indices.device, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, block_size)
    return torch.ops.msa.plan(block_indices, *docs, num_keys, block_size,
                              entries_per_item(num_heads, block_indices.shape[0]), *fragments)


def _plan_for(q, k, block_indices, docs, block_size, fragments) -> torch.Tensor:
    return torch.ops.msa.plan(block_indices, *docs, k.shape[0], block_size, entries_per_item(q.shape[1], k.shape[1]),
                              *fragments)


@overload
def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    block_size: int = ..., softmax_scale: float | None = ..., return_lse: Literal[False] = ...,
    plan: torch.Tensor | None = ..., fragment_documents: torch.Tensor | None = ...,
    fragment_starts: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    block_size: int = ..., softmax_scale: float | None = ..., return_lse: Literal[True],
    plan: torch.Tensor | None = ..., fragment_documents: torch.Tensor | None = ...,
    fragment_starts: torch.Tensor | None = ...,
) -> AttentionOutput: ...


@overload
def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    block_size: int = ..., softmax_scale: float | None = ..., return_lse: bool = ...,
    plan: torch.Tensor | None = ..., fragment_documents: torch.Tensor | None = ...,
    fragment_starts: torch.Tensor | None = ...,
) -> torch.Tensor | AttentionOutput: ...


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    plan: torch.Tensor | None = None,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> torch.Tensor | AttentionOutput:
    """Attention of each query over the keys of its selected blocks (causal inside the local one).

    Query head `h` uses KV head `r = h // (Hq // Hkv)` and the blocks in `block_indices[r, t]`.

    Args:
        q: `[Tq, Hq, D]` queries, bf16/fp16/fp32/fp64, `D` 64 or 128.
        k, v: `[Tk, Hkv, D]` keys and values, q's dtype and device, `Hq % Hkv == 0`.
        block_indices: int32 `[Hkv, Tq, topk]`, e.g. from `select_blocks`; read as a set, `-1`
            slots skipped.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as in `select_blocks`.
        block_size: keys per block, 64 or 128.
        softmax_scale: defaults to `D ** -0.5`.
        return_lse: also return the log-sum-exp.
        plan: from `build_plan` on the same `block_indices` and documents; by default built here
            when autograd records the call (the backward walks it too), else by the forward.
        fragment_documents, fragment_starts: int32 `[F]` query fragments, as in `select_blocks`.

    Returns:
        `out [Tq, Hq, D]` in q's dtype; with `return_lse`, `AttentionOutput(out, lse)`.
        Differentiable in q, k, v, through `lse` too; a query that reads no key gets `out = 0`.

    Raises:
        TypeError, ValueError: an argument (a plan of the wrong length too), named in the
            message (values are checked only by `validate_inputs` and `TORCH_MSA_DEBUG=1`).
        torch_msa.BackendError: `TORCH_MSA_BACKEND` forces a backend that cannot serve the device.
    """
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    docs = _attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, None, softmax_scale)
    validation.check_optional_tensor("plan", plan, "from build_plan")
    if plan is None and _ops.differentiated((q, k, v)):
        # Built here once, the plan serves the backward too. A call autograd does not record
        # leaves it to the forward, which builds only what it walks (with its query-outer part,
        # the KV-outer part's plan, not the whole selection's restricted).
        plan = _plan_for(q, k, block_indices, docs, block_size, fragments)
    out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, block_size, _scale(q, softmax_scale), plan, *fragments)
    return AttentionOutput(out, lse) if return_lse else out


_warned_untrained_index = False


def _warn_index_inputs_get_no_gradient(index_q, index_k) -> None:
    global _warned_untrained_index
    if _warned_untrained_index or torch.compiler.is_compiling():
        return
    if index_q.requires_grad or index_k.requires_grad:
        _warned_untrained_index = True
        warnings.warn(
            "torch_msa.msa_attention: index_q / index_k require grad, but the block selection is not "
            "differentiable and they get no gradient from the attention. Train the index branch with "
            "msa_attention(..., index_loss=True) (its kl field), torch_msa.indexer_kl_loss, "
            "or torch_msa.indexer_kl_loss_dense for the dense warm-up; see the README, 'Training the index branch'.",
            category=TorchMSAWarning, stacklevel=3,
        )


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[False] = ..., return_block_indices: Literal[False] = ...,
    index_loss: Literal[False] = ...,
    fragment_documents: torch.Tensor | None = ..., fragment_starts: torch.Tensor | None = ...,
    index_loss_value: None = ...,
) -> torch.Tensor: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[True], return_block_indices: Literal[False] = ...,
    index_loss: Literal[False] = ...,
    fragment_documents: torch.Tensor | None = ..., fragment_starts: torch.Tensor | None = ...,
    index_loss_value: None = ...,
) -> AttentionOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[False] = ..., return_block_indices: Literal[True],
    index_loss: Literal[False] = ...,
    fragment_documents: torch.Tensor | None = ..., fragment_starts: torch.Tensor | None = ...,
    index_loss_value: None = ...,
) -> MSABlocksOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[True], return_block_indices: Literal[True],
    index_loss: Literal[False] = ...,
    fragment_documents: torch.Tensor | None = ..., fragment_starts: torch.Tensor | None = ...,
    index_loss_value: None = ...,
) -> MSALseBlocksOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[False] = ..., return_block_indices: Literal[False] = ...,
    index_loss: Literal[True],
    fragment_documents: torch.Tensor | None = ..., fragment_starts: torch.Tensor | None = ...,
    index_loss_value: torch.Tensor | None = ...,
) -> MSAIndexLossOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[True], return_block_indices: Literal[False] = ...,
    index_loss: Literal[True],
    fragment_documents: torch.Tensor | None = ..., fragment_starts: torch.Tensor | None = ...,
    index_loss_value: torch.Tensor | None = ...,
) -> MSALseIndexLossOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[False] = ..., return_block_indices: Literal[True],
    index_loss: Literal[True],
    fragment_documents: torch.Tensor | None = ..., fragment_starts: torch.Tensor | None = ...,
    index_loss_value: torch.Tensor | None = ...,
) -> MSABlocksIndexLossOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[True], return_block_indices: Literal[True],
    index_loss: Literal[True],
    fragment_documents: torch.Tensor | None = ..., fragment_starts: torch.Tensor | None = ...,
    index_loss_value: torch.Tensor | None = ...,
) -> MSAAttentionOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = ..., cu_seqlens_k: torch.Tensor | None = ...,
    max_seqlen_q: int | None = ..., max_seqlen_k: int | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: bool = ..., return_block_indices: bool = ..., index_loss: bool = ...,
    fragment_documents: torch.Tensor | None = ..., fragment_starts: torch.Tensor | None = ...,
    index_loss_value: torch.Tensor | None = ...,
) -> torch.Tensor | MSAResult: ...


def msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    topk: int = DEFAULT_TOPK,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    return_block_indices: bool = False,
    index_loss: bool = False,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
    index_loss_value: torch.Tensor | None = None,
) -> torch.Tensor | MSAResult:
    """MiniMax Sparse Attention: `select_blocks` (no gradient) then `sparse_attention`.

    With `index_loss=True` the result's `kl` is the index loss (`indexer_kl_loss` with the student
    scale `Di ** -0.5`) on this call's own selection and lse; its gradients reach `index_q` and
    `index_k` only. Without it, index inputs that require grad get a one-time warning. In training
    `kl` is a placeholder of value 0 whose loss the backward computes: use it linearly
    (`loss + c * kl`), and read the value from `kl_value` after the backward (docs/api.md).

    Args:
        q: `[Tq, Hq, D]` queries, bf16/fp16/fp32/fp64, `D` 64 or 128.
        k, v: `[Tk, Hkv, D]` keys and values, q's dtype and device, `Hq % Hkv == 0`.
        index_q: `[Tq, Hkv, Di]` index queries, any float dtype (not necessarily q's), q's device.
        index_k: `[Tk, 1, Di]` index keys, index_q's dtype.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as in `select_blocks`.
        topk: blocks read per query, the local one included, `>= 1`.
        block_size: keys per block, 64 or 128.
        softmax_scale: defaults to `D ** -0.5`.
        return_lse, return_block_indices, index_loss: bools: return the lse, the selection, the
            index loss too.
        fragment_documents, fragment_starts: int32 `[F]` query fragments, as in `select_blocks`.
        index_loss_value: with `index_loss`, a 0-D tensor (fp32, fp64 for fp64 index inputs, on
            q's device) that receives the loss's value and is returned as `kl_value`; needed
            for the fused loss under `torch.compile`; by default made here.

    Returns:
        Without a flag, `out [Tq, Hq, D]` in q's dtype. With any, the named tuple of `out` and
        the fields asked for, in `MSAAttentionOutput`'s order (`out, lse, block_indices, kl,
        kl_value`).

    Raises:
        TypeError, ValueError: an argument outside the contract (`index_loss` not a bool,
            `index_loss_value` without `index_loss`, not 0-D or under a torch.func transform
            included), named in the message.
        torch_msa.BackendError: `TORCH_MSA_BACKEND` forces a backend that cannot serve the device.
    """
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    docs = _attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, topk, softmax_scale)
    validation.check_index_inputs(index_q, index_k, q, k)
    if not isinstance(index_loss, bool):  # HF's use_torch_msa spells its index_loss as a string
        raise TypeError(f"index_loss: expected a bool, got {type(index_loss).__name__} {index_loss!r}")
    if index_loss_value is not None:
        if not index_loss:
            raise ValueError("index_loss_value: given without index_loss=True (it receives the index loss's value)")
        validation.check_loss_value(index_loss_value, index_q, q, "index_loss_value")
    if not index_loss:
        _warn_index_inputs_get_no_gradient(index_q, index_k)
    block_indices = torch.ops.msa.select_blocks(index_q.detach(), index_k.detach(), *docs, topk, block_size, *fragments)
    plan = _plan_for(q, k, block_indices, docs, block_size, fragments)
    scale = _scale(q, softmax_scale)
    losses: dict[str, torch.Tensor] = {}
    if index_loss:
        out, lse, kl, kl_value = attention_with_index_loss(q, k, v, index_q, index_k, block_indices, docs,
                                                            block_size, scale, plan, fragments, index_loss_value)
        losses = {"kl": kl, "kl_value": kl_value}
    else:
        out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, block_size, scale, plan, *fragments)
    return _msa_result(out, return_lse=return_lse, return_block_indices=return_block_indices, index_loss=index_loss,
                       lse=lse, block_indices=block_indices, **losses)


def _index_scale(index_q, index_softmax_scale) -> float:
    if index_softmax_scale is None:
        return index_q.shape[-1] ** -0.5
    validation.check_scale("index_softmax_scale", index_softmax_scale)
    return index_softmax_scale


def indexer_kl_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softmax_scale: float | None = None,
    index_softmax_scale: float | None = None,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The index loss: KL distillation of the attention into the index branch over the selection.

    For query `t` and index head `r`, on `J(t, r)`, the visible keys of `block_indices[r, t]`:
    teacher `P_t = mean over the query heads of KV head r of exp(softmax_scale <q, k> - lse)`;
    student `P_s = softmax over J of index_softmax_scale <index_q[t, r], index_k[j]>`.

    Args:
        q: `[Tq, Hq, D]` and k: `[Tk, Hkv, D]`: the main branch's queries and keys
            (bf16/fp16/fp32/fp64, one dtype).
        lse: `[Tq, Hq]`, the attention's `lse` (fp32; fp64 for fp64 q).
        index_q: `[Tq, Hkv, Di]` index queries; index_k: `[Tk, 1, Di]`, index_q's dtype.
        block_indices: int32 `[Hkv, Tq, topk]`, the selection the attention used.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as in `select_blocks`.
        block_size: keys per block, 64 or 128.
        softmax_scale: the attention's, defaults to `D ** -0.5`.
        index_softmax_scale: the student's, defaults to `Di ** -0.5`.
        fragment_documents, fragment_starts: int32 `[F]` query fragments, as in `select_blocks`.

    Returns:
        A 0-D tensor, fp32 (fp64 for fp64 index inputs): the mean over `(t, r)` of
        `KL(P_t || P_s)`, 0 when `Tq == 0`. Gradients flow to `index_q` and `index_k` only.

    Raises:
        TypeError, ValueError: an argument outside the contract, named in the message (values are
            checked only by `validate_inputs` and `TORCH_MSA_DEBUG=1`).
        torch_msa.BackendError: `TORCH_MSA_BACKEND` forces a backend that cannot serve the device.
    """
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    docs = _attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, None, softmax_scale)
    if not isinstance(block_indices, torch.Tensor):
        raise TypeError(f"block_indices: expected a torch.Tensor [Hkv, Tq, topk], got {type(block_indices).__name__}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse: expected a torch.Tensor [Tq, Hq], got {type(lse).__name__}")
    loss, *_ = torch.ops.msa.indexer_kl(q, k, lse, index_q, index_k, block_indices, *docs, block_size,
                                        _scale(q, softmax_scale), _index_scale(index_q, index_softmax_scale),
                                        *fragments)
    return loss


def indexer_kl_loss_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    lse: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softmax_scale: float | None = None,
    index_softmax_scale: float | None = None,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The index loss over the full causal support (every key `j <= p(t)`), for the dense warm-up.

    Args:
        q, k, index_q, index_k: as in `indexer_kl_loss`.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as in `select_blocks`.
        lse: `[Tq, Hq]`, the dense causal attention's log-sum-exp; computed here when omitted.
        block_size: sizes the key spans only, 64 or 128.
        softmax_scale, index_softmax_scale: as in `indexer_kl_loss`.
        fragment_documents, fragment_starts: int32 `[F]` query fragments, as in `select_blocks`.

    Returns:
        A 0-D tensor as `indexer_kl_loss` returns it; gradients flow to `index_q` and `index_k`
        only.

    Raises:
        TypeError, ValueError, torch_msa.BackendError: as `indexer_kl_loss` raises them.
    """
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    docs = _attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, None, softmax_scale)
    validation.check_optional_tensor("lse", lse, "[Tq, Hq]")
    loss, *_ = torch.ops.msa.indexer_kl(q, k, lse, index_q, index_k, None, *docs, block_size,
                                        _scale(q, softmax_scale), _index_scale(index_q, index_softmax_scale),
                                        *fragments)
    return loss


def validate_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    index_q: torch.Tensor | None = None,
    index_k: torch.Tensor | None = None,
    plan: torch.Tensor | None = None,
    topk: int = DEFAULT_TOPK,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softmax_scale: float | None = None,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> None:
    """Check every input the way `TORCH_MSA_DEBUG=1` does, values included (host sync; eager only).

    Args:
        q, k, v: as in `sparse_attention`.
        block_indices: int32 `[Hkv, Tq, topk]`: valid prefix then `-1`, distinct, `< nvb`, local
            block last.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: as in `select_blocks`.
        index_q, index_k: as in `msa_attention`, both or neither.
        plan: from `build_plan`, with `block_indices`: built for this selection and documents.
        topk, block_size, softmax_scale: as in `msa_attention`.
        fragment_documents, fragment_starts: int32 `[F]` query fragments, as in `select_blocks`.

    Returns:
        None: the inputs honour the contract.

    Raises:
        TypeError, ValueError: the first breach of the contract, naming the argument with the
            expected and the actual value.
    """
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    documents = Documents(*_attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                    block_size, topk, softmax_scale), *fragments)
    validation.check_attention(q, k, v, documents, block_size, _scale(q, softmax_scale))
    if block_indices is not None:
        validation.check_block_indices(block_indices, q, k)
    if (index_q is None) != (index_k is None):
        missing = "index_k" if index_k is None else "index_q"
        raise ValueError(f"{missing}: expected a tensor when the other index input is given, got None")
    if index_q is not None:
        validation.check_index_inputs(index_q, index_k, q, k)
        validation.check_select_blocks(index_q, index_k, documents, topk, block_size)
    validation.check_optional_tensor("plan", plan, "from build_plan")
    if plan is not None:
        if block_indices is None:
            raise ValueError("block_indices: expected the selection the plan was built for when plan is given, got None")
        validation.check_plan(plan, block_indices, k.shape[0], documents.num_documents, block_size)
    validation.check_values(documents, q.shape[0], k.shape[0], block_indices, block_size)
    if plan is not None:
        validation.check_plan_values(plan, block_indices, documents, k.shape[0], block_size)
