"""Dense float64 oracles: full masked-softmax attention and brute-force block selection.

Deliberately written differently from `torch_msa.reference` (a full `[Hkv, Tq, Tk]` mask built
from document boundaries, no gathers, no chunking) so that the two cannot share a mistake. Only
for small inputs.
"""

import math

import torch


def documents(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """Yield `(q_start, q_end, k_start, k_end)` per document."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        yield cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]


def positions(cu_seqlens_q, cu_seqlens_k, num_queries):
    """Per query row: (document key start, causal position p(t)); -1 position outside documents."""
    key_start = torch.zeros(num_queries, dtype=torch.long)
    position = torch.full((num_queries,), -1, dtype=torch.long)
    for q0, q1, k0, k1 in documents(cu_seqlens_q, cu_seqlens_k):
        key_start[q0:q1] = k0
        position[q0:q1] = (k1 - k0) - (q1 - q0) + torch.arange(q1 - q0)
    return key_start, position


def allowed_keys(block_indices, cu_seqlens_q, cu_seqlens_k, num_keys, block_size):
    """Bool `[Hkv, Tq, Tk]`: key j is in K(t, r) (set semantics: -1, repeats, far ids ignored)."""
    num_kv_heads, num_queries, _ = block_indices.shape
    allowed = torch.zeros(num_kv_heads, num_queries, num_keys, dtype=torch.bool)
    for q0, q1, k0, k1 in documents(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0:
            continue
        local_keys = torch.arange(k1 - k0)
        p = (k1 - k0) - (q1 - q0) + torch.arange(q1 - q0)
        causal = local_keys[None, :] <= p[:, None]  # [Lq, Lk]
        key_block = local_keys // block_size
        for r in range(num_kv_heads):
            ids = block_indices[r, q0:q1].long()  # [Lq, topk]
            chosen = (ids[:, :, None] == key_block[None, None, :]).any(1)  # [Lq, Lk]
            allowed[r, q0:q1, k0:k1] = chosen & causal
    return allowed


def attention(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, block_size, softmax_scale):
    """Masked dense attention in float64. Returns `(out [Tq, Hq, D], lse [Tq, Hq])`, differentiable."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    allowed = allowed_keys(block_indices, cu_seqlens_q, cu_seqlens_k, k.shape[0], block_size)
    mask = allowed.repeat_interleave(group, dim=0)  # [Hq, Tq, Tk]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,jhd->htj", q.double(), kk) * softmax_scale
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Tq]
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    out = torch.einsum("htj,jhd->thd", probs, vv)
    return out, lse.transpose(0, 1)


def block_scores(index_q, index_k, cu_seqlens_q, cu_seqlens_k, block_size):
    """Per document: fp64 block max-scores `[Hi, Lq, nblocks]` (-inf where not visible)."""
    result = []
    for q0, q1, k0, k1 in documents(cu_seqlens_q, cu_seqlens_k):
        num_blocks = max(1, math.ceil((k1 - k0) / block_size))
        p = (k1 - k0) - (q1 - q0) + torch.arange(q1 - q0)
        scores = torch.einsum("thd,jd->htj", index_q[q0:q1].double(), index_k[k0:k1, 0].double())
        scores = scores * index_q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.arange(k1 - k0)[None, None, :] > p[None, :, None], -math.inf)
        padded = torch.full((*scores.shape[:2], num_blocks * block_size), -math.inf, dtype=torch.float64)
        padded[..., : k1 - k0] = scores
        result.append((q0, q1, p, padded.view(*scores.shape[:2], num_blocks, block_size).amax(-1)))
    return result


def check_selection(block_indices, index_q, index_k, cu_seqlens_q, cu_seqlens_k, topk, block_size, tolerance=1e-5):
    """Assert the selection contract against brute force.

    Structure: `min(topk - 1, nvb - 1)` non-local ids, then the local block, then -1. Choice:
    the non-local ids must be a best set by fp64 score: every kept block scores at least as
    well as every rejected candidate, up to `tolerance` (relative) at the threshold, where
    independent fp32 computations may legitimately order near-ties differently.
    """
    num_heads = index_q.shape[1]
    assert block_indices.shape == (num_heads, index_q.shape[0], topk)
    assert block_indices.dtype == torch.int32
    for q0, q1, p, scores in block_scores(index_q, index_k, cu_seqlens_q, cu_seqlens_k, block_size):
        for local_t in range(q1 - q0):
            nvb = int(p[local_t]) // block_size + 1
            kept_count = min(topk - 1, nvb - 1)
            for r in range(num_heads):
                row = block_indices[r, q0 + local_t].tolist()
                where = f"head {r}, query {q0 + local_t}: {row}"
                assert row[kept_count] == nvb - 1, f"local block {nvb - 1} not last valid, {where}"
                assert all(x == -1 for x in row[kept_count + 1:]), f"tail not -1, {where}"
                kept = row[:kept_count]
                assert len(set(kept)) == kept_count and all(0 <= x < nvb - 1 for x in kept), where
                candidate = scores[r, local_t, : nvb - 1]
                rejected = [b for b in range(nvb - 1) if b not in kept]
                if kept and rejected:
                    worst_kept = candidate[kept].min()
                    best_rejected = candidate[rejected].max()
                    slack = tolerance * max(1.0, float(best_rejected.abs()))
                    assert worst_kept >= best_rejected - slack, (
                        f"kept {float(worst_kept)} < rejected {float(best_rejected)}, {where}")
