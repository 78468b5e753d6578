"""The row scales of a dQ added in fixed point (design: `README.md`, "dQ in fixed point").

A kernel that adds each (row, block) share of dQ as a 32-bit integer, `round(share * scale)`, gets
sums that do not depend on the order the shares arrive in. Each (query, head) row takes its own
scale, a power of two chosen from a bound on its shares over the blocks it selects, so that no sum
can leave int32's range and the bound keeps at least `bound_bits(topk) - 1` bits; the final cast
(`torch_msa.stages.dq.ungroup_dq` with `row_scale`) divides it out. A bound holds for every row
but may lie far above a row's actual dQ (a key that stands out in K and V widens the bound of the
rows that select its block by its factor squared): the cast flags each row whose largest sum is
below `recompute_below(topk)` units, whose rounding could exceed `2**-RECOMPUTE_BITS` of it (but
not one at the clamp `2**MAX_EXPONENT`, whose bound vanishes), and the backward recomputes those
rows query-outer in fp32 (`torch_msa.stages.deterministic.query_dq`
with `row_redo`).
"""

import math

import torch
import triton
import triton.language as tl

from ..documents import Documents
from ..triton_utils.common import binary_search_steps, find_segments, locate_tokens
from ..triton_utils.launch import LaunchConfig, cached_launches, launch
from ..uninitialized import uninitialized

SUM_BITS = 30
"""A row's shares, each at most `2**SUM_BITS / topk` once scaled, sum inside int32's range."""
MAX_EXPONENT = 126
"""Row scales lie in `2**-MAX_EXPONENT .. 2**MAX_EXPONENT`, normal fp32 numbers both ways."""

MAXIMA_CONFIGS = (LaunchConfig(num_stages=2, num_warps=4, rows=64),)
SCALE_CONFIGS = (LaunchConfig(num_stages=2, num_warps=4, rows=64),)


RECOMPUTE_BITS = 7
"""A fixed-point row's rounding stays within `2**-RECOMPUTE_BITS` of its largest |dQ|, or the row is
recomputed: the default backward's own worst rows lie near there (P and dS enter the tensor
cores rounded to 16 bits)."""


def recompute_below(topk: int) -> int:
    """Units under which a row's largest |sum| is recomputed: its `topk` shares round by at most
    half a unit each, `topk / 2` units, which is `2**-RECOMPUTE_BITS` of this."""
    return topk * 2 ** (RECOMPUTE_BITS - 1)


def share_cap(topk: int) -> float:
    """The largest scaled share a kernel may add: `topk` of them sum inside `2**SUM_BITS`."""
    return 2.0**SUM_BITS / topk


def bound_bits(topk: int) -> int:
    """Bits of a row's scaled bound: `2**bound_bits(topk) <= share_cap(topk)`."""
    return SUM_BITS - math.ceil(math.log2(topk))


@triton.jit
def _finite_row_norm(x):
    """Per row of fp32 `x`, the L2 norm of its finite elements, scaled by its largest so that it
    cannot overflow where the elements do not."""
    finite = tl.where(tl.abs(x) < float("inf"), x, 0.0)
    largest = tl.max(tl.abs(finite), axis=1)
    inverse = tl.where(largest > 0, 1.0 / largest, 0.0)
    scaled = finite * inverse[:, None]
    return largest * tl.sqrt(tl.sum(scaled * scaled, axis=1))


@triton.jit
def _block_slot(doc_start, doc, block, BLOCK: tl.constexpr):
    """The maxima slot of block `block` of the document `doc` whose keys start at `doc_start` (>= 0):
    distinct for every (document, block), below `cdiv(Tk, BLOCK) + num_docs`."""
    return doc_start // BLOCK + doc + block


@cached_launches
@triton.jit
def msa_bwd_key_maxima_kernel(
    k, v, cu_seqlens_k, maxima, num_keys, num_docs, search_steps,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    NUM_KV_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    # maxima[slot, kv_head] = (max |K|, max ||V||) over the finite values of one document's block
    # (`_block_slot`), as int32 bits: non-negative fp32 numbers order as their bits do.
    keys = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    kv_head = tl.program_id(1)
    key_ok = keys < num_keys
    doc, in_range = find_segments(keys, key_ok, cu_seqlens_k, num_docs, search_steps)
    doc_start = tl.load(cu_seqlens_k + doc, mask=key_ok & in_range, other=0).to(tl.int64)
    ok = key_ok & in_range & (keys >= doc_start) & (doc_start >= 0)
    dims = tl.arange(0, DIM)
    keys_k = tl.load(k + keys[:, None] * stride_k_token + kv_head * stride_k_head + dims[None, :],
                     mask=ok[:, None], other=0.0).to(tl.float32)
    keys_v = tl.load(v + keys[:, None] * stride_v_token + kv_head * stride_v_head + dims[None, :],
                     mask=ok[:, None], other=0.0).to(tl.float32)
    key_max = tl.max(tl.where(tl.abs(keys_k) < float("inf"), tl.abs(keys_k), 0.0), axis=1)
    value_norm = _finite_row_norm(keys_v)
    slot = _block_slot(doc_start, doc, (keys - doc_start) // BLOCK, BLOCK)
    first_slot = tl.min(tl.where(ok, slot, num_keys + num_docs))
    last_slot = tl.max(tl.where(ok, slot, -1))
    if first_slot == last_slot:  # the common case, one block of one document: one atomic each
        one = maxima + (first_slot * NUM_KV_HEADS + kv_head) * 2
        tl.atomic_max(one, tl.max(key_max).to(tl.int32, bitcast=True))
        tl.atomic_max(one + 1, tl.max(value_norm).to(tl.int32, bitcast=True))
    else:
        each = maxima + (slot * NUM_KV_HEADS + kv_head) * 2
        tl.atomic_max(each, key_max.to(tl.int32, bitcast=True), mask=ok)
        tl.atomic_max(each + 1, value_norm.to(tl.int32, bitcast=True), mask=ok)


@cached_launches
@triton.jit
def msa_bwd_dq_scale_kernel(
    grad_out, delta, maxima, block_indices, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
    dq_scale, num_queries, num_keys, num_segments, num_docs, search_steps, stride_grad_token, stride_grad_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, ROWS: tl.constexpr, BOUND_BITS: tl.constexpr,
    MAX_EXPONENT: tl.constexpr, FRAGMENTS: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < num_queries * NUM_HEADS
    token = rows // NUM_HEADS
    head = rows % NUM_HEADS
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    position, key_start, doc = locate_tokens(token, row_ok, cu_seqlens_q, cu_seqlens_k, fragment_documents,
                                             fragment_starts, num_keys, num_segments, num_docs, search_steps,
                                             FRAGMENTS)
    # The blocks the backward walks for the row: its selection's ids that it sees (a superset of
    # the schedule's entries, which also drops repeats).
    slots = tl.arange(0, TOPK_P2)
    located = row_ok & (position >= 0)
    ids = tl.load(block_indices + (kv_head[:, None] * num_queries + token[:, None]) * TOPK + slots[None, :],
                  mask=located[:, None] & (slots[None, :] < TOPK), other=-1)
    seen = (ids >= 0) & (ids <= position[:, None] // BLOCK)
    entry = maxima + (_block_slot(key_start[:, None], doc[:, None], tl.where(seen, ids, 0), BLOCK) * NUM_KV_HEADS
                      + kv_head[:, None]) * 2
    key_max = tl.max(tl.load(entry, mask=seen, other=0).to(tl.float32, bitcast=True), axis=1)
    value_norm = tl.max(tl.load(entry + 1, mask=seen, other=0).to(tl.float32, bitcast=True), axis=1)
    dims = tl.arange(0, DIM)
    d_out = tl.load(grad_out + token[:, None] * stride_grad_token + head[:, None] * stride_grad_head + dims[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
    row_delta = tl.load(delta + rows, mask=row_ok, other=0.0)
    # |dP| <= ||dO|| ||V|| and P sums to 1 over the row, so each share of `dS K` and their sum are
    # below half of this; twice for P and dS rounded to 16 bits. fp64: no product of fp32 values
    # overflows or underflows it.
    bound = 2.0 * ((_finite_row_norm(d_out).to(tl.float64) * value_norm.to(tl.float64)
                    + tl.abs(row_delta).to(tl.float64)) * key_max.to(tl.float64))
    bound = tl.where(tl.max(seen.to(tl.int32), axis=1) > 0, bound, 0.0)  # no keys: no shares
    # bound < 2**(e + 1) for its exponent e (a zero bound reads as -1023).
    exponent = ((bound.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023
    shift = tl.minimum(BOUND_BITS - 1 - exponent, MAX_EXPONENT)
    scale = ((tl.maximum(shift, -MAX_EXPONENT) + 127) << 23).to(tl.int32).to(tl.float32, bitcast=True)
    # A bound no scale serves (beyond fp32's range, or not finite): the row is refused, NaN.
    tl.store(dq_scale + rows, tl.where(shift >= -MAX_EXPONENT, scale, float("nan")), mask=row_ok)


def dq_scales(grad_out: torch.Tensor, delta: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              block_indices: torch.Tensor, documents: Documents, block_size: int, shape_key) -> torch.Tensor:
    """fp32 `[Tq, Hq]`: each row's scale, `2**e` for the largest `e` (up to `MAX_EXPONENT`) that
    keeps its bound below `2**bound_bits(topk)`. The bound covers the row's every share of the
    unscaled `dS K` and their sum: `2 (||dO|| max ||V|| + |delta|) max |K|`, the maxima over the
    finite values of the blocks the row selects and sees, each within its own document (per KV
    head). So it needs no sync, no other document moves it, and neither does a block the row does
    not select. A row whose bound no scale serves (one past `2**(bound_bits - 1 + MAX_EXPONENT)`,
    or not finite) gets NaN: the cast writes it as NaN, never as a silent zero.

    Args:
        grad_out: `[Tq, Hq, D]`, unit stride in D; delta: fp32 `[Tq, Hq]`, contiguous.
        k, v: `[Tk, Hkv, D]`, unit stride in D.
        block_indices: int32 `[Hkv, Tq, topk]`, contiguous.
        documents: the call's documents (fragments included); block_size: keys per block.
        shape_key: the launch memo's key (`launch.launch`).
    """
    num_queries, num_heads, dim = grad_out.shape
    num_keys, num_kv_heads, _ = k.shape
    topk = block_indices.shape[-1]
    device = grad_out.device
    num_docs = documents.num_documents
    dq_scale = uninitialized((num_queries, num_heads), dtype=torch.float32, device=device)
    if num_queries == 0:
        return dq_scale
    maxima = torch.zeros((triton.cdiv(num_keys, block_size) + num_docs + 1, num_kv_heads, 2), dtype=torch.int32,
                         device=device)
    cu_seqlens_q, cu_seqlens_k = documents.cu_seqlens_q.contiguous(), documents.cu_seqlens_k.contiguous()

    def launch_maxima(config):
        msa_bwd_key_maxima_kernel[(triton.cdiv(num_keys, config.rows), num_kv_heads)](
            k, v, cu_seqlens_k, maxima, num_keys, num_docs, binary_search_steps(num_docs),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            NUM_KV_HEADS=num_kv_heads, DIM=dim, BLOCK=block_size, ROWS=config.rows, **config.options,
        )

    if num_keys > 0 and num_docs > 0:
        launch("msa_bwd_key_maxima_kernel", shape_key, MAXIMA_CONFIGS, launch_maxima)
    fragment_documents, fragment_starts = documents.fragments
    fragments = fragment_documents is not None and fragment_starts is not None
    if fragment_documents is None or fragment_starts is None:
        fragment_documents = fragment_starts = cu_seqlens_q  # unread
    fragment_documents, fragment_starts = fragment_documents.contiguous(), fragment_starts.contiguous()
    num_segments = cu_seqlens_q.numel() - 1

    def launch_scale(config):
        msa_bwd_dq_scale_kernel[(triton.cdiv(num_queries * num_heads, config.rows),)](
            grad_out, delta, maxima, block_indices, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
            dq_scale, num_queries, num_keys, num_segments, num_docs, binary_search_steps(num_segments),
            grad_out.stride(0), grad_out.stride(1),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, DIM=dim, BLOCK=block_size, TOPK=topk,
            TOPK_P2=triton.next_power_of_2(topk), ROWS=config.rows, BOUND_BITS=bound_bits(topk),
            MAX_EXPONENT=MAX_EXPONENT, FRAGMENTS=fragments, **config.options,
        )

    launch("msa_bwd_dq_scale_kernel", (*shape_key, fragments), SCALE_CONFIGS, launch_scale)
    return dq_scale
