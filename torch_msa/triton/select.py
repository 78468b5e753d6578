"""`msa::select_blocks` in Triton: causal index scoring fused with an exp-free top-k (design:
`torch_msa/triton/README.md`).
"""

import torch
import triton
import triton.language as tl

from ..triton_utils.common import dot_precision, locate_queries
from ..triton_utils.launch import LaunchConfig, cached_launches, launch

# `rows`: tokens x index heads per program; 128 is one full wgmma tile.
CONFIGS = (LaunchConfig(rows=128, num_stages=2), LaunchConfig(rows=64, num_stages=1))


@triton.jit
def _rank_key(score, block):
    """int64 key ordering (score desc, block asc); -0.0 folded into +0.0 like float compare."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits.to(tl.int64) + 2147483648, (~bits).to(tl.int64))
    return (ordered << 31) | (2147483647 - block)


@triton.jit
def _merge(kept, chunk, first_block, num_candidates, slot):
    """Top-`KEEP_P2` of the kept keys and a chunk of consecutive blocks' scores, by the first step
    of a bitonic merge (one sort per half instead of a per-block insertion)."""
    block = first_block + slot[None, :]
    score = tl.where(chunk != chunk, float("-inf"), chunk)
    candidate = _rank_key(score, block)
    candidate = tl.where(block < num_candidates[:, None], candidate, -1)
    return tl.maximum(tl.sort(kept, dim=1, descending=True), tl.sort(candidate, dim=1))


@cached_launches
@triton.jit
def msa_select_kernel(
    index_q, index_k, cu_seqlens_q, key_start, position, block_indices,
    num_queries, num_keys, num_docs, tiles_per_doc,
    stride_q_token, stride_q_head, stride_k_token,
    scale,
    NUM_HEADS: tl.constexpr, HEADS_P2: tl.constexpr, TOKENS: tl.constexpr,
    DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK: tl.constexpr,
    TOPK: tl.constexpr, KEEP_P2: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    # The last tiles of a document score the most blocks: launch them first.
    tile = tiles_per_doc - 1 - pid // num_docs
    doc = pid % num_docs
    first_query = tl.load(cu_seqlens_q + doc)
    end_query = tl.minimum(tl.load(cu_seqlens_q + doc + 1), num_queries)
    tile_start = first_query + tile * TOKENS
    if tile_start >= end_query or tile_start < 0:
        return

    rows = tl.arange(0, TOKENS * HEADS_P2)
    token = tile_start + rows // HEADS_P2
    head = rows % HEADS_P2
    row_ok = (token < end_query) & (head < NUM_HEADS)
    token = tl.where(row_ok, token, tile_start)
    pos = tl.load(position + token, mask=row_ok, other=-1)
    tile_key_start = tl.load(key_start + tile_start)
    # Rows of another document (malformed cu_seqlens) would need other keys: they rank nothing.
    same_keys = tl.load(key_start + token, mask=row_ok, other=-1) == tile_key_start
    local = tl.where(pos >= 0, pos // BLOCK, -1)
    num_candidates = tl.where(same_keys, local, 0)
    last_block = tl.max(num_candidates, axis=0)

    dims = tl.arange(0, DIM_P2)
    query = tl.load(
        index_q + token.to(tl.int64)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & (dims[None, :] < DIM), other=0.0,
    )
    slot = tl.arange(0, KEEP_P2)
    kept = tl.full((TOKENS * HEADS_P2, KEEP_P2), -1, tl.int64)  # -1: empty, below every key
    chunk = tl.full((TOKENS * HEADS_P2, KEEP_P2), float("-inf"), tl.float32)
    offsets = tl.arange(0, BLOCK)
    for block in range(0, last_block):
        key_row = tile_key_start + block * BLOCK + offsets
        keys = tl.load(
            index_k + key_row.to(tl.int64)[:, None] * stride_k_token + dims[None, :],
            mask=(key_row < num_keys)[:, None] & (dims[None, :] < DIM), other=0.0,
        )
        block_score = tl.max(tl.dot(query, tl.trans(keys), input_precision=PRECISION), axis=1) * scale
        column = block % KEEP_P2
        chunk = tl.where(slot[None, :] == column, block_score[:, None], chunk)
        if (column == KEEP_P2 - 1) | (block == last_block - 1):
            kept = _merge(kept, chunk, block - column, num_candidates, slot)
            chunk = tl.full((TOKENS * HEADS_P2, KEEP_P2), float("-inf"), tl.float32)

    kept = tl.sort(kept, dim=1, descending=True)
    count = tl.minimum(tl.sum((kept >= 0).to(tl.int32), axis=1), TOPK - 1)
    chosen = (2147483647 - (kept & 2147483647)).to(tl.int32)
    local_slot = (slot[None, :] == count[:, None]) & (pos >= 0)[:, None]
    result = tl.where(slot[None, :] < count[:, None], chosen, tl.where(local_slot, local[:, None], -1))
    tl.store(
        block_indices + head.to(tl.int64)[:, None] * num_queries * TOPK + token.to(tl.int64)[:, None] * TOPK + slot[None, :],
        result,
        mask=row_ok[:, None] & (slot[None, :] < TOPK),
    )


def select_blocks(index_q, index_k, documents, topk, block_size):
    """Same contract as `torch_msa.reference.select_blocks`: int32 `[Hi, Tq, topk]`.

    The non-local blocks are returned in descending score order (lower id first on ties).
    """
    num_queries, num_heads, index_dim = index_q.shape
    num_keys = index_k.shape[0]
    block_indices = torch.full((num_heads, num_queries, topk), -1, dtype=torch.int32, device=index_q.device)
    num_docs = documents.cu_seqlens_q.numel() - 1
    if num_queries == 0 or num_keys == 0 or num_docs < 1:
        return block_indices
    index_q = index_q if index_q.stride(-1) == 1 else index_q.contiguous()
    index_k = index_k if index_k.stride(-1) == 1 else index_k.contiguous()
    cu_seqlens_q = documents.cu_seqlens_q.contiguous()  # the kernel reads the boundaries densely
    docs = locate_queries(cu_seqlens_q, documents.cu_seqlens_k, num_queries, num_keys, *documents.fragments)
    heads_p2 = triton.next_power_of_2(num_heads)

    def launch_select(config):
        tokens = max(1, config.rows // heads_p2)
        tiles_per_doc = triton.cdiv(max(1, min(documents.max_seqlen_q, num_queries)), tokens)
        msa_select_kernel[(num_docs * tiles_per_doc,)](
            index_q, index_k, cu_seqlens_q, docs.key_start, docs.position, block_indices,
            num_queries, num_keys, num_docs, tiles_per_doc,
            index_q.stride(0), index_q.stride(1), index_k.stride(0),
            index_dim**-0.5,
            NUM_HEADS=num_heads, HEADS_P2=heads_p2, TOKENS=tokens,
            DIM=index_dim, DIM_P2=max(16, triton.next_power_of_2(index_dim)), BLOCK=block_size,
            TOPK=topk, KEEP_P2=max(2, triton.next_power_of_2(topk)), PRECISION=dot_precision(index_q.dtype),
            **config.options,
        )

    launch("msa_select_kernel", (index_q.device, index_q.dtype, num_heads, index_dim, block_size, topk),
           CONFIGS, launch_select)
    return block_indices
