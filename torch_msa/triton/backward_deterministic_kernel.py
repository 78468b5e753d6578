"""`msa::backward` in Triton, deterministic: every gradient element has one owner and a fixed
summation order, so two runs on the same inputs agree bitwise. It serves the backward under
`torch.use_deterministic_algorithms(True)`; the default backward (`backward_kernel.py`) adds
with atomics instead.

Four kernels:

* `delta = rowsum(dO * O) - grad_lse`, the default backward's preprocess.
* the default backward's `_blocks_kernel` with `DETERMINISTIC=True`: one program per schedule item and
  `BLOCK_N`-key slice of its block keeps dK/dV of the slice on chip while it walks the item's
  queries `TOKENS` at a time with all `G` heads of the KV head. It computes no dQ, and instead of
  adding its dK/dV to the result it stores them in the item's own workspace slot.
* `_key_reduce_kernel`: one program per (bucket, key slice) sums the workspace slots of the
  bucket's items in item order (a block many queries chose is split over several items) and
  writes dK/dV of those keys in the inputs' dtype. Each (KV head, key) belongs to one bucket,
  the one of its document's block, so the writes never overlap.
* `_query_kernel`: query-outer dQ. One program owns one query and KV head, so all `G` rows of
  dQ it writes are its own: it walks the query's `topk` slots in order, loads each selected key
  block and recomputes `P = exp(S - lse)`, `dP = dO V^T` and `dS = P (dP - delta)` to add
  `dS K`. The GEMMs are written transposed (`S^T = K Q^T`, `dQ^T += K^T dS^T`) so that their M
  side is the key slice (64 or 128) rather than the `G` heads. It reads `block_indices` itself
  and skips what the schedule drops: `-1` and negative ids, blocks past the query's causal
  position, and repeats of an earlier slot's id.

The schedule items hold `_ITEM_TILES` query tiles, four times the default backward's, which
bounds the workspace (`2 x items x block_size x D` fp32, about 16 KiB per token at M3 shapes,
less than the default backward's fp32 dQ accumulator) at a small cost in balance.
"""

import torch
import triton
import triton.language as tl

from ..documents import locate_queries
from ..plan import unpack
from .backward_kernel import compute_delta, launch_blocks
from .common import dot_precision
from .forward_kernel import LOG2_E, item_horizon, tile_shape
from .launch import LaunchConfig, launch
from .plan_kernel import build_plan

_ITEM_TILES = 64  # query tiles per schedule item
# `rows`/`block_n` as in the default backward's `_blocks_kernel`, which this one follows minus dQ.
KEY_BLOCKS_CONFIGS = (
    LaunchConfig(rows=128, block_n=64, num_stages=3),
    LaunchConfig(rows=128, block_n=64, num_stages=1),
    LaunchConfig(rows=64, block_n=64, num_stages=1),
    LaunchConfig(rows=64, block_n=32, num_stages=1),
)
KEY_REDUCE_CONFIGS = (LaunchConfig(num_stages=1, num_warps=4, block_n=32),)
# `block_n`: keys of one step of the query kernel; the K/V tiles of `num_stages` steps are in
# flight at once.
QUERY_CONFIGS = (
    LaunchConfig(num_stages=3, num_warps=4, block_n=64),
    LaunchConfig(num_stages=2, num_warps=4, block_n=64),
    LaunchConfig(num_stages=1, num_warps=4, block_n=64),
    LaunchConfig(num_stages=1, num_warps=4, block_n=32),
)
_MIN_DOT = 16  # the smallest dimension `tl.dot` takes


@triton.jit
def _key_reduce_kernel(
    dk_part, dv_part, dk, dv,
    entry_query, item_end, bucket_ptr, bucket_first_item, bucket_head, bucket_key_row, bucket_block, position,
    num_keys, entries_per_item,
    stride_dk_token, stride_dk_head, stride_dv_token, stride_dv_head,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, DIM: tl.constexpr,
):
    bucket = tl.program_id(0)
    bucket_start = tl.load(bucket_ptr + bucket)
    count = tl.load(bucket_ptr + bucket + 1) - bucket_start
    if count <= 0:
        return
    first_item = tl.load(bucket_first_item + bucket).to(tl.int64)
    kv_head = tl.load(bucket_head + bucket)
    slice_start = tl.program_id(1) * BLOCK_N
    dims = tl.arange(0, DIM)
    offsets = tl.arange(0, BLOCK_N)
    key_row = (tl.load(bucket_key_row + bucket) + slice_start + offsets).to(tl.int64)
    key_position = tl.load(bucket_block + bucket) * BLOCK + slice_start + offsets
    dk_sum = tl.zeros((BLOCK_N, DIM), tl.float32)
    dv_sum = tl.zeros((BLOCK_N, DIM), tl.float32)
    written = key_row < 0
    # Items in order: a fixed summation order. An item wrote the keys up to its horizon.
    for rank in range(tl.cdiv(count, entries_per_item)):
        item = first_item + rank
        horizon = item_horizon(entry_query, position, bucket_start + rank * entries_per_item, tl.load(item_end + item),
                               TOPK)
        item_wrote = (key_position <= horizon) & (key_row < num_keys)
        written |= item_wrote
        part = (item * BLOCK + slice_start + offsets)[:, None] * DIM + dims[None, :]
        dk_sum += tl.load(dk_part + part, mask=item_wrote[:, None], other=0.0)
        dv_sum += tl.load(dv_part + part, mask=item_wrote[:, None], other=0.0)
    tl.store(dk + key_row[:, None] * stride_dk_token + kv_head * stride_dk_head + dims[None, :],
             dk_sum.to(dk.dtype.element_ty), mask=written[:, None])
    tl.store(dv + key_row[:, None] * stride_dv_token + kv_head * stride_dv_head + dims[None, :],
             dv_sum.to(dv.dtype.element_ty), mask=written[:, None])


@triton.jit
def _query_kernel(
    q, k, v, grad_out, lse, delta, dq, block_indices, key_start, position,
    num_queries, softmax_scale, qk_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_do_token, stride_do_head, stride_dq_token, stride_dq_head,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    DIM: tl.constexpr, PRECISION: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    dims = tl.arange(0, DIM)
    heads = tl.arange(0, GROUP_P2)
    head_ok = heads < GROUP
    query_head = kv_head * GROUP + heads
    pos = tl.load(position + token)
    first_key = tl.load(key_start + token)

    # The slots that count (the contract's set semantics): a visible id, first in the row.
    slots = tl.arange(0, TOPK_P2)
    ids = tl.load(block_indices + (kv_head * num_queries + token) * TOPK + slots, mask=slots < TOPK, other=-1)
    visible = (ids >= 0) & (pos >= 0) & (ids <= tl.maximum(pos, 0) // BLOCK)
    earlier_same = (ids[:, None] == ids[None, :]) & (slots[None, :] < slots[:, None])
    counted = visible & (tl.max(earlier_same.to(tl.int32), axis=1) == 0)
    blocks = tl.where(counted, ids, -1)

    q_rows = tl.load(q + token * stride_q_token + query_head[:, None] * stride_q_head + dims[None, :],
                     mask=head_ok[:, None], other=0.0)
    d_out = tl.load(grad_out + token * stride_do_token + query_head[:, None] * stride_do_head + dims[None, :],
                    mask=head_ok[:, None], other=0.0)
    head_row = token * (NUM_KV_HEADS * GROUP) + query_head
    row_lse = tl.load(lse + head_row, mask=head_ok, other=0.0) * LOG2_E
    # Like the reference, a query with an empty key set (lse = -inf) shifts by 0, not inf.
    row_lse = tl.where((row_lse == float("inf")) | (row_lse == float("-inf")), 0.0, row_lse)
    row_delta = tl.load(delta + head_row, mask=head_ok, other=0.0)

    offsets = tl.arange(0, BLOCK_N)
    dq_t = tl.zeros((DIM, GROUP_P2), tl.float32)
    SLICES: tl.constexpr = BLOCK // BLOCK_N
    for step in range(TOPK * SLICES):
        block = tl.sum(tl.where(slots == step // SLICES, blocks, 0))  # -1: the slot does not count
        key_position = tl.maximum(block, 0) * BLOCK + (step % SLICES) * BLOCK_N + offsets
        # Keys after the query's position (its document's later keys, or the next document's)
        # are not read, so nothing non-finite of theirs can reach dQ.
        key_ok = (block >= 0) & (key_position <= pos)
        key_row = first_key + key_position.to(tl.int64)
        keys = tl.load(k + key_row[:, None] * stride_k_token + kv_head * stride_k_head + dims[None, :],
                       mask=key_ok[:, None], other=0.0)
        values = tl.load(v + key_row[:, None] * stride_v_token + kv_head * stride_v_head + dims[None, :],
                         mask=key_ok[:, None], other=0.0)
        seen = key_ok[:, None] & head_ok[None, :]
        scores_t = tl.dot(keys, tl.trans(q_rows), input_precision=PRECISION) * qk_scale
        probs_t = tl.where(seen, tl.exp2(scores_t - row_lse[None, :]), 0.0)
        d_probs_t = tl.dot(values, tl.trans(d_out), input_precision=PRECISION)
        d_scores_t = tl.where(seen, probs_t * (d_probs_t - row_delta[None, :]), 0.0).to(keys.dtype)
        dq_t += tl.dot(tl.trans(keys), d_scores_t, input_precision=PRECISION)

    tl.store(dq + token * stride_dq_token + query_head[None, :] * stride_dq_head + dims[:, None],
             (dq_t * softmax_scale).to(dq.dtype.element_ty), mask=head_ok[None, :])


def backward(grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k,
             max_seqlen_q, max_seqlen_k, block_size, softmax_scale, grad_lse=None, plan=None,
             fragment_documents=None, fragment_starts=None, key_blocks=None):
    """Same contract as `torch_msa.reference.backward`: `(dq, dk, dv)` in the inputs' dtype,
    bitwise reproducible. A given `plan` is not read: the key kernels need items of exactly
    `_ITEM_TILES` tiles (the workspace and its reduction are laid out by item), so this backward
    builds its own plan of that item size.

    Shapes: `grad_out`, `q`, `out` `[Tq, Hq, D]`; `k`, `v` `[Tk, Hkv, D]`; `lse`, `grad_lse`
    `[Tq, Hq]` fp32; `block_indices` int32 `[Hkv, Tq, topk]`.

    `key_blocks`, when given, replaces the Triton key-blocks kernel (the SM90 backend passes its
    CuTe kernel's deterministic variant): called as `key_blocks(q, k, v, grad_out, lse, delta,
    dk_part, dv_part, schedule, topk, softmax_scale)`, it must store every item's dK (scaled) and
    dV of the keys up to the item's horizon into the item's workspace rows `item * block_size + c`
    (fp32 `[items * block_size, D]`).
    """
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    topk = block_indices.shape[-1]
    device = q.device
    dk = torch.zeros(k.shape, dtype=k.dtype, device=device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=device)
    if num_queries == 0 or num_keys == 0 or topk == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=device), dk, dv
    dq = torch.empty(q.shape, dtype=q.dtype, device=device)  # `_query_kernel` writes every row
    q, k, v, grad_out, out = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, grad_out, out))
    lse = lse.contiguous()
    block_indices = block_indices.contiguous()
    delta = torch.empty((num_queries, num_heads), dtype=torch.float32, device=device)
    entries_per_item = tile_shape(num_heads, num_kv_heads, KEY_BLOCKS_CONFIGS[0].rows)[0] * _ITEM_TILES
    schedule = unpack(build_plan(block_indices, cu_seqlens_q, cu_seqlens_k, num_keys, block_size, entries_per_item,
                                 fragment_documents, fragment_starts),
                      block_indices, num_keys, cu_seqlens_k.numel() - 1, block_size)
    num_buckets = schedule.bucket_head.numel()
    bucket_first_item = torch.searchsorted(
        schedule.item_bucket, torch.arange(num_buckets, device=device, dtype=torch.int32), out_int32=True
    )
    docs = locate_queries(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys, fragment_documents, fragment_starts)
    workspace_rows = schedule.item_start.numel() * block_size
    dk_part = torch.empty((workspace_rows, dim), dtype=torch.float32, device=device)
    dv_part = torch.empty((workspace_rows, dim), dtype=torch.float32, device=device)
    shape_key = (device, q.dtype, dim, block_size, group, topk)
    precision = dot_precision(q.dtype)

    def launch_key_reduce(config):
        block_n = min(config.block_n, block_size)
        _key_reduce_kernel[(num_buckets, block_size // block_n)](
            dk_part, dv_part, dk, dv,
            schedule.entry_query, schedule.item_end, schedule.bucket_ptr, bucket_first_item,
            schedule.bucket_head, schedule.bucket_key_row, schedule.bucket_block, schedule.position,
            num_keys, entries_per_item,
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            TOPK=topk, BLOCK=block_size, BLOCK_N=block_n, DIM=dim,
            **config.options,
        )

    def launch_query(config):
        _query_kernel[(num_queries, num_kv_heads)](
            q, k, v, grad_out, lse, delta, dq, block_indices, docs.key_start, docs.position,
            num_queries, softmax_scale, softmax_scale * LOG2_E.value,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1),
            NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P2=max(_MIN_DOT, triton.next_power_of_2(group)),
            TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), BLOCK=block_size,
            BLOCK_N=min(config.block_n, block_size), DIM=dim, PRECISION=precision,
            **config.options,
        )

    compute_delta(grad_out, out, grad_lse, delta, shape_key)
    if key_blocks is not None:
        key_blocks(q, k, v, grad_out, lse, delta, dk_part, dv_part, schedule, topk, softmax_scale)
    else:
        launch_blocks(q, k, v, grad_out, lse, delta, (dk_part, dk_part, dv_part), schedule, topk, block_size,
                      softmax_scale, KEY_BLOCKS_CONFIGS, "backward_deterministic._blocks_kernel", shape_key,
                      deterministic=True)
    launch("backward_deterministic._key_reduce_kernel", shape_key, KEY_REDUCE_CONFIGS, launch_key_reduce)
    launch("backward_deterministic._query_kernel", shape_key, QUERY_CONFIGS, launch_query)
    return dq, dk, dv
