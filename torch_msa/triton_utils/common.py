"""What the Triton kernel modules share, so that none of them imports another: GEMM rounding,
log2-domain constants, query tiles, document lookup, item horizons and the split-precision
weighted GEMM of the index loss.
"""

import math

import torch
import triton
import triton.language as tl

from ..backends import UnsupportedInputs
from ..documents import QueryDocuments
from ..uninitialized import uninitialized
from .launch import cached_launches

# Constexpr so that kernels read them as constants; host code reads `.value`.
LOG2_E = tl.constexpr(math.log2(math.e))
LN_2 = tl.constexpr(math.log(2))

TILE_ROWS = 128
"""Query rows (tokens x heads) per tile of the KV-outer kernels' tuned launch configuration."""

_HORIZON_ENTRIES: tl.constexpr = tl.constexpr(128)


SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_dtype_and_group(name: str, dtype: torch.dtype, group_size: int = 1) -> None:
    """Decline, before any launch, a dtype or a head group (`Hq / Hkv`) the Triton kernels do not handle.

    Raises:
        UnsupportedInputs: `dtype` is not bf16, fp16 or fp32, or `group_size > 128`.
    """
    if dtype not in SERVED_DTYPES:
        raise UnsupportedInputs(f"{name} dtype {dtype} (the Triton kernels take bf16, fp16 or fp32)")
    if group_size > 128:
        raise UnsupportedInputs(
            f"Hq / Hkv = {group_size} query heads per KV head (the Triton kernels take at most 128)")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), not TF32, so they match the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tile_shape(num_heads: int, num_kv_heads: int, rows: int = TILE_ROWS) -> tuple[int, int]:
    """`(tokens, heads_p2)` of a query tile of about `rows` rows: all heads of a KV head for
    `tokens` queries."""
    heads_p2 = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(1, rows // heads_p2), heads_p2


def binary_search_steps(length: int | torch.SymInt) -> int:
    """Halvings that take a binary search over `length` elements to one candidate."""
    return max(1, int(length).bit_length())


@triton.jit
def search_right(table, length, values, mask, search_steps):
    """Per lane, int32: the probes of `torch.searchsorted(table[:length], values, right=True)`, the
    entries of an ascending `table` at most `values` (each read in `values`' dtype); a lane off
    `mask` reads nothing and gets no meaning. `search_steps = binary_search_steps(length)`. On an
    unsorted table the probes are the same as torch's, so a malformed input gives the reference's
    answer."""
    low = tl.zeros(values.shape, tl.int32)
    high = tl.zeros(values.shape, tl.int32) + length
    for _ in range(search_steps):
        active = low < high
        middle = low + ((high - low) >> 1)
        right = tl.load(table + middle, mask=active & mask, other=0).to(values.dtype) > values
        high = tl.where(active & right, middle, high)
        low = tl.where(active & ~right, middle + 1, low)
    return low


@triton.jit
def find_segments(token, token_ok, cu_seqlens_q, num_segments, search_steps):
    """Per lane, `(segment, in_range)`: the document (or fragment) of `cu_seqlens_q` whose queries
    hold `token` (int64), clamped to the last, and whether one does (`search_right` over
    `cu_seqlens_q[1:]`, so that even unsorted, malformed boundaries give the reference's segment)."""
    low = search_right(cu_seqlens_q + 1, num_segments, token, token_ok, search_steps)
    return tl.minimum(low, num_segments - 1), low < num_segments


@triton.jit
def locate_tokens(token, token_ok, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts, num_keys,
                  num_segments, num_docs, search_steps, FRAGMENTS: tl.constexpr):
    """Per lane, `(position, key_start, document)` of the packed query `token` (int64; lanes with
    `token_ok` false load nothing): the rule of `torch_msa.documents.locate_queries`, position -1
    and key start 0 for a token no well-formed document covers; `document` (of `cu_seqlens_k`) is
    0 there.

    `num_segments` documents (or fragments, with `FRAGMENTS`) of `cu_seqlens_q`, `num_docs` of
    `cu_seqlens_k`; `search_steps = binary_search_steps(num_segments)`.
    """
    segment, in_range = find_segments(token, token_ok, cu_seqlens_q, num_segments, search_steps)
    doc_ok = token_ok & (num_segments > 0)
    q_start = tl.load(cu_seqlens_q + segment, mask=doc_ok, other=0).to(tl.int64)
    q_end = tl.load(cu_seqlens_q + segment + 1, mask=doc_ok, other=0).to(tl.int64)
    if FRAGMENTS:
        doc = tl.load(fragment_documents + segment, mask=doc_ok, other=-1)
        in_range &= (doc >= 0) & (doc < num_docs)
        doc = tl.minimum(tl.maximum(doc, 0), num_docs - 1)
        doc_ok &= num_docs > 0
        k_start = tl.load(cu_seqlens_k + doc, mask=doc_ok, other=0).to(tl.int64)
        k_end = tl.load(cu_seqlens_k + doc + 1, mask=doc_ok, other=0).to(tl.int64)
        pos = tl.load(fragment_starts + segment, mask=doc_ok, other=-1).to(tl.int64) + (token - q_start)
    else:
        doc = segment
        k_start = tl.load(cu_seqlens_k + segment, mask=doc_ok, other=0).to(tl.int64)
        k_end = tl.load(cu_seqlens_k + segment + 1, mask=doc_ok, other=0).to(tl.int64)
        pos = (k_end - k_start) - (q_end - q_start) + (token - q_start)
    located = (in_range & doc_ok & (token >= q_start) & (pos >= 0) & (k_start >= 0)
               & (k_start + pos < k_end) & (k_start + pos < num_keys))
    return tl.where(located, pos, -1), tl.where(located, k_start, 0), tl.where(located, doc, 0)


_LOCATE_TOKENS = 1024  # tokens per program of `msa_locate_kernel`


@cached_launches
@triton.jit
def msa_locate_kernel(cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts, key_start, position,
                      num_queries, num_keys, num_segments, num_docs, search_steps,
                      FRAGMENTS: tl.constexpr, TOKENS: tl.constexpr):
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    token_ok = tokens < num_queries
    pos, start, _ = locate_tokens(tokens.to(tl.int64), token_ok, cu_seqlens_q, cu_seqlens_k, fragment_documents,
                               fragment_starts, num_keys, num_segments, num_docs, search_steps, FRAGMENTS)
    tl.store(position + tokens, pos, mask=token_ok)
    tl.store(key_start + tokens, start, mask=token_ok)


def locate_queries(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_queries: int, num_keys: int,
                   fragment_documents: torch.Tensor | None = None,
                   fragment_starts: torch.Tensor | None = None) -> QueryDocuments:
    """`torch_msa.documents.locate_queries` (same arguments, same int64 result) in one launch."""
    device = cu_seqlens_q.device
    key_start = uninitialized(num_queries, dtype=torch.int64, device=device)
    position = uninitialized(num_queries, dtype=torch.int64, device=device)
    if num_queries == 0:
        return QueryDocuments(key_start, position)
    fragments = fragment_documents is not None
    # The kernel reads the boundaries and fragments as dense arrays.
    cu_seqlens_q, cu_seqlens_k = (cu if cu.is_contiguous() else cu.contiguous() for cu in (cu_seqlens_q, cu_seqlens_k))
    if fragment_documents is not None and fragment_starts is not None:
        fragment_documents, fragment_starts = fragment_documents.contiguous(), fragment_starts.contiguous()
    num_segments = cu_seqlens_q.numel() - 1
    msa_locate_kernel[(triton.cdiv(num_queries, _LOCATE_TOKENS),)](
        cu_seqlens_q, cu_seqlens_k,
        fragment_documents if fragments else cu_seqlens_q, fragment_starts if fragments else cu_seqlens_q,
        key_start, position,
        num_queries, num_keys, num_segments, cu_seqlens_k.numel() - 1, binary_search_steps(num_segments),
        FRAGMENTS=fragments, TOKENS=_LOCATE_TOKENS, num_warps=4,
    )
    return QueryDocuments(key_start, position)


@triton.jit
def program_token_group(GROUP: tl.constexpr, GROUP_P2: tl.constexpr):
    """The query token (`program_id(0)`, int64) and KV head (`program_id(1)`) of a program that
    takes one token's `GROUP` query heads of one KV head, and their lanes: `(token, kv_head,
    heads [GROUP_P2], head_ok)`, `head_ok` false on the lanes past `GROUP`."""
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    heads = tl.arange(0, GROUP_P2)
    return token, kv_head, heads, heads < GROUP


@triton.jit
def program_item(item_start, item_end):
    """`(item, start, end)`: a KV-outer program's schedule item (`program_id(0)`) and its entries
    `start .. end - 1` (none when `start >= end`)."""
    item = tl.program_id(0)
    return item, tl.load(item_start + item), tl.load(item_end + item)


@triton.jit
def item_horizon(entry_query, position, start, end, TOPK: tl.constexpr):
    """The last key position any query of an item sees (`-1` for an empty item), which bounds
    the keys the item reads to its own document. The max, not the last entry's: query fragments
    of one document break position order."""
    horizon = tl.full((), -1, tl.int32)
    for first in range(start, end, _HORIZON_ENTRIES):
        entries = first + tl.arange(0, _HORIZON_ENTRIES)
        ok = entries < end
        token = (tl.load(entry_query + entries, mask=ok, other=0) // TOPK).to(tl.int64)
        horizon = tl.maximum(horizon, tl.max(tl.load(position + token, mask=ok, other=-1), axis=0))
    return horizon


@triton.jit
def weighted_dot(weights, operand, acc, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """`acc + weights @ operand` for fp32 `weights`: with `SPLIT` (16-bit operands), in two halves
    of the operand's dtype, so the product keeps about 16 bits of the weights."""
    high = weights.to(operand.dtype)
    acc = tl.dot(high, operand, acc, input_precision=PRECISION)
    if SPLIT:
        low = (weights - high.to(tl.float32)).to(operand.dtype)
        acc = tl.dot(low, operand, acc, input_precision=PRECISION)
    return acc


def split_weights(index_dtype: torch.dtype) -> bool:
    """Whether `weighted_dot` splits its weights: for 16-bit index inputs, whose single rounding
    would lose the difference of the gradient's two near-equal terms."""
    return index_dtype in (torch.float16, torch.bfloat16)
