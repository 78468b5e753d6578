"""Pure-PyTorch reference of the MSA ops: the oracle every backend is tested against.

Any device, fp32 accumulation (fp64 for fp64 inputs), no host sync, no `T x T` buffer: queries go
in chunks of bounded working set and gather only the keys they may read. Block ids are read as a
set: negative, out-of-horizon and repeated ids add nothing, so no input indexes out of bounds.
"""

import math

import torch

from .contract import compute_dtype
from .documents import Documents, QueryDocuments
from .plan.schedule import build_schedule, pack

# Working-set budget of one query chunk: on CPU small enough to keep temporaries below glibc's
# mmap threshold (fresh page faults), elsewhere large for fewer launches.
_CHUNK_BYTES_CPU = 32 << 20
_CHUNK_BYTES_DEVICE = 512 << 20


def _chunk_rows(num_rows: int, bytes_per_row: int, device: torch.device) -> int:
    budget = _CHUNK_BYTES_CPU if device.type == "cpu" else _CHUNK_BYTES_DEVICE
    return max(1, min(num_rows, budget // max(1, bytes_per_row)))


def _chunks(num_rows: int, bytes_per_row: int, device: torch.device):
    step = _chunk_rows(num_rows, bytes_per_row, device)
    for start in range(0, num_rows, step):
        yield start, min(num_rows, start + step)


def select_blocks(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    documents: Documents,
    topk: int,
    block_size: int,
) -> torch.Tensor:
    """Pick, per (index head, query), the blocks its main heads attend to.

    Args:
        index_q: `[Tq, Hi, Di]` index queries.
        index_k: `[Tk, 1, Di]` index keys, shared by all index heads.
        documents: the documents; `max_seqlen_k` bounds the candidate blocks, capped at `Tk`.

    Returns:
        int32 `[Hi, Tq, topk]`: the `min(topk - 1, nvb - 1)` best non-local visible blocks by
        block max-score (descending, lower id first on ties), then the local block, then `-1`.
    """
    num_queries, num_heads, index_dim = index_q.shape
    num_keys = index_k.shape[0]
    device = index_q.device
    result = torch.full((num_heads, num_queries, topk), -1, dtype=torch.int32, device=device)
    if num_queries == 0 or num_keys == 0:
        return result
    cdtype = compute_dtype(index_q.dtype)
    docs = documents.locate(num_queries, num_keys)
    num_blocks = max(1, math.ceil(min(documents.max_seqlen_k, num_keys) / block_size))
    keys = index_k.reshape(num_keys, index_dim)
    scale = index_dim**-0.5
    # Key spans of whole blocks keep even a one-query chunk within the budget, however long the documents.
    bytes_per_key = index_dim * (keys.element_size() + 4) + 12 * num_heads
    blocks_per_span = _chunk_rows(num_blocks, block_size * bytes_per_key, device)
    span = blocks_per_span * block_size
    block_ids = torch.arange(num_blocks, device=device)
    slots = torch.arange(topk, device=device)
    for start, end in _chunks(num_queries, span * bytes_per_key, device):
        position = docs.position[start:end, None]
        query = index_q[start:end].to(cdtype)
        block_score = torch.empty(end - start, num_heads, num_blocks, dtype=cdtype, device=device)
        for first_block in range(0, num_blocks, blocks_per_span):
            count = min(blocks_per_span, num_blocks - first_block)
            key_offsets = torch.arange(first_block * block_size, (first_block + count) * block_size, device=device)
            visible = key_offsets <= position
            rows = torch.where(visible, docs.key_start[start:end, None] + key_offsets, 0)
            gathered = keys.index_select(0, rows.reshape(-1)).reshape(end - start, -1, index_dim).to(cdtype)
            scores = torch.matmul(query, gathered.transpose(1, 2)).mul_(scale).masked_fill_(~visible[:, None, :], -math.inf)
            block_score[..., first_block:first_block + count] = scores.view(end - start, num_heads, count, block_size).amax(-1)
        visible_blocks = torch.where(position >= 0, position // block_size + 1, 0)  # nvb
        local_block = visible_blocks - 1
        candidate = block_ids < local_block
        block_score = block_score.nan_to_num(nan=-math.inf).masked_fill(~candidate[:, None, :], -math.inf)
        # A stable descending sort keeps the lower id first among equal scores.
        ranked = torch.sort(block_score, dim=-1, descending=True, stable=True).indices
        if num_blocks < topk:
            ranked = torch.nn.functional.pad(ranked, (0, topk - num_blocks), value=-1)
        ranked = ranked[..., :topk]
        kept = torch.minimum(local_block.clamp(min=0), candidate.sum(-1, keepdim=True)).clamp(max=topk - 1)
        local_slot = (slots == kept) & (visible_blocks >= 1)
        tail = torch.where(local_slot, local_block, -1)
        chosen = torch.where((slots < kept)[:, None, :], ranked, tail[:, None, :])
        result[:, start:end] = chosen.permute(1, 0, 2).to(torch.int32)
    return result


class _KeyGather:
    """The keys one chunk of queries may read, per KV head, as `N = topk * block_size` slots.

    `rows` index the `[Tk * Hkv, D]` view of k / v; `valid` marks the query's key set. Invalid
    slots take zeros (`take`, so `0 * NaN` never happens) and scatter their gradients to a scratch
    row past the end (`scatter_rows`).
    """

    def __init__(self, block_indices: torch.Tensor, docs: QueryDocuments, start: int, end: int,
                 num_kv_heads: int, block_size: int, num_rows: int | None = None):
        ids = block_indices[:, start:end].to(torch.int64)  # [Hkv, C, topk]
        topk = ids.shape[-1]
        repeated = torch.ones(topk, topk, dtype=torch.bool, device=ids.device).tril(-1)
        duplicate = ((ids[..., :, None] == ids[..., None, :]) & repeated).any(-1)
        position = docs.position[start:end].reshape(1, -1, 1, 1)
        offsets = torch.arange(block_size, device=ids.device)
        key_pos = ids[..., None] * block_size + offsets  # [Hkv, C, topk, bs]
        valid = (ids >= 0) & ~duplicate
        valid = valid[..., None] & (key_pos <= position)
        head = torch.arange(num_kv_heads, device=ids.device).reshape(-1, 1, 1, 1)
        rows = (docs.key_start[start:end].reshape(1, -1, 1, 1) + key_pos) * num_kv_heads + head
        count = end - start
        self.shape = (num_kv_heads, count, topk * block_size)
        self.valid = valid.reshape(num_kv_heads, count, 1, topk * block_size)
        self.rows = torch.where(valid, rows, 0).reshape(-1)
        # Only a caller that scatters gradients (`num_rows` given) needs the scratch-row targets.
        self.scatter_rows = None if num_rows is None else torch.where(valid, rows, num_rows).reshape(-1)
        self._invalid_slots = ~valid.reshape(*self.shape, 1)

    def take(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gather `[Hkv, C, N, D]` rows of `flat` (`[Tk * Hkv, D]`) in `dtype`, zeros in invalid slots."""
        gathered = flat.index_select(0, self.rows).reshape(*self.shape, flat.shape[-1])
        # A fresh tensor (index_select's output or its cast): zeroed in place.
        return gathered.to(dtype).masked_fill_(self._invalid_slots, 0)


def plan(
    block_indices: torch.Tensor,
    documents: Documents,
    num_keys: int,
    block_size: int,
    entries_per_item: int,
) -> torch.Tensor:
    """The plan (`torch_msa/plan/schedule.py`) of `block_indices`: `build_schedule`'s tables, packed."""
    return pack(build_schedule(block_indices, documents, num_keys, block_size, entries_per_item))


def _heads_first(x: torch.Tensor, num_kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """`[C, Hq, ...]` -> `[Hkv, C, G, ...]` in `dtype` (query head h = G * r + g)."""
    count, num_heads = x.shape[:2]
    return x.to(dtype).reshape(count, num_kv_heads, num_heads // num_kv_heads, *x.shape[2:]).transpose(0, 1)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """`[Hkv, C, G, ...]` -> `[C, Hq, ...]`."""
    x = x.transpose(0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _scores(query_rows: torch.Tensor, key: torch.Tensor, gather: _KeyGather, softmax_scale: float) -> torch.Tensor:
    """`scale * q k^T` of one chunk, `[Hkv, C, G, N]`, with slots outside the key set at `-inf`."""
    query = _heads_first(query_rows, key.shape[0], key.dtype) * softmax_scale
    return torch.matmul(query, key.transpose(-1, -2)).masked_fill_(~gather.valid, -math.inf)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    # A query with an empty key set has max score / lse = -inf; shifting by 0 instead keeps its
    # probabilities at exp(-inf) = 0 rather than NaN.
    return x.masked_fill(torch.isinf(x), 0)


def _attention_row_bytes(num_heads: int, num_kv_heads: int, keys: int, dim: int, buffers: int) -> int:
    """Bytes one query row of a chunk holds: gathered k/v (native + fp32) and score rows."""
    return keys * buffers * (num_kv_heads * dim * 6 + num_heads * 8)


def _key_chunks(q, k, block_indices, documents: Documents, block_size: int, buffers: int):
    """`(start, end, gather)` per query chunk of the attention ops."""
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    docs = documents.locate(num_queries, num_keys)
    row_bytes = _attention_row_bytes(num_heads, num_kv_heads, block_indices.shape[-1] * block_size, dim, buffers)
    for start, end in _chunks(num_queries, row_bytes, q.device):
        yield start, end, _KeyGather(block_indices, docs, start, end, num_kv_heads, block_size, num_keys * num_kv_heads)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    documents: Documents,
    block_size: int,
    softmax_scale: float,
    plan: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention forward: `out [Tq, Hq, D]` (q's dtype) and `lse [Tq, Hq]` (fp32, fp64 for
    fp64 inputs); an empty key set gives `out = 0`, `lse = -inf`. `plan` is not read."""
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    cdtype = compute_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((num_queries, num_heads), -math.inf, dtype=cdtype, device=q.device)
    if num_queries == 0 or num_keys == 0:
        return out, lse
    k_flat, v_flat = k.reshape(-1, dim), v.reshape(-1, dim)
    for start, end, gather in _key_chunks(q, k, block_indices, documents, block_size, buffers=1):
        scores = _scores(q[start:end], gather.take(k_flat, cdtype), gather, softmax_scale)
        row_max = _finite_or_zero(scores.amax(-1, keepdim=True))
        weights = scores.sub_(row_max).exp_()  # [Hkv, C, G, N], unnormalised
        total = weights.sum(-1, keepdim=True)
        chunk_out = torch.matmul(weights, gather.take(v_flat, cdtype)) / total.clamp(min=torch.finfo(cdtype).tiny)
        out[start:end] = _tokens_first(chunk_out).to(q.dtype)
        lse[start:end] = _tokens_first((row_max + total.log())[..., 0])
    return out, lse


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_indices: torch.Tensor,
    documents: Documents,
    block_size: int,
    softmax_scale: float,
    grad_lse: torch.Tensor | None = None,
    plan: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention backward: `(dq, dk, dv)` in the inputs' dtype, accumulated in fp32.

    `P = exp(S - lse)`, `dS = P * (dP - delta + grad_lse)` with `delta = rowsum(dO * O)`;
    `grad_lse` (`[Tq, Hq]`) may be None. `plan` is not read.
    """
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    cdtype = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    # One scratch row past the end takes the gradients of invalid slots.
    dk_acc = torch.zeros(num_keys * num_kv_heads + 1, dim, dtype=cdtype, device=q.device)
    dv_acc = torch.zeros(num_keys * num_kv_heads + 1, dim, dtype=cdtype, device=q.device)
    if num_queries > 0 and num_keys > 0:
        k_flat, v_flat = k.reshape(-1, dim), v.reshape(-1, dim)
        for start, end, gather in _key_chunks(q, k, block_indices, documents, block_size, buffers=3):
            scatter_rows = gather.scatter_rows
            assert scatter_rows is not None  # built with num_rows
            d_out = _heads_first(grad_out[start:end], num_kv_heads, cdtype)  # [Hkv, C, G, D]
            delta = (d_out * _heads_first(out[start:end], num_kv_heads, cdtype)).sum(-1, keepdim=True)
            if grad_lse is not None:
                delta = delta - _heads_first(grad_lse[start:end, :, None], num_kv_heads, cdtype)
            chunk_lse = _finite_or_zero(_heads_first(lse[start:end, :, None], num_kv_heads, cdtype))
            key, value = gather.take(k_flat, cdtype), gather.take(v_flat, cdtype)
            probs = _scores(q[start:end], key, gather, softmax_scale).sub_(chunk_lse).exp_()
            grad_scores = torch.matmul(d_out, value.transpose(-1, -2)).sub_(delta).mul_(probs).mul_(softmax_scale)
            dq[start:end] = _tokens_first(torch.matmul(grad_scores, key)).to(q.dtype)
            query = _heads_first(q[start:end], num_kv_heads, cdtype)
            dk_acc.index_add_(0, scatter_rows, torch.matmul(grad_scores.transpose(-1, -2), query).reshape(-1, dim))
            dv_acc.index_add_(0, scatter_rows, torch.matmul(probs.transpose(-1, -2), d_out).reshape(-1, dim))
    return dq, dk_acc[:-1].view(k.shape).to(k.dtype), dv_acc[:-1].view(v.shape).to(v.dtype)
