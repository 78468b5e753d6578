"""Input checks of the MSA ops.

`check_*` read metadata only (no host sync) and run on every call, real and fake kernels alike;
`check_values` / `check_plan_values` read contents (a host sync) under `TORCH_MSA_DEBUG=1` and in
`torch_msa.validate_inputs`. Messages name the argument, the expected and the given value.
"""

import math

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .contract import FLOAT_DTYPES, INDEX_DTYPE, SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS, compute_dtype
from .documents import FRAGMENT_ARGUMENTS, Documents
from .plan.schedule import item_rows, length_error, unpack, valid_entries
from .settings import flag

DEBUG_ENV = "TORCH_MSA_DEBUG"


def debug_enabled() -> bool:
    """True when `TORCH_MSA_DEBUG` asks for the value checks on every op call."""
    return flag(DEBUG_ENV)


def _concrete(value):
    """A size for a message, as a plain int where one is known: while tracing with dynamic shapes
    it shows the value of the example being traced rather than a symbol such as `s0`."""
    if isinstance(value, torch.SymInt):  # fake kernels: the hint, if the size has one
        hint = value.node.hint
        return value if hint is None else int(hint)
    # Under Dynamo a symbolic size passes for an int; int() specialises it, which is harmless on
    # the way to raising.
    return int(value)


def _sizes(sizes) -> str:
    # f-strings, not str(list): Dynamo formats a specialised size only through format().
    return "[" + ", ".join([f"{_concrete(size)}" for size in sizes]) + "]"


def _shape(x: torch.Tensor) -> str:
    return _sizes(x.shape)


def _tensor(name: str, x, rank: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-D tensor {layout}, got shape {_shape(x)}")


def _dtype(name: str, x: torch.Tensor, allowed, what: str) -> None:
    if x.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype {what}, got {x.dtype}")


def _same_device(name: str, x: torch.Tensor, reference_name: str, reference: torch.Tensor) -> None:
    if x.device != reference.device:
        raise ValueError(f"{name}: expected device {reference.device} (the device of {reference_name}), got {x.device}")


def _dim(name: str, actual, expected, what: str) -> None:
    if actual != expected:
        raise ValueError(f"{name}: expected {what} {_concrete(expected)}, got {_concrete(actual)}")


def _float_tensor(name: str, x, layout: str) -> None:
    _tensor(name, x, 3, layout)
    _dtype(name, x, FLOAT_DTYPES, "bfloat16, float16, float32 or float64")


_INT64_MAX = 2**63 - 1  # the ops' `int` / `SymInt` arguments are int64


def check_host_int(name: str, value, minimum: int) -> None:
    # An eager call's plain int: two comparisons, no symbolic dispatch. (Under Dynamo a symbolic
    # size passes for an int, and needs the checks below.)
    if type(value) is int and not torch.compiler.is_compiling():
        if value < minimum:
            raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
        if value > _INT64_MAX:
            raise ValueError(f"{name}: expected an int <= 2**63 - 1 (an int64), got {value}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if guard_or_false(value < minimum):
        raise ValueError(f"{name}: expected an int >= {minimum}, got {_concrete(value)}")
    if guard_or_false(value > _INT64_MAX):
        raise ValueError(f"{name}: expected an int <= 2**63 - 1 (an int64), got {value}")
    if isinstance(value, torch.SymInt):
        # A data-dependent value (`.item()` in a compiled region) is unknown while tracing: the
        # bound becomes a check of the running graph instead of a guard that cannot be decided.
        # No message function: Dynamo (torch <= 2.11) cannot trace one that closes over locals.
        torch._check(value >= minimum)


def _block_size(block_size) -> None:
    check_host_int("block_size", block_size, 1)
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size: expected one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")


def check_scale(name: str, value) -> None:
    """A softmax scale: a finite Python float (or int)."""
    if isinstance(value, bool) or not isinstance(value, (float, int)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite float, got {value}")


def check_optional_tensor(name: str, value, layout: str) -> None:
    """A tensor argument that may be None; anything else would reach the dispatcher, whose
    error names neither the expectation nor the fix."""
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout} or None, got {type(value).__name__}")


def check_host_args(max_seqlen_q, max_seqlen_k, block_size, topk=None, softmax_scale=None) -> None:
    """The non-tensor arguments, checked by the public API too since the dispatcher's type errors
    name no fix; `None` skips `topk` / `softmax_scale`."""
    check_host_int("max_seqlen_q", max_seqlen_q, 0)
    check_host_int("max_seqlen_k", max_seqlen_k, 0)
    _block_size(block_size)
    if topk is not None:
        check_host_int("topk", topk, 1)
    if softmax_scale is not None:
        check_scale("softmax_scale", softmax_scale)


def _documents(documents: Documents, anchor_name, anchor) -> None:
    cu_seqlens_q, cu_seqlens_k = documents.cu_seqlens_q, documents.cu_seqlens_k
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _tensor(name, cu, 1, "[B + 1]")
        _dtype(name, cu, (INDEX_DTYPE,), "int32")
        _same_device(name, cu, anchor_name, anchor)
        if cu.shape[0] < 1:
            raise ValueError(f"{name}: expected at least one boundary ([B + 1] with B >= 0), got shape {_shape(cu)}")
    if not documents.has_fragments:
        if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
            raise ValueError(
                f"cu_seqlens_k: expected {_concrete(cu_seqlens_q.shape[0])} boundaries (as many as cu_seqlens_q), "
                f"got {_concrete(cu_seqlens_k.shape[0])}"
            )
        return
    for name, x, other in zip(FRAGMENT_ARGUMENTS, documents.fragments, reversed(FRAGMENT_ARGUMENTS)):
        if x is None:
            raise ValueError(f"{name}: expected a tensor when {other} is given (or neither), got None")
        _tensor(name, x, 1, "[F] (one entry per query fragment of cu_seqlens_q)")
        _dtype(name, x, (INDEX_DTYPE,), "int32")
        _same_device(name, x, anchor_name, anchor)
        if x.shape[0] != cu_seqlens_q.shape[0] - 1:
            raise ValueError(
                f"{name}: expected F = {_concrete(cu_seqlens_q.shape[0] - 1)} entries (one per fragment of "
                f"cu_seqlens_q), got {_concrete(x.shape[0])}"
            )


def check_select_blocks(index_q, index_k, documents: Documents, topk, block_size) -> None:
    """Metadata checks of `msa::select_blocks` (no host sync)."""
    _index_tensors(index_q, index_k)
    _documents(documents, "index_q", index_q)
    check_host_args(documents.max_seqlen_q, documents.max_seqlen_k, block_size, topk=topk)


def _index_tensors(index_q, index_k) -> None:
    """`index_q [Tq, Hi, Di]` and `index_k [Tk, 1, Di]`: one float dtype, one device, one Di."""
    _float_tensor("index_q", index_q, "[Tq, Hi, Di]")
    _float_tensor("index_k", index_k, "[Tk, 1, Di]")
    _dim("index_k.shape[1]", index_k.shape[1], 1, "one shared index key head:")
    _dim("index_k.shape[2]", index_k.shape[2], index_q.shape[2], "the index head dim of index_q,")
    if index_q.shape[1] < 1:
        raise ValueError(f"index_q: expected at least one index head, got shape {_shape(index_q)}")
    if index_q.shape[2] < 1:
        raise ValueError(f"index_q: expected an index head dim Di >= 1, got shape {_shape(index_q)}")
    if index_k.dtype != index_q.dtype:
        raise TypeError(f"index_k: expected dtype {index_q.dtype} (the dtype of index_q), got {index_k.dtype}")
    _same_device("index_k", index_k, "index_q", index_q)


def check_attention(q, k, v, documents: Documents, block_size, softmax_scale) -> None:
    """Metadata checks of `msa::forward` other than `block_indices` (no host sync)."""
    _float_tensor("q", q, "[Tq, Hq, D]")
    _float_tensor("k", k, "[Tk, Hkv, D]")
    _float_tensor("v", v, "[Tk, Hkv, D]")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {x.dtype}")
        _same_device(name, x, "q", q)
    if list(v.shape) != list(k.shape):
        raise ValueError(f"v: expected shape {_shape(k)} (the shape of k), got {_shape(v)}")
    num_heads, num_kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: expected head dim D in {SUPPORTED_HEAD_DIMS}, got {_concrete(dim)} (shape {_shape(q)})")
    _dim("k.shape[2]", k.shape[2], dim, "the head dim of q,")
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"k: expected a number of KV heads Hkv that divides Hq = {_concrete(num_heads)}, "
            f"got Hkv = {_concrete(num_kv_heads)}"
        )
    _documents(documents, "q", q)
    check_host_args(documents.max_seqlen_q, documents.max_seqlen_k, block_size, softmax_scale=softmax_scale)


def check_block_indices(block_indices, q, k, anchor: str = "q") -> None:
    """Metadata checks of `block_indices [Hkv, Tq, topk]` against q and k (no host sync): `Tq`
    from `q.shape[0]`, `Hkv` from `k.shape[1]`, the device from `q` (named `anchor`)."""
    _tensor("block_indices", block_indices, 3, "[Hkv, Tq, topk]")
    _dtype("block_indices", block_indices, (INDEX_DTYPE,), "int32")
    _same_device("block_indices", block_indices, anchor, q)
    num_kv_heads, num_queries = k.shape[1], q.shape[0]
    if block_indices.shape[0] != num_kv_heads or block_indices.shape[1] != num_queries or block_indices.shape[2] < 1:
        raise ValueError(
            f"block_indices: expected shape [Hkv, Tq, topk] = [{_concrete(num_kv_heads)}, {_concrete(num_queries)}, "
            f"topk >= 1], got {_shape(block_indices)}"
        )


def check_forward(q, k, v, block_indices, documents: Documents, block_size, softmax_scale, plan=None) -> None:
    """Metadata checks of `msa::forward` (no host sync)."""
    check_attention(q, k, v, documents, block_size, softmax_scale)
    check_block_indices(block_indices, q, k)
    check_plan(plan, block_indices, k.shape[0], documents.num_documents, block_size)


def check_index_inputs(index_q, index_k, q, k) -> None:
    """The index inputs of `msa_attention` against q and k: `index_q [Tq, Hkv, Di]` with q's rows,
    `index_k [Tk, 1, Di]` with k's rows, both on q's device in one float dtype, which may differ
    from q's (no host sync)."""
    _float_tensor("q", q, "[Tq, Hq, D]")
    _float_tensor("k", k, "[Tk, Hkv, D]")
    _float_tensor("index_q", index_q, "[Tq, Hi, Di]")
    _float_tensor("index_k", index_k, "[Tk, 1, Di]")
    for name, x, rows, source, source_name in (("index_q", index_q, "Tq", q, "q"), ("index_k", index_k, "Tk", k, "k")):
        if x.shape[0] != source.shape[0]:
            raise ValueError(
                f"{name}: expected {rows} = {_concrete(source.shape[0])} rows (the rows of {source_name}), "
                f"got {_concrete(x.shape[0])} (shape {_shape(x)})"
            )
    if index_q.shape[1] != k.shape[1]:
        raise ValueError(
            f"index_q: expected Hi = {_concrete(k.shape[1])} index heads (one per KV head of k), "
            f"got {_concrete(index_q.shape[1])}"
        )
    if index_k.dtype != index_q.dtype:
        raise TypeError(f"index_k: expected dtype {index_q.dtype} (the dtype of index_q), got {index_k.dtype}")
    for name, x in (("index_q", index_q), ("index_k", index_k)):
        _same_device(name, x, "q", q)


def check_backward(grad_out, q, k, v, out, lse, block_indices, documents: Documents, block_size, softmax_scale,
                   grad_lse=None, plan=None) -> None:
    """Metadata checks of `msa::backward` (no host sync)."""
    check_forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan)
    for name, x in (("grad_out", grad_out), ("out", out)):
        _float_tensor(name, x, "[Tq, Hq, D]")
        if list(x.shape) != list(q.shape):
            raise ValueError(f"{name}: expected shape {_shape(q)} (the shape of q), got {_shape(x)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {x.dtype}")
        _same_device(name, x, "q", q)
    lse_dtype = compute_dtype(q.dtype)
    for name, x in (("lse", lse), ("grad_lse", grad_lse)):
        if x is None and name == "grad_lse":
            continue
        _tensor(name, x, 2, "[Tq, Hq]")
        if list(x.shape) != list(q.shape[:2]):
            raise ValueError(f"{name}: expected shape {_sizes(q.shape[:2])} ([Tq, Hq] of q), got {_shape(x)}")
        _dtype(name, x, (lse_dtype,), str(lse_dtype))
        _same_device(name, x, "q", q)


def check_plan_args(block_indices, documents: Documents, num_keys, block_size, entries_per_item) -> None:
    """Metadata checks of `msa::plan` (no host sync)."""
    _tensor("block_indices", block_indices, 3, "[Hkv, Tq, topk]")
    _dtype("block_indices", block_indices, (INDEX_DTYPE,), "int32")
    if block_indices.shape[0] < 1 or block_indices.shape[2] < 1:
        raise ValueError(f"block_indices: expected shape [Hkv >= 1, Tq, topk >= 1], got {_shape(block_indices)}")
    _documents(documents, "block_indices", block_indices)
    check_host_args(documents.max_seqlen_q, documents.max_seqlen_k, block_size)
    check_host_int("num_keys", num_keys, 0)
    check_host_int("entries_per_item", entries_per_item, 1)


def check_plan(plan, block_indices, num_keys, num_docs, block_size) -> None:
    """The optional `plan`: 1-D int32 on block_indices' device, of the length `msa::plan` gives
    these shapes. While tracing the length is compared for the example only (no guard); the
    kernel compares it again on every call."""
    if plan is None:
        return
    if not isinstance(plan, torch.Tensor):
        raise TypeError(f"plan: expected the torch.Tensor msa::plan returns (or None), got {type(plan).__name__}")
    if plan.dim() != 1 or plan.dtype != INDEX_DTYPE:
        raise ValueError(f"plan: expected a 1-D int32 tensor from msa::plan, got {plan.dtype} of shape {_shape(plan)}")
    _same_device("plan", plan, "block_indices", block_indices)
    sizes = [_concrete(size) for size in (plan.shape[0], *block_indices.shape, num_keys, num_docs)]
    if any(isinstance(size, torch.SymInt) for size in sizes):
        return  # a size without an example value (data-dependent): left to the kernel's check
    numel, shape, (num_keys, num_docs) = sizes[0], sizes[1:4], sizes[4:]
    if item_rows(numel, shape, num_keys, num_docs, block_size) is None:
        raise ValueError(length_error(numel, shape, num_keys, num_docs, block_size))


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def check_values(documents: Documents, num_queries, num_keys, block_indices=None, block_size=None) -> None:
    """Content checks (host sync): boundaries from 0 up to `Tq` / `Tk`, `Lq <= Lk` per document
    (fragments fit theirs), `max_seqlen_*` large enough; rows of `block_indices`, if given: distinct
    ids in `[0, nvb(t))`, `-1` after, the local block `nvb(t) - 1` last."""
    lengths = {}
    for name, cu, total, max_name, max_len in (
        ("cu_seqlens_q", documents.cu_seqlens_q, num_queries, "max_seqlen_q", documents.max_seqlen_q),
        ("cu_seqlens_k", documents.cu_seqlens_k, num_keys, "max_seqlen_k", documents.max_seqlen_k),
    ):
        bounds = cu.detach().to("cpu", torch.int64)
        if int(bounds[0]) != 0:
            raise ValueError(f"{name}: expected the first boundary to be 0, got {int(bounds[0])}")
        steps = bounds.diff()
        if (steps < 0).any():
            (i,) = _first(steps < 0)
            raise ValueError(
                f"{name}: expected non-decreasing boundaries, got {name}[{i}] = {int(bounds[i])} > "
                f"{name}[{i + 1}] = {int(bounds[i + 1])}"
            )
        if int(bounds[-1]) != int(total):
            raise ValueError(f"{name}: expected the last boundary to equal the token count {int(total)}, got {int(bounds[-1])}")
        longest = int(steps.max()) if steps.numel() else 0
        if longest > int(max_len):
            raise ValueError(f"{max_name}: expected >= the longest document ({longest} tokens), got {int(max_len)}")
        lengths[name] = steps
    if documents.fragment_documents is None:
        too_long = lengths["cu_seqlens_q"] > lengths["cu_seqlens_k"]
        if too_long.any():
            (b,) = _first(too_long)
            raise ValueError(
                f"cu_seqlens_q: expected every document to have Lq <= Lk (queries are the causal suffix of the keys), "
                f"got document {b} with Lq = {int(lengths['cu_seqlens_q'][b])}, Lk = {int(lengths['cu_seqlens_k'][b])}"
            )
    else:
        _check_fragments(*documents.fragments, lengths["cu_seqlens_q"], lengths["cu_seqlens_k"])
    if block_indices is not None:
        _check_block_ids(block_indices, documents, num_queries, num_keys, block_size)


def _check_fragments(fragment_documents, fragment_starts, fragment_lengths, document_lengths) -> None:
    documents = fragment_documents.detach().to("cpu", torch.int64)
    starts = fragment_starts.detach().to("cpu", torch.int64)
    num_docs = document_lengths.numel()
    unknown = (documents < 0) | (documents >= num_docs)
    if unknown.any():
        (f,) = _first(unknown)
        raise ValueError(
            f"fragment_documents[{f}]: expected a document of cu_seqlens_k in [0, {num_docs}), got {int(documents[f])}"
        )
    if (starts < 0).any():
        (f,) = _first(starts < 0)
        raise ValueError(f"fragment_starts[{f}]: expected a document-local position >= 0, got {int(starts[f])}")
    overflow = starts + fragment_lengths > document_lengths[documents]
    if overflow.any():
        (f,) = _first(overflow)
        raise ValueError(
            f"fragment_starts[{f}]: expected fragment_starts + Lq <= Lk (the fragment's {int(fragment_lengths[f])} "
            f"queries inside document {int(documents[f])} of {int(document_lengths[documents[f]])} keys), "
            f"got {int(starts[f])}"
        )


def _check_block_ids(block_indices, documents: Documents, num_queries, num_keys, block_size) -> None:
    ids = block_indices.detach().to("cpu", torch.int64)
    position = documents.map_tensors(torch.Tensor.cpu).locate(num_queries, num_keys).position
    visible_blocks = (position // block_size + 1).view(1, -1, 1)
    where = "block_indices[{}, {}, {}]"
    if (ids < -1).any():
        index = _first(ids < -1)
        raise ValueError(f"{where.format(*index)}: expected a block id >= -1, got {int(ids[index])}")
    valid = ids >= 0
    late = valid[..., 1:] & ~valid[..., :-1]
    if late.any():
        r, t, s = _first(late)
        raise ValueError(
            f"{where.format(r, t, s + 1)}: expected valid ids as a prefix and -1 after them, got {ids[r, t].tolist()}")
    beyond = valid & (ids >= visible_blocks)
    if beyond.any():
        r, t, s = _first(beyond)
        raise ValueError(
            f"{where.format(r, t, s)}: expected a block id < nvb = {int(visible_blocks[0, t, 0])} "
            f"(blocks visible to query {t} at position {int(position[t])}), got {int(ids[r, t, s])}"
        )
    ordered = ids.sort(-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if repeated.any():
        r, t, _ = _first(repeated)
        raise ValueError(f"block_indices[{r}, {t}]: expected distinct block ids, got {ids[r, t].tolist()}")
    count = valid.sum(-1, keepdim=True)
    last = ids.gather(-1, (count - 1).clamp(min=0))
    misplaced = (last != visible_blocks - 1) | (count == 0)
    misplaced &= (position >= 0).view(1, -1, 1)
    if misplaced.any():
        r, t, _ = _first(misplaced)
        raise ValueError(
            f"block_indices[{r}, {t}]: expected the local block {int(visible_blocks[0, t, 0]) - 1} as the last valid id, "
            f"got {ids[r, t].tolist()}"
        )


def check_plan_values(plan, block_indices, documents: Documents, num_keys, block_size) -> None:
    """Content checks of `plan` (host sync): built for this selection and these documents, its
    positions and entries matching theirs exactly (not a stale plan of the same shapes)."""
    schedule = unpack(plan.detach(), block_indices, num_keys, documents.num_documents, block_size)
    num_kv_heads, num_queries, topk = block_indices.shape
    ids = block_indices.detach().to("cpu", torch.int64)
    docs = documents.map_tensors(torch.Tensor.cpu).locate(num_queries, num_keys)
    table = {name: getattr(schedule, name).detach().to("cpu", torch.int64) for name in schedule._fields}
    stale = "a plan built for other arguments: rebuild it with torch_msa.build_plan for these"
    wrong = (table["position"] != docs.position).nonzero()
    if wrong.numel():
        t = int(wrong[0])
        raise ValueError(f"plan: expected the plan of these documents, whose query {t} sits at position "
                         f"{int(docs.position[t])}; the plan has {int(table['position'][t])} ({stale})")
    valid = valid_entries(ids, docs.position, block_size)
    num_buckets = int(table["num_buckets"][0])
    pointers = table["bucket_ptr"]
    if not 0 <= num_buckets < pointers.numel() or (pointers[:num_buckets + 1].diff() < 0).any():
        raise ValueError(f"plan: expected the tables msa::plan builds, got {num_buckets} buckets ({stale})")
    count = int(pointers[num_buckets])
    if count != int(valid.sum()):
        raise ValueError(f"plan: expected the {int(valid.sum())} valid (query, block) entries of block_indices, "
                         f"the plan holds {count} ({stale})")
    bucket = torch.repeat_interleave(torch.arange(num_buckets), pointers[:num_buckets + 1].diff())
    entry = table["entry_query"][:count]
    head, block = table["bucket_head"][bucket], table["bucket_block"][bucket]
    query, slot = entry // topk, entry % topk
    inside = (entry >= 0) & (query < num_queries) & (head >= 0) & (head < num_kv_heads)
    query, slot, head = query.clamp(0, num_queries - 1), slot.clamp(min=0), head.clamp(0, num_kv_heads - 1)
    matches = inside & valid[head, query, slot] & (ids[head, query, slot] == block)
    matches &= table["bucket_key_row"][bucket] == docs.key_start[query] + block * block_size
    flat = (head * num_queries + query) * topk + slot
    if not bool(matches.all()) or flat.unique().numel() != count:
        e = int((~matches).nonzero()[0]) if not bool(matches.all()) else 0
        raise ValueError(f"plan: expected the entries of this block_indices; the plan's entry {e} has block "
                         f"{int(block[e])} of KV head {int(head[e])} for query {int(query[e])}, slot {int(slot[e])}, "
                         f"where block_indices holds {int(ids[head[e], query[e], slot[e]])} ({stale})")


def _lse_like(name: str, x, q) -> None:
    _tensor(name, x, 2, "[Tq, Hq]")
    if list(x.shape) != list(q.shape[:2]):
        raise ValueError(f"{name}: expected shape {list(q.shape[:2])} ([Tq, Hq] of q), got {_shape(x)}")
    lse_dtype = compute_dtype(q.dtype)
    _dtype(name, x, (lse_dtype,), str(lse_dtype))
    _same_device(name, x, "q", q)


def check_indexer_kl(q, k, lse, index_q, index_k, block_indices, documents: Documents, block_size, softmax_scale,
                     index_softmax_scale) -> None:
    """Metadata checks of `msa::indexer_kl` (no host sync); `lse` / `block_indices` may be None."""
    # k stands in for v: the loss reads no values. Without block_indices the support is dense.
    check_attention(q, k, k, documents, block_size, softmax_scale)
    if block_indices is not None:
        check_block_indices(block_indices, q, k)
    if lse is not None:
        _lse_like("lse", lse, q)
    _check_index_loss_inputs(q, k, index_q, index_k, index_softmax_scale)


def _check_index_loss_inputs(q, k, index_q, index_k, index_softmax_scale) -> None:
    """The index inputs of the index loss against q and k, whose own checks (and the documents')
    came first."""
    _index_tensors(index_q, index_k)
    if list(index_q.shape[:2]) != [q.shape[0], k.shape[1]]:
        raise ValueError(
            f"index_q: expected [Tq, Hi] = [{q.shape[0]}, {k.shape[1]}] (one index head per KV head), "
            f"got {list(index_q.shape[:2])}"
        )
    if index_k.shape[0] != k.shape[0]:
        raise ValueError(f"index_k: expected Tk = {k.shape[0]} rows (the rows of k), got {index_k.shape[0]}")
    _same_device("index_q", index_q, "q", q)
    check_scale("index_softmax_scale", index_softmax_scale)


def check_indexer_kl_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                              teacher_index_queries, block_indices, documents: Documents, block_size,
                              index_softmax_scale) -> None:
    """Metadata checks of `msa::indexer_kl_backward` (no host sync): the index inputs and what
    `msa::indexer_kl` returned for them."""
    check_select_blocks(index_q, index_k, documents, None, block_size)
    if block_indices is not None:
        # One index head per KV head: index_q gives both Tq and Hkv.
        check_block_indices(block_indices, index_q, index_q, "index_q")
    check_scale("index_softmax_scale", index_softmax_scale)
    _loss_scalar("grad_loss", grad_loss, "[] (a scalar)", index_q, "index_q", index_q)
    loss_dtype = compute_dtype(index_q.dtype)
    num_queries, num_index_heads, index_dim = index_q.shape
    for name, x, shape, layout, anchor in (
        ("index_lse", index_lse, [num_queries, num_index_heads], "[Tq, Hi]", "index_q"),
        ("teacher_mass", teacher_mass, [num_queries, num_index_heads], "[Tq, Hi]", "index_q"),
        ("teacher_index_keys", teacher_index_keys, list(index_q.shape), "[Tq, Hi, Di]", "index_q"),
        ("teacher_index_queries", teacher_index_queries, [index_k.shape[0], 1, index_dim], "[Tk, 1, Di]", "index_k"),
    ):
        _tensor(name, x, len(shape), layout)
        if list(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} ({layout} of {anchor}), got {_shape(x)}")
        _dtype(name, x, (loss_dtype,), str(loss_dtype))
        _same_device(name, x, "index_q", index_q)


def check_forward_with_index_loss(q, k, v, index_q, index_k, block_indices, documents: Documents, block_size,
                                  softmax_scale, index_softmax_scale, loss_value, plan=None) -> None:
    """Metadata checks of `msa::forward_with_index_loss` (no host sync): the forward's and the
    sparse index loss's, and `loss_value` a 0-D tensor of the loss's dtype on q's device."""
    check_forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan)
    _check_index_loss_inputs(q, k, index_q, index_k, index_softmax_scale)
    check_loss_value(loss_value, index_q, q)


def check_loss_value(loss_value, index_q, q, name: str = "loss_value") -> None:
    """`loss_value` (what receives the index loss's value, called `name`) a 0-D tensor of the
    loss's dtype on q's device."""
    _loss_scalar(name, loss_value, "[] (a scalar that receives the loss)", index_q, "q", q)


def check_backward_with_index_loss(grad_out, grad_loss, q, k, v, out, lse, index_q, index_k, block_indices,
                                   documents: Documents, block_size, softmax_scale, index_softmax_scale, grad_lse=None,
                                   plan=None) -> None:
    """Metadata checks of `msa::backward_with_index_loss` (no host sync): the attention
    backward's and the sparse index loss's, and `grad_loss` a 0-D tensor of the loss's dtype."""
    check_backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse, plan)
    _check_index_loss_inputs(q, k, index_q, index_k, index_softmax_scale)
    _loss_scalar("grad_loss", grad_loss, "[] (a scalar)", index_q, "q", q)


def _loss_scalar(name: str, x, layout: str, index_q, anchor_name: str, anchor) -> None:
    """`x` a 0-D tensor of the index loss's dtype (`compute_dtype` of index_q's) on `anchor`'s device."""
    dtype = compute_dtype(index_q.dtype)
    _tensor(name, x, 0, layout)
    _dtype(name, x, (dtype,), str(dtype))
    _same_device(name, x, anchor_name, anchor)
