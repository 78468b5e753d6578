"""What the Triton kernel modules share, so that none of them imports another: how their GEMMs
round, the log2-domain constants, the query tile of the KV-outer kernels, an item's key horizon
and the split-precision weighted GEMM of the KL kernels.

Imports triton: only the kernel modules import it (the package `__init__` does not).
"""

import math

import torch
import triton
import triton.language as tl

# Constexpr so that kernels read them as constants; host code reads `.value`. The kernels score in
# the log2 domain (`exp2`): `LOG2_E` scales natural-log quantities into it, `LN_2` back.
LOG2_E = tl.constexpr(math.log2(math.e))
LN_2 = tl.constexpr(math.log(2))

TILE_ROWS = 128
"""Query rows (tokens x heads) per tile of the KV-outer kernels' tuned launch configuration."""

_HORIZON_ENTRIES: tl.constexpr = tl.constexpr(128)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full fp32 ("ieee"), not TF32, so they match the reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tile_shape(num_heads: int, num_kv_heads: int, rows: int = TILE_ROWS) -> tuple[int, int]:
    """`(tokens, heads_p2)` of a query tile of about `rows` rows: all heads of a KV head for
    `tokens` queries."""
    heads_p2 = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(1, rows // heads_p2), heads_p2


@triton.jit
def item_horizon(entry_query, position, start, end, TOPK: tl.constexpr):
    """The last key position any query of an item sees: the largest position of its entries.

    An item's entries all read one key block of one document, so this bounds the keys the item
    may read to its own document. Entries are sorted by query, which within a document is
    position order, except across query fragments of one document: hence the max, not the last
    entry's position. One chunk of `_HORIZON_ENTRIES` covers the items the public API builds.
    """
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
    would cost the gradient's two near-equal terms (teacher and student) their difference."""
    return index_dtype in (torch.float16, torch.bfloat16)
