"""The public Python API: typed wrappers over `torch.ops.msa.*` with the M3 defaults.

Layouts (packed tokens, documents delimited by int32 `cu_seqlens`):

* `q [Tq, Hq, D]`, `k, v [Tk, Hkv, D]`: bf16, fp16, fp32 or fp64; `Hq % Hkv == 0`, `D in {64, 128}`.
* `index_q [Tq, Hi, Di]` with `Hi == Hkv`, `index_k [Tk, 1, Di]`: one shared index key per token.
* `block_indices [Hkv, Tq, topk]` int32: per (KV head, query) block ids, valid ids first, `-1` after.
* `cu_seqlens_q, cu_seqlens_k [B + 1]` int32; omitted, the inputs are one document. Queries are
  the causal suffix of their document's keys (`p(t) = Lk - Lq + t`).
* `fragment_documents, fragment_starts [F]` int32 (keyword, both or neither): query *fragments*
  for context parallelism. `cu_seqlens_q [F + 1]` then delimits fragments and `cu_seqlens_k
  [B + 1]` documents; fragment `f` belongs to document `fragment_documents[f]`, and its first
  query sits at the document-local position `fragment_starts[f]`, so its query `i` sees the
  document's keys `j <= fragment_starts[f] + i`. Several fragments may share one document's keys
  (stored once). `max_seqlen_q` bounds the fragments. Block ids stay document-local.
* `max_seqlen_q, max_seqlen_k`: host ints; omitted, they default to the token counts `Tq`, `Tk`
  (always a valid bound, but a looser one for packs of short documents: pass the real values when
  you have them).

Every function traces under `torch.compile(fullgraph=True)` and `torch.export` without a graph
break or a host sync.
"""

import warnings

import torch

from . import ops as _ops  # noqa: F401  (registers torch.ops.msa.*)
from . import validation
from .contract import DEFAULT_BLOCK_SIZE, DEFAULT_TOPK
from .diagnostics import TorchMSAWarning
from .schedule import entries_per_item


def _document_args(num_queries, num_keys, device, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               block_size, topk=None, softmax_scale=None):
    """Fill the document defaults and check the host arguments; returns the ops' four document args."""
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


def _fragments(fragment_documents, fragment_starts, cu_seqlens_q):
    """The ops' two trailing fragment arguments, checked to come together with `cu_seqlens`."""
    for name, x in (("fragment_documents", fragment_documents), ("fragment_starts", fragment_starts)):
        validation.check_optional_tensor(name, x, "int32 [F]")
    if (fragment_documents is None) != (fragment_starts is None):
        missing = "fragment_starts" if fragment_starts is None else "fragment_documents"
        other = "fragment_documents" if fragment_starts is None else "fragment_starts"
        raise ValueError(f"{missing}: expected a tensor when {other} is given (or neither), got None")
    if fragment_documents is not None and cu_seqlens_q is None:
        raise ValueError("cu_seqlens_q: expected the fragments' [F + 1] boundaries when fragment_documents is given, "
                         "got None")
    return fragment_documents, fragment_starts


def _rows(name, x, layout):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{name}: expected a tensor {layout}, got a 0-D tensor")
    return x.shape[0]


def _attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, topk, softmax_scale):
    return _document_args(_rows("q", q, "[Tq, Hq, D]"), _rows("k", k, "[Tk, Hkv, D]"), q.device,
                      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, topk, softmax_scale)


def _scale(q, softmax_scale):
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
    max-pools them per block, and keeps the `min(topk - 1, nvb - 1)` best non-local visible
    blocks (lower id first on ties) followed by the local block `nvb - 1`, where
    `nvb = p(t) // block_size + 1`.

    Args:
        index_q: `[Tq, Hi, Di]` index queries (bf16/fp16/fp32/fp64).
        index_k: `[Tk, 1, Di]` index keys, same dtype.

    Returns:
        int32 `[Hi, Tq, topk]`; valid ids first, `-1` padding after. Not differentiable.
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
    """The key-to-query schedule of `block_indices`, to build once and pass to `sparse_attention`.

    `sparse_attention` builds one per call when given none, and its backward reuses it; build it
    yourself to share it between calls on the same selection and documents (for example
    several attention calls of one layer and step).

    Args:
        block_indices: int32 `[Hkv, Tq, topk]`.
        num_keys: `Tk`, rows of the packed keys; num_heads: `Hq`, query heads (they size the
            plan's work items).

    Returns:
        A 1-D int32 tensor (`msa::plan`; layout in `torch_msa/schedule.py`), valid for calls with
        these `block_indices`, documents, `Tk` and `block_size`. Every call checks its length
        against the shapes; a plan of the same shapes built for another selection or other
        documents (a stale plan) is caught only by `TORCH_MSA_DEBUG=1` and
        `validate_inputs(..., plan=plan)`: otherwise the kernels compute the plan's selection.
    """
    _rows("block_indices", block_indices, "[Hkv, Tq, topk]")
    # Checked before they stand in for defaults (max_seqlen_k defaults to num_keys).
    validation.check_host_int("num_keys", num_keys, 0)
    validation.check_host_int("num_heads", num_heads, 1)
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    num_queries = block_indices.shape[1] if block_indices.dim() == 3 else 0  # msa::plan names a wrong rank
    docs = _document_args(num_queries, num_keys, block_indices.device, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k, block_size)
    return torch.ops.msa.plan(block_indices, *docs, num_keys, block_size,
                              entries_per_item(num_heads, block_indices.shape[0]), *fragments)


def _plan_for(q, k, block_indices, docs, block_size, fragments):
    return torch.ops.msa.plan(block_indices, *docs, k.shape[0], block_size, entries_per_item(q.shape[1], k.shape[1]),
                              *fragments)


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
):
    """Attention of each query over the keys of its selected blocks (causal inside the local one).

    Query head `h` uses KV head `r = h // (Hq // Hkv)` and the blocks in `block_indices[r, t]`.

    Args:
        q: `[Tq, Hq, D]`; k, v: `[Tk, Hkv, D]`, same dtype.
        block_indices: int32 `[Hkv, Tq, topk]`, e.g. from `select_blocks`.
        softmax_scale: defaults to `D ** -0.5`.
        return_lse: also return the log-sum-exp.
        plan: from `build_plan` on the same `block_indices` and documents; by default one is
            built here. Either way the backward reuses it.

    Returns:
        `out [Tq, Hq, D]` in q's dtype, or `(out, lse)` with `lse [Tq, Hq]` (natural log, fp32;
        fp64 for fp64 inputs). Differentiable in q, k, v, including through `lse`.
    """
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    docs = _attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, None, softmax_scale)
    validation.check_optional_tensor("plan", plan, "from build_plan")
    if plan is None:
        plan = _plan_for(q, k, block_indices, docs, block_size, fragments)
    out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, block_size, _scale(q, softmax_scale), plan, *fragments)
    return (out, lse) if return_lse else out


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
            "torch_msa.indexer_kl_loss (pass return_lse=True, return_block_indices=True to get its inputs), "
            "or torch_msa.indexer_kl_loss_dense for the dense warm-up; see the README, 'Training the index branch'.",
            category=TorchMSAWarning, stacklevel=3,
        )


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
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
):
    """MiniMax Sparse Attention: `select_blocks` (no gradient) then `sparse_attention`.

    Shapes as in `select_blocks` and `sparse_attention`, with `Hi == Hkv`. Returns `out [Tq, Hq, D]`;
    with `return_lse` and/or `return_block_indices`, a tuple `(out, lse?, block_indices?)` in that
    order: `lse [Tq, Hq]` as in `sparse_attention` and the int32 `block_indices [Hkv, Tq, topk]`
    used, the inputs of `indexer_kl_loss` without recomputing the selection.

    `index_q` and `index_k` receive no gradient here (a one-time warning says so when they
    require grad): the index branch is trained with `indexer_kl_loss`.
    """
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    docs = _attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, topk, softmax_scale)
    validation.check_index_inputs(index_q, index_k, q, k)
    _warn_index_inputs_get_no_gradient(index_q, index_k)
    block_indices = torch.ops.msa.select_blocks(index_q.detach(), index_k.detach(), *docs, topk, block_size, *fragments)
    plan = _plan_for(q, k, block_indices, docs, block_size, fragments)
    out, lse = torch.ops.msa.forward(q, k, v, block_indices, *docs, block_size, _scale(q, softmax_scale), plan, *fragments)
    if not (return_lse or return_block_indices):
        return out
    return (out,) + ((lse,) if return_lse else ()) + ((block_indices,) if return_block_indices else ())


def _index_scale(index_q, index_softmax_scale):
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
    """The index branch's KL distillation loss over the selected support.

    For query `t` and index head `r`, on `J(t, r)` (the visible keys of `block_indices[r, t]`, read
    as a set like the attention does): teacher `P_t = mean over the G query heads of KV head r of
    exp(softmax_scale <q, k> - lse)`, the main attention's probabilities; student
    `P_s = softmax over J of index_softmax_scale <index_q[t, r], index_k[j]>`.

    Args:
        q: `[Tq, Hq, D]`, k: `[Tk, Hkv, D]`: the main branch's queries and keys (bf16/fp16/fp32/fp64).
        lse: `[Tq, Hq]` from `sparse_attention(..., return_lse=True)` or
            `msa_attention(..., return_lse=True)` (fp32; fp64 for fp64 q).
        index_q: `[Tq, Hi, Di]` with `Hi == Hkv`; index_k: `[Tk, 1, Di]` (same dtype as each other).
        block_indices: int32 `[Hkv, Tq, topk]`, the selection the attention used.
        softmax_scale: the attention's, defaults to `D ** -0.5`; index_softmax_scale: defaults
            to `Di ** -0.5`.

    Returns:
        A 0-D tensor, fp32 (fp64 for fp64 index inputs): the mean over `(t, r)` of
        `KL(P_t || P_s)`, 0 when `Tq == 0`. Gradients flow to `index_q` and `index_k` only: the
        teacher (`q`, `k`, `lse`) is a constant of this loss.
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
    """The same loss over the full causal support, for the dense warm-up stage.

    `J(t, r)` is every key `j <= p(t)` of `t`'s document, and the teacher is the dense causal
    attention's probabilities. `lse` (`[Tq, Hq]`, natural log) is that attention's
    log-sum-exp when the caller has it; omitted, it is computed here (public SDPA does not return
    it). Memory stays bounded: queries in chunks, keys in spans, never a `T x T` buffer.
    `block_size` only sizes the key spans. Returns a 0-D tensor as `indexer_kl_loss` does;
    gradients flow to `index_q` and `index_k` only.
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
    """Check every input the way `TORCH_MSA_DEBUG=1` does, including values (host sync).

    Raises `ValueError`/`TypeError` naming the first offending argument: shapes, dtypes and
    devices; `cu_seqlens` starting at 0, non-decreasing, ending at the token counts, `Lq <= Lk`
    per document (with fragments: each names a document and fits in it) and `max_seqlen_*` large
    enough; and, when given, the block-id contract of
    `block_indices` (valid prefix then `-1`, distinct, `< nvb`, local block last), the index
    inputs, and a `plan` (which needs `block_indices`): its length, and that it was built for this
    selection and these documents (a stale plan of the same shapes would make the kernels compute
    the plan's own selection). Use it in eager code when debugging; it is not meant for compiled
    regions.
    """
    fragments = _fragments(fragment_documents, fragment_starts, cu_seqlens_q)
    docs = _attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, topk, softmax_scale)
    validation.check_attention(q, k, v, *docs, block_size, _scale(q, softmax_scale), *fragments)
    if block_indices is not None:
        validation.check_block_indices(block_indices, q, k)
    if (index_q is None) != (index_k is None):
        missing = "index_k" if index_k is None else "index_q"
        raise ValueError(f"{missing}: expected a tensor when the other index input is given, got None")
    if index_q is not None:
        validation.check_index_inputs(index_q, index_k, q, k)
        validation.check_select_blocks(index_q, index_k, *docs, topk, block_size, *fragments)
    validation.check_optional_tensor("plan", plan, "from build_plan")
    if plan is not None:
        if block_indices is None:
            raise ValueError("block_indices: expected the selection the plan was built for when plan is given, got None")
        validation.check_plan(plan, block_indices, k.shape[0], docs[1].shape[0] - 1, block_size)
    validation.check_values(docs[0], docs[1], q.shape[0], k.shape[0], docs[2], docs[3], block_indices, block_size,
                            *fragments)
    if plan is not None:
        validation.check_plan_values(plan, block_indices, docs[0], docs[1], k.shape[0], block_size, *fragments)
