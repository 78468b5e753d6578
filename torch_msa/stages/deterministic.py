"""The fixed-order stages of the deterministic backward (design: `torch_msa/stages/README.md`)."""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..plan.kernels import schedule_for, with_items
from ..plan.schedule import Schedule
from ..triton_utils.common import LOG2_E, dot_precision, item_horizon, locate_queries, program_token_group, tile_shape
from ..triton_utils.launch import LaunchConfig, cached_launches, launch
from ..uninitialized import uninitialized
from .delta import compute_delta

ITEM_TILES = 64  # query tiles of `TILE_ROWS` rows per item: bounds the workspace
KEY_REDUCE_CONFIGS = (LaunchConfig(num_stages=1, num_warps=4, block_n=32),)
QUERY_CONFIGS = (
    LaunchConfig(num_stages=3, num_warps=4, block_n=64),
    LaunchConfig(num_stages=2, num_warps=4, block_n=64),
    LaunchConfig(num_stages=1, num_warps=4, block_n=64),
    LaunchConfig(num_stages=1, num_warps=4, block_n=32),
)
_MIN_DOT = 16  # the smallest dimension `tl.dot` takes


class KeyWorkspace(NamedTuple):
    """What the key pass of a deterministic backward writes and `reduce_key_workspace` reads.

    Attributes:
        schedule: the schedule both walk, with items of `entries_per_item` entries.
        entries_per_item: the item size of `schedule`.
        bucket_first_item: int32 `[max_buckets]`, the first item of each bucket (the items of a
            bucket are consecutive).
        dk_part, dv_part: fp32 `[max_items * block_size, D]`: item `i`'s dK (times
            `softmax_scale`) and dV of its block's key `c` in row `i * block_size + c`, for the
            keys up to the item's horizon (`common.item_horizon`) inside the packed keys.
    """

    schedule: Schedule
    entries_per_item: int
    bucket_first_item: torch.Tensor
    dk_part: torch.Tensor
    dv_part: torch.Tensor


def bucket_first_items(schedule: Schedule) -> torch.Tensor:
    """int32 `[max_buckets]`: the first item of each bucket of `schedule` (a bucket's items are
    consecutive)."""
    num_buckets = schedule.bucket_head.numel()
    return torch.searchsorted(
        schedule.item_bucket, torch.arange(num_buckets, device=schedule.item_bucket.device, dtype=torch.int32),
        out_int32=True,
    )


def workspace_entries_per_item(num_heads: int, num_kv_heads: int) -> int:
    """Entries per item of the deterministic backward's walk: `ITEM_TILES` query tiles."""
    return tile_shape(num_heads, num_kv_heads)[0] * ITEM_TILES


def key_workspace(schedule: Schedule, block_size, num_heads, num_kv_heads, head_dim) -> KeyWorkspace:
    """`schedule` in items of `ITEM_TILES` query tiles and its empty workspace, on its device.

    Args:
        schedule: the step's schedule (any item size); block_size: keys per block.
        num_heads, num_kv_heads: `Hq` and `Hkv`, which size the query tiles; head_dim: `D`.
    """
    device = schedule.entry_query.device
    entries_per_item = workspace_entries_per_item(num_heads, num_kv_heads)
    schedule = with_items(schedule, entries_per_item)
    rows = schedule.item_start.numel() * block_size
    dk_part = uninitialized((rows, head_dim), dtype=torch.float32, device=device)
    dv_part = uninitialized((rows, head_dim), dtype=torch.float32, device=device)
    return KeyWorkspace(schedule, entries_per_item, bucket_first_items(schedule), dk_part, dv_part)


@cached_launches
@triton.jit
def msa_bwd_key_reduce_kernel(
    dk_part, dv_part, dk, dv,
    entry_query, item_end, bucket_ptr, bucket_first_item, bucket_head, bucket_key_row, bucket_block, position,
    num_keys, entries_per_item,
    stride_dk_token, stride_dk_head, stride_dv_token, stride_dv_head,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, DIM: tl.constexpr, PAIR: tl.constexpr = True,
):
    """`PAIR`: two workspaces (`dk_part`, `dv_part`) into two outputs; without it only `dk_part`
    into `dk` (`dv_part` and `dv` are not read)."""
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
    # Items in order: a fixed summation order.
    for rank in range(tl.cdiv(count, entries_per_item)):
        item = first_item + rank
        horizon = item_horizon(entry_query, position, bucket_start + rank * entries_per_item, tl.load(item_end + item),
                               TOPK)
        item_wrote = (key_position <= horizon) & (key_row < num_keys)
        written |= item_wrote
        part = (item * BLOCK + slice_start + offsets)[:, None] * DIM + dims[None, :]
        dk_sum += tl.load(dk_part + part, mask=item_wrote[:, None], other=0.0)
        if PAIR:
            dv_sum += tl.load(dv_part + part, mask=item_wrote[:, None], other=0.0)
    tl.store(dk + key_row[:, None] * stride_dk_token + kv_head * stride_dk_head + dims[None, :],
             dk_sum.to(dk.dtype.element_ty), mask=written[:, None])
    if PAIR:
        tl.store(dv + key_row[:, None] * stride_dv_token + kv_head * stride_dv_head + dims[None, :],
                 dv_sum.to(dv.dtype.element_ty), mask=written[:, None])


@cached_launches
@triton.jit
def msa_bwd_dq_kernel(
    q, k, v, grad_out, lse, delta, dq, row_redo, block_indices, key_start, position,
    num_queries, softmax_scale, qk_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_do_token, stride_do_head, stride_dq_token, stride_dq_head,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    DIM: tl.constexpr, PRECISION: tl.constexpr, REDO_ONLY: tl.constexpr,
):
    token, kv_head, heads, head_ok = program_token_group(GROUP, GROUP_P2)
    query_head = kv_head * GROUP + heads
    head_row = token * (NUM_KV_HEADS * GROUP) + query_head
    if REDO_ONLY:
        # Only the flagged rows; a program without one does nothing.
        head_ok &= tl.load(row_redo + head_row, mask=head_ok, other=0) != 0
    if tl.max(head_ok.to(tl.int32)) > 0:
        dims = tl.arange(0, DIM)
        pos = tl.load(position + token)
        first_key = tl.load(key_start + token)

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


def reduce_item_rows(schedule: Schedule, entries_per_item: int, bucket_first_item: torch.Tensor, parts, outputs,
                     topk, block_size, shape_key) -> None:
    """Sum each bucket's item rows of one or two workspaces, in item order, into the bucket's keys.

    Args:
        schedule, entries_per_item: a schedule with items of that size; bucket_first_item: its
            `bucket_first_items`.
        parts: one or two contiguous fp32 workspaces `[max_items * block_size, W]`, laid out as
            `KeyWorkspace.dk_part`.
        outputs: as many `[Tk, H, W]` tensors (H the schedule's heads), unit stride in W; the
            rows some item wrote are written in their dtype, the others left as they are.
        topk: slots per query of the `block_indices` the schedule was built from.
        block_size: keys per block.
        shape_key: the launch memo's key (`launch.launch`).
    """
    pair = len(parts) == 2
    first, second = outputs[0], outputs[-1]
    num_keys, _, width = first.shape

    def launch_key_reduce(config):
        block_n = min(config.block_n, block_size)
        msa_bwd_key_reduce_kernel[(schedule.bucket_head.numel(), block_size // block_n)](
            parts[0], parts[-1], first, second,
            schedule.entry_query, schedule.item_end, schedule.bucket_ptr, bucket_first_item,
            schedule.bucket_head, schedule.bucket_key_row, schedule.bucket_block, schedule.position,
            num_keys, entries_per_item,
            first.stride(0), first.stride(1), second.stride(0), second.stride(1),
            TOPK=topk, BLOCK=block_size, BLOCK_N=block_n, DIM=width, PAIR=pair,
            **config.options,
        )

    launch("msa_bwd_key_reduce_kernel", (*shape_key, pair), KEY_REDUCE_CONFIGS, launch_key_reduce)


def reduce_key_workspace(workspace: KeyWorkspace, dk, dv, topk, block_size, shape_key) -> None:
    """Sum each bucket's item slots of `workspace`, in item order, into the bucket's keys of `dk`, `dv`.

    Args:
        workspace: filled by a key pass over `workspace.schedule`.
        dk, dv: `[Tk, Hkv, D]` in the inputs' dtype, unit stride in D; the keys some item reads are
            written, the others left as they are.
        topk: slots per query of the `block_indices` the schedule was built from.
        block_size: keys per block.
        shape_key: the launch memo's key (`launch.launch`).
    """
    reduce_item_rows(workspace.schedule, workspace.entries_per_item, workspace.bucket_first_item,
                     (workspace.dk_part, workspace.dv_part), (dk, dv), topk, block_size, shape_key)


def query_dq(q, k, v, grad_out, lse, delta, dq, block_indices, documents, block_size, softmax_scale,
             shape_key, row_redo: torch.Tensor | None = None) -> None:
    """dQ, query-outer: every row of `dq` (with `row_redo`, every row it flags) written by the one
    program that owns it, its sum over its selection in fp32.

    Args:
        q, grad_out: `[Tq, Hq, D]`; k, v: `[Tk, Hkv, D]`; one dtype, unit stride in D.
        lse: fp32 `[Tq, Hq]` contiguous, natural log; delta: fp32 `[Tq, Hq]` contiguous, from
            `compute_delta`.
        dq: `[Tq, Hq, D]` in q's dtype, unit stride in D; written.
        block_indices: int32 `[Hkv, Tq, topk]`, contiguous.
        documents: the documents.
        block_size: keys per block; softmax_scale: the scale of `q k^T`.
        shape_key: the launch memo's key (`launch.launch`).
        row_redo: None, or int8 `[Tq, Hq]` contiguous: only the rows where it is not 0 are
            written, the others left as they are (`torch_msa.stages.dq.ungroup_dq`'s flags).
    """
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    redo_only = row_redo is not None
    topk = block_indices.shape[-1]
    docs = locate_queries(documents.cu_seqlens_q, documents.cu_seqlens_k, num_queries, num_keys, *documents.fragments)
    precision = dot_precision(q.dtype)

    def launch_query(config):
        msa_bwd_dq_kernel[(num_queries, num_kv_heads)](
            q, k, v, grad_out, lse, delta, dq, row_redo if redo_only else lse, block_indices, docs.key_start,
            docs.position,
            num_queries, softmax_scale, softmax_scale * LOG2_E.value,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1),
            NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P2=max(_MIN_DOT, triton.next_power_of_2(group)),
            TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), BLOCK=block_size,
            BLOCK_N=min(config.block_n, block_size), DIM=dim, PRECISION=precision, REDO_ONLY=redo_only,
            **config.options,
        )

    launch("msa_bwd_dq_kernel", (*shape_key, redo_only), QUERY_CONFIGS, launch_query)


class DeterministicBackward(NamedTuple):
    """A deterministic backward between `begin` and `finish`.

    `q, k, v, grad_out` unit-stride in D, `lse` contiguous, `delta` fp32 `[Tq, Hq]` computed;
    `dq, dk, dv` the gradients in the inputs' dtype (`dk`, `dv` zeroed, `dq` written by `finish`
    or by the caller's own dQ stage);
    `empty`: no query, key or slot, the gradients are zeros and `workspace` is None. `shape_key`:
    the launch memo's key (`launch.launch`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    block_indices: torch.Tensor
    workspace: KeyWorkspace | None
    topk: int
    shape_key: tuple
    empty: bool


def deterministic_begin(grad_out, q, k, v, out, lse, block_indices, documents, block_size, grad_lse,
                        plan=None) -> DeterministicBackward:
    """The gradients' buffers, delta and the key workspace of `msa::backward`'s inputs (shapes as
    in `torch_msa.reference.backward`; `plan` as `torch_msa.plan.kernels.schedule_for` takes it).

    Raises:
        ValueError: a plan whose length does not fit the inputs.
    """
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    topk = block_indices.shape[-1]
    device = q.device
    dk = torch.zeros(k.shape, dtype=k.dtype, device=device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=device)
    shape_key = (device, q.dtype, dim, block_size, num_heads // num_kv_heads, topk)
    if num_queries == 0 or num_keys == 0 or topk == 0:
        dq = torch.zeros(q.shape, dtype=q.dtype, device=device)
        return DeterministicBackward(q, k, v, grad_out, lse, lse, dq, dk, dv, block_indices, None, topk, shape_key, True)
    dq = uninitialized(q.shape, dtype=q.dtype, device=device)  # the dQ stage writes every row
    q, k, v, grad_out, out = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, grad_out, out))
    delta = uninitialized((num_queries, num_heads), dtype=torch.float32, device=device)
    compute_delta(grad_out, out, grad_lse, delta, shape_key)
    block_indices = block_indices.contiguous()
    schedule = schedule_for(block_indices, documents, num_keys, block_size, num_heads, plan)
    workspace = key_workspace(schedule, block_size, num_heads, num_kv_heads, dim)
    return DeterministicBackward(q, k, v, grad_out, lse.contiguous(), delta, dq, dk, dv, block_indices, workspace,
                                 topk, shape_key, False)


def deterministic_finish(state: DeterministicBackward, documents, block_size, softmax_scale):
    """`(dq, dk, dv)`: the key pass's slots reduced into dK/dV in item order, and dQ query-outer."""
    if not state.empty:
        assert state.workspace is not None
        reduce_key_workspace(state.workspace, state.dk, state.dv, state.topk, block_size, state.shape_key)
        query_dq(state.q, state.k, state.v, state.grad_out, state.lse, state.delta, state.dq, state.block_indices,
                 documents, block_size, softmax_scale, state.shape_key)
    return state.dq, state.dk, state.dv
