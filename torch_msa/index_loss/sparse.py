"""`msa::indexer_kl` and `msa::indexer_kl_backward` on the sparse support in Triton, KV-outer, and
the index loss from a given teacher (design: `torch_msa/index_loss/README.md`).
"""

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..backends import UnsupportedInputs
from ..plan.kernels import schedule_for, with_items
from ..plan.schedule import entries_per_item
from ..reference_index_loss import loss_dtype
from ..triton_utils.common import LN_2, LOG2_E, dot_precision, item_horizon, program_item, split_weights, weighted_dot
from ..triton_utils.launch import LaunchConfig, cached_launches, launch
from ..uninitialized import uninitialized

# `rows`: teacher rows (tokens x heads) of a forward tile; tokens of the other kernels' tiles.
FORWARD_CONFIGS = (LaunchConfig(rows=64, num_stages=2, num_warps=8), LaunchConfig(rows=64, num_stages=1))
FROM_TEACHER_CONFIGS = (LaunchConfig(rows=64, num_stages=2, num_warps=8), LaunchConfig(rows=32, num_stages=1))
BACKWARD_CONFIGS = (LaunchConfig(rows=64, num_stages=2, num_warps=8), LaunchConfig(rows=32, num_stages=1))


def check_inputs(lse_present: bool, index_q) -> None:
    """Decline, before any launch, what these kernels do not serve (the reference does).

    Raises:
        UnsupportedInputs: no lse, or an index head dim that is not a power of two in [16, 256].
    """
    if not lse_present:
        raise UnsupportedInputs("no lse: the Triton KL kernels take the attention's lse")
    index_dim = index_q.shape[-1]
    if index_dim < 16 or index_dim > 256 or index_dim & (index_dim - 1):
        raise UnsupportedInputs(f"index head dim {index_dim} (the Triton KL kernels take a power of two in [16, 256])")


def check_atomics_allowed() -> None:
    """Decline under deterministic algorithms (`sparse_deterministic.py` serves that mode).

    Raises:
        UnsupportedInputs: `torch.are_deterministic_algorithms_enabled()`.
    """
    if torch.are_deterministic_algorithms_enabled():
        raise UnsupportedInputs("deterministic algorithms were requested and the Triton KL kernels add with atomics")


def index_loss_tile_shape(num_heads: int, num_kv_heads: int, rows: int = 128) -> tuple[int, int]:
    """`(tokens, heads_per_pass)` of a forward tile: its queries (at least 16) and the query heads
    one teacher GEMM of about `rows` rows takes."""
    group_p2 = triton.next_power_of_2(num_heads // num_kv_heads)
    tokens = max(16, rows // group_p2)
    return tokens, max(1, min(group_p2, rows // tokens))


@triton.jit
def _item_block(
    index_k, entry_query, item_start, item_end, item_bucket, bucket_head, bucket_key_row, bucket_block, position,
    num_keys, stride_ik_token, TOPK: tl.constexpr, BLOCK: tl.constexpr, INDEX_DIM: tl.constexpr,
):
    """The prologue of every index loss kernel: `(item, start, end, kv_head, key_row,
    key_position, key_ok, index_keys [BLOCK, INDEX_DIM])`, zeros where not `key_ok`. An unused
    item has no `key_ok` key (its horizon is -1), so its callers need no early return."""
    item, start, end = program_item(item_start, item_end)
    bucket = tl.load(item_bucket + item)
    kv_head = tl.load(bucket_head + bucket)
    offsets = tl.arange(0, BLOCK)
    key_row = (tl.load(bucket_key_row + bucket) + offsets).to(tl.int64)
    key_position = tl.load(bucket_block + bucket) * BLOCK + offsets
    # The block's tail may be the next document's: keep its values from meeting a zero weight (0 * NaN).
    key_ok = (key_position <= item_horizon(entry_query, position, start, end, TOPK)) & (key_row < num_keys)
    index_keys = tl.load(index_k + key_row[:, None] * stride_ik_token + tl.arange(0, INDEX_DIM)[None, :],
                         mask=key_ok[:, None], other=0.0)
    return item, start, end, kv_head, key_row, key_position, key_ok, index_keys


@triton.jit
def _student_tile(
    index_q, index_keys, entry_query, position, first, end, kv_head, key_position, key_ok, index_scale,
    stride_iq_token, stride_iq_head,
    TOKENS: tl.constexpr, TOPK: tl.constexpr, INDEX_DIM: tl.constexpr, INDEX_PRECISION: tl.constexpr,
):
    """The student's side of a tile of `TOKENS` entries: `(logits [TOKENS, BLOCK]` (log2 domain,
    `-inf` off the support), `visible`, `index_queries [TOKENS, Di]` (zeros for padding), the
    entries' `t * topk + slot`, `token_ok)`."""
    tokens = tl.arange(0, TOKENS)
    token_ok = first + tokens < end
    query = tl.load(entry_query + first + tokens, mask=token_ok, other=0)
    token = (query // TOPK).to(tl.int64)
    pos = tl.load(position + token, mask=token_ok, other=-1)
    visible = (key_position[None, :] <= pos[:, None]) & key_ok[None, :] & token_ok[:, None]
    index_queries = tl.load(
        index_q + token[:, None] * stride_iq_token + kv_head * stride_iq_head + tl.arange(0, INDEX_DIM)[None, :],
        mask=token_ok[:, None], other=0.0)
    logits = tl.dot(index_queries, tl.trans(index_keys), input_precision=INDEX_PRECISION) * index_scale
    logits = tl.where(visible, logits, float("-inf"))
    return logits, visible, index_queries, query, token_ok


@triton.jit
def _teacher_tile(
    q, k_block, lse, entry_query, first, end, kv_head, visible, qk_scale, stride_q_token, stride_q_head,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEADS_PER_PASS: tl.constexpr, TOKENS: tl.constexpr,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr, PRECISION: tl.constexpr,
):
    """Teacher probabilities `[TOKENS, BLOCK]` of a tile, the mean over each entry's `G` query
    heads; 0 where not `visible`."""
    rows = tl.arange(0, TOKENS * HEADS_PER_PASS)
    row_token_ok = first + rows // HEADS_PER_PASS < end
    row_token = (tl.load(entry_query + first + rows // HEADS_PER_PASS, mask=row_token_ok, other=0) // TOPK).to(tl.int64)
    dims = tl.arange(0, DIM)
    teacher = tl.zeros((TOKENS, BLOCK), tl.float32)
    for first_head in range(0, GROUP, HEADS_PER_PASS):
        group_head = first_head + rows % HEADS_PER_PASS
        row_ok = row_token_ok & (group_head < GROUP)
        query_head = kv_head * GROUP + group_head
        q_rows = tl.load(q + row_token[:, None] * stride_q_token + query_head[:, None] * stride_q_head + dims[None, :],
                         mask=row_ok[:, None], other=0.0)
        row_lse = tl.load(lse + row_token * (NUM_KV_HEADS * GROUP) + query_head, mask=row_ok, other=0.0)
        row_lse = row_lse * LOG2_E
        # A query whose key set is empty (lse = -inf) shifts by 0, as in the attention backward.
        row_lse = tl.where((row_lse == float("inf")) | (row_lse == float("-inf")), 0.0, row_lse)
        scores = tl.dot(q_rows, tl.trans(k_block), input_precision=PRECISION) * qk_scale
        probs = tl.exp2(scores - row_lse[:, None])
        if GROUP % HEADS_PER_PASS != 0:
            # The last pass's padding heads (zero rows of q, so probability 1) must add nothing.
            probs = tl.where((group_head < GROUP)[:, None], probs, 0.0)
        teacher += tl.sum(tl.reshape(probs, (TOKENS, HEADS_PER_PASS, BLOCK)), axis=1)
    # Masking the sum, not each head, clears whatever the hidden pairs held (Inf, NaN) once per pair.
    return tl.where(visible, teacher * (1.0 / GROUP), 0.0)


@triton.jit
def _given_teacher_tile(teacher, query, kv_head, visible, NUM_KV_HEADS: tl.constexpr, TOPK: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Teacher probabilities `[TOKENS, BLOCK]` (fp32) of a tile from a given teacher
    `[Tq, Hi, topk, BLOCK]` (row `(t * Hi + r) * topk + s`); only `visible` pairs are read, the
    others are 0."""
    row = (query // TOPK).to(tl.int64) * (NUM_KV_HEADS * TOPK) + kv_head * TOPK + query % TOPK
    rows = tl.load(teacher + row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :], mask=visible, other=0.0)
    return rows.to(tl.float32)


@triton.jit
def _store_partials(logits, teacher, query, token_ok, kv_head, num_queries, part_max, part_sum, part_weighted,
                    part_mass, TOPK: tl.constexpr):
    """Store a tile's per-entry partials (`ForwardPartials`) from the student's `logits` and the
    teacher `[TOKENS, BLOCK]`, at the entries' `[Hkv, Tq, topk]` slots."""
    row_max = tl.max(logits, axis=1)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(tl.exp2(logits - shift[:, None]), axis=1)
    positive = teacher > 0.0
    log_teacher = tl.log(tl.where(positive, teacher, 1.0))
    natural_logits = tl.where(positive, logits, 0.0) * LN_2
    weighted = tl.sum(tl.where(positive, teacher * (log_teacher - natural_logits), 0.0), axis=1)
    mass = tl.sum(teacher, axis=1)
    partial = kv_head.to(tl.int64) * num_queries * TOPK + query
    tl.store(part_max + partial, row_max, mask=token_ok)
    tl.store(part_sum + partial, total, mask=token_ok)
    tl.store(part_weighted + partial, weighted, mask=token_ok)
    tl.store(part_mass + partial, mass, mask=token_ok)


@triton.jit
def _add_query_sums(out, query_sums, query, token_ok, kv_head, NUM_KV_HEADS: tl.constexpr, TOPK: tl.constexpr,
                    INDEX_DIM: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """A tile's per-entry sums `[TOKENS, Di]` into `out`: added to the (query, index head) rows
    `[Tq, Hi, Di]` with atomics, or (`DETERMINISTIC`) stored in the entry rows `[Tq, Hi, topk, Di]`."""
    pair = (query // TOPK).to(tl.int64) * NUM_KV_HEADS + kv_head
    index_dims = tl.arange(0, INDEX_DIM)
    if DETERMINISTIC:
        entry = pair * TOPK + query % TOPK
        tl.store(out + entry[:, None] * INDEX_DIM + index_dims[None, :], query_sums, mask=token_ok[:, None])
    else:
        tl.atomic_add(out + pair[:, None] * INDEX_DIM + index_dims[None, :], query_sums, mask=token_ok[:, None],
                      sem="relaxed")


@triton.jit
def _add_key_sums(out, key_sums, item, key_row, key_ok, BLOCK: tl.constexpr, INDEX_DIM: tl.constexpr,
                  DETERMINISTIC: tl.constexpr):
    """An item's per-key sums `[BLOCK, Di]` of the `key_ok` keys into `out`: added to the keys'
    rows `[Tk, 1, Di]` with atomics, or (`DETERMINISTIC`) stored in the item's own rows
    `item * BLOCK + c` (`torch_msa.stages.deterministic.reduce_item_rows` reads them)."""
    index_dims = tl.arange(0, INDEX_DIM)
    if DETERMINISTIC:
        rows = item.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + rows[:, None] * INDEX_DIM + index_dims[None, :], key_sums, mask=key_ok[:, None])
    else:
        tl.atomic_add(out + key_row[:, None] * INDEX_DIM + index_dims[None, :], key_sums, mask=key_ok[:, None],
                      sem="relaxed")


@triton.jit
def _reduce_tile(weights, scale, index_keys, index_queries, key_sums, query_out, query, token_ok, kv_head,
                 NUM_KV_HEADS: tl.constexpr, TOPK: tl.constexpr, INDEX_DIM: tl.constexpr, SPLIT: tl.constexpr,
                 INDEX_PRECISION: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """The two reductions of a tile's fp32 `weights [TOKENS, BLOCK]` (0 off the support):
    `scale * weights @ index_keys` into `query_out` (`_add_query_sums`), and the returned
    `key_sums + weights^T @ index_queries`."""
    query_sums = weighted_dot(weights, index_keys, tl.zeros((weights.shape[0], INDEX_DIM), tl.float32), SPLIT,
                              INDEX_PRECISION)
    _add_query_sums(query_out, query_sums * scale, query, token_ok, kv_head, NUM_KV_HEADS, TOPK, INDEX_DIM,
                    DETERMINISTIC)
    return weighted_dot(tl.trans(weights), index_queries, key_sums, SPLIT, INDEX_PRECISION)


@cached_launches
@triton.jit
def msa_kl_fwd_kernel(
    q, k, lse, index_q, index_k, part_max, part_sum, part_weighted, part_mass, teacher_index_keys,
    teacher_index_queries,
    entry_query, item_bucket, item_start, item_end, bucket_head, bucket_key_row, bucket_block, position,
    num_queries, num_keys, qk_scale, index_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_iq_token, stride_iq_head, stride_ik_token,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEADS_PER_PASS: tl.constexpr, TOKENS: tl.constexpr,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    PRECISION: tl.constexpr, INDEX_PRECISION: tl.constexpr, SPLIT: tl.constexpr, DETERMINISTIC: tl.constexpr = False,
):
    """The forward that computes the teacher: per-entry partials and the teacher's two index
    reductions. `DETERMINISTIC`: those reductions are stored, not added: `teacher_index_keys` is
    then the per-entry rows `[Tq, Hi, topk, Di]` and `teacher_index_queries` the per-item rows
    `[max_items * BLOCK, Di]` (`_add_query_sums`, `_add_key_sums`)."""
    item, start, end, kv_head, key_row, key_position, key_ok, index_keys = _item_block(
        index_k, entry_query, item_start, item_end, item_bucket, bucket_head, bucket_key_row, bucket_block, position,
        num_keys, stride_ik_token, TOPK, BLOCK, INDEX_DIM,
    )
    k_block = tl.load(k + key_row[:, None] * stride_k_token + kv_head * stride_k_head + tl.arange(0, DIM)[None, :],
                      mask=key_ok[:, None], other=0.0)
    key_sums = tl.zeros((BLOCK, INDEX_DIM), tl.float32)

    for first in range(start, end, TOKENS):
        logits, visible, index_queries, query, token_ok = _student_tile(
            index_q, index_keys, entry_query, position, first, end, kv_head, key_position, key_ok, index_scale,
            stride_iq_token, stride_iq_head, TOKENS, TOPK, INDEX_DIM, INDEX_PRECISION,
        )
        teacher = _teacher_tile(
            q, k_block, lse, entry_query, first, end, kv_head, visible, qk_scale, stride_q_token, stride_q_head,
            NUM_KV_HEADS, GROUP, HEADS_PER_PASS, TOKENS, TOPK, BLOCK, DIM, PRECISION,
        )
        _store_partials(logits, teacher, query, token_ok, kv_head, num_queries, part_max, part_sum, part_weighted,
                        part_mass, TOPK)
        # The teacher's half of the gradient.
        key_sums = _reduce_tile(teacher, 1.0, index_keys, index_queries, key_sums, teacher_index_keys, query, token_ok,
                                kv_head, NUM_KV_HEADS, TOPK, INDEX_DIM, SPLIT, INDEX_PRECISION, DETERMINISTIC)
    _add_key_sums(teacher_index_queries, key_sums, item, key_row, key_ok, BLOCK, INDEX_DIM, DETERMINISTIC)


@cached_launches
@triton.jit
def msa_kl_fwd_from_teacher_kernel(
    teacher, index_q, index_k, part_max, part_sum, part_weighted, part_mass,
    entry_query, item_bucket, item_start, item_end, bucket_head, bucket_key_row, bucket_block, position,
    num_queries, num_keys, index_scale, stride_iq_token, stride_iq_head, stride_ik_token,
    NUM_KV_HEADS: tl.constexpr, TOKENS: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr,
    INDEX_DIM: tl.constexpr, INDEX_PRECISION: tl.constexpr,
):
    """The forward of a given teacher `[Tq, Hi, topk, BLOCK]` (contiguous): the per-entry partials
    of `msa_kl_fwd_kernel`, with the teacher read instead of computed; no reductions (the
    backward does both halves)."""
    item, start, end, kv_head, key_row, key_position, key_ok, index_keys = _item_block(
        index_k, entry_query, item_start, item_end, item_bucket, bucket_head, bucket_key_row, bucket_block, position,
        num_keys, stride_ik_token, TOPK, BLOCK, INDEX_DIM,
    )
    for first in range(start, end, TOKENS):
        logits, visible, _, query, token_ok = _student_tile(
            index_q, index_keys, entry_query, position, first, end, kv_head, key_position, key_ok, index_scale,
            stride_iq_token, stride_iq_head, TOKENS, TOPK, INDEX_DIM, INDEX_PRECISION,
        )
        probs = _given_teacher_tile(teacher, query, kv_head, visible, NUM_KV_HEADS, TOPK, BLOCK)
        _store_partials(logits, probs, query, token_ok, kv_head, num_queries, part_max, part_sum, part_weighted,
                        part_mass, TOPK)


@cached_launches
@triton.jit
def msa_kl_bwd_kernel(
    index_q, index_k, index_lse, teacher_mass, grad_loss, d_index_q, d_index_k,
    entry_query, item_bucket, item_start, item_end, bucket_head, bucket_key_row, bucket_block, position,
    num_keys, index_scale, coefficient_scale, stride_iq_token, stride_iq_head, stride_ik_token,
    NUM_KV_HEADS: tl.constexpr, TOKENS: tl.constexpr, TOPK: tl.constexpr, BLOCK: tl.constexpr,
    INDEX_DIM: tl.constexpr, INDEX_PRECISION: tl.constexpr, SPLIT: tl.constexpr, DETERMINISTIC: tl.constexpr = False,
    teacher=None,
):
    """The gradient pass: `c * M * P_s` reduced into `d_index_q` and `d_index_k`, with `c = grad_loss
    * coefficient_scale` (the 0-D `grad_loss` read here); with a given `teacher` `[Tq, Hi, topk,
    BLOCK]` (contiguous), `c * (M * P_s - P_t)`, both halves in one reduction. `DETERMINISTIC`:
    the reductions are stored, not added, as in `msa_kl_fwd_kernel`: `d_index_q` is then the
    per-entry rows and `d_index_k` the per-item rows."""
    item, start, end, kv_head, key_row, key_position, key_ok, index_keys = _item_block(
        index_k, entry_query, item_start, item_end, item_bucket, bucket_head, bucket_key_row, bucket_block, position,
        num_keys, stride_ik_token, TOPK, BLOCK, INDEX_DIM,
    )
    scale = tl.load(grad_loss).to(tl.float32) * coefficient_scale
    key_sums = tl.zeros((BLOCK, INDEX_DIM), tl.float32)

    for first in range(start, end, TOKENS):
        logits, visible, index_queries, query, token_ok = _student_tile(
            index_q, index_keys, entry_query, position, first, end, kv_head, key_position, key_ok, index_scale,
            stride_iq_token, stride_iq_head, TOKENS, TOPK, INDEX_DIM, INDEX_PRECISION,
        )
        pair = (query // TOPK).to(tl.int64) * NUM_KV_HEADS + kv_head
        student_lse = tl.load(index_lse + pair, mask=token_ok, other=0.0) * LOG2_E
        student_lse = tl.where((student_lse == float("inf")) | (student_lse == float("-inf")), 0.0, student_lse)
        mass = tl.load(teacher_mass + pair, mask=token_ok, other=0.0)
        # exp2(-inf) = 0 off the support; `where` keeps a NaN mass of a padding row out too.
        weights = tl.where(logits != float("-inf"), mass[:, None] * tl.exp2(logits - student_lse[:, None]), 0.0)
        if teacher is not None:
            weights -= _given_teacher_tile(teacher, query, kv_head, visible, NUM_KV_HEADS, TOPK, BLOCK)
        key_sums = _reduce_tile(weights, scale, index_keys, index_queries, key_sums, d_index_q, query, token_ok,
                                kv_head, NUM_KV_HEADS, TOPK, INDEX_DIM, SPLIT, INDEX_PRECISION, DETERMINISTIC)
    _add_key_sums(d_index_k, key_sums * scale, item, key_row, key_ok, BLOCK, INDEX_DIM, DETERMINISTIC)


def _schedule_tables(schedule) -> tuple:
    return (schedule.entry_query, schedule.item_bucket, schedule.item_start, schedule.item_end,
            schedule.bucket_head, schedule.bucket_key_row, schedule.bucket_block, schedule.position)


class ForwardPartials(NamedTuple):
    """The per-entry partials of the forward, fp32 `[Hi, Tq, topk]` each (laid out like
    `block_indices`): the student's running max (log2 domain) and sum of `exp2` of its logits,
    `A` and `M` over the entry's block. Entries the schedule drops stay 0, which adds nothing (a
    sum of 0 marks an entry without a logit)."""

    max: torch.Tensor
    sum: torch.Tensor
    weighted: torch.Tensor
    mass: torch.Tensor


def zeroed(*shapes, device) -> list[torch.Tensor]:
    """fp32 zeros of each of `shapes`, contiguous views of one buffer: one fill."""
    sizes = [math.prod(shape) for shape in shapes]
    buffer = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    return [part.view(shape) for part, shape in zip(buffer.split(sizes), shapes)]


def forward_partials(num_index_heads: int, num_queries: int, topk: int, device) -> ForwardPartials:
    """The forward's partials at their initial values, on `device` (one fill)."""
    return ForwardPartials(*torch.zeros((4, num_index_heads, num_queries, topk), dtype=torch.float32,
                                        device=device).unbind(0))


_FINISH_ROWS = 256  # (index head, query) rows per program of the finish kernel


@cached_launches
@triton.jit
def msa_kl_finish_kernel(part_max, part_sum, part_weighted, part_mass, index_lse, teacher_mass, divergence,
                         num_queries, num_rows, row_weight, NUM_INDEX_HEADS: tl.constexpr, TOPK: tl.constexpr,
                         TOPK_P2: tl.constexpr, ROWS: tl.constexpr):
    """Per (index head, query) row: the student's lse (natural log) over its entries' partials and
    the teacher's mass, both stored `[Tq, Hi]`, and the program's sum of the rows' divergences
    times `row_weight` (the loss is the mean over rows)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    slots = tl.arange(0, TOPK_P2)
    ok = row_ok[:, None] & (slots < TOPK)[None, :]
    at = rows.to(tl.int64)[:, None] * TOPK + slots[None, :]
    total = tl.load(part_sum + at, mask=ok, other=0.0)
    used = total > 0.0
    slot_lse = tl.where(used, (tl.load(part_max + at, mask=ok, other=0.0) + tl.log2(tl.where(used, total, 1.0)))
                        * LN_2, float("-inf"))
    top = tl.max(slot_lse, axis=1)
    shift = tl.where(top == float("-inf"), 0.0, top)
    lse = tl.log(tl.sum(tl.exp(slot_lse - shift[:, None]), axis=1)) + shift
    mass = tl.sum(tl.load(part_mass + at, mask=ok, other=0.0), axis=1)
    weighted = tl.sum(tl.load(part_weighted + at, mask=ok, other=0.0), axis=1)
    rows_divergence = weighted + tl.where(mass > 0.0, mass * tl.where(mass > 0.0, lse, 0.0), 0.0)
    pair = (rows % num_queries).to(tl.int64) * NUM_INDEX_HEADS + rows // num_queries
    tl.store(index_lse + pair, lse, mask=row_ok)
    tl.store(teacher_mass + pair, mass, mask=row_ok)
    tl.store(divergence + tl.program_id(0), tl.sum(tl.where(row_ok, rows_divergence, 0.0), axis=0) * row_weight)


def finish_forward(partials: ForwardPartials, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(loss, index_lse [Tq, Hi], teacher_mass [Tq, Hi])` in `dtype`: the partials combined per
    row by one kernel, its programs' sums added by torch (deterministic)."""
    num_index_heads, num_queries, topk = partials.max.shape
    num_rows = num_index_heads * num_queries
    device = partials.max.device
    programs = max(1, triton.cdiv(num_rows, _FINISH_ROWS))
    # index_lse and mass in their own storage: an op's outputs must not alias.
    shape = (num_queries, num_index_heads)
    index_lse, mass = (uninitialized(shape, dtype=torch.float32, device=device) for _ in range(2))
    divergence = uninitialized(programs, dtype=torch.float32, device=device)
    if num_rows and topk:
        msa_kl_finish_kernel[(programs,)](
            *(part if part.is_contiguous() else part.contiguous() for part in partials), index_lse, mass, divergence,
            num_queries, num_rows, 1.0 / num_rows,
            NUM_INDEX_HEADS=num_index_heads, TOPK=topk, TOPK_P2=triton.next_power_of_2(topk), ROWS=_FINISH_ROWS,
        )
    else:  # no row or no slot: every lse is -inf, every mass and divergence 0
        index_lse.fill_(-math.inf)
        mass.zero_()
        divergence.zero_()
    return divergence.sum().to(dtype), index_lse.to(dtype), mass.to(dtype)


def launch_forward(q, k, lse, index_q, index_k, partials: ForwardPartials, teacher_sums, schedule, topk, block_size,
                   softmax_scale, index_softmax_scale, deterministic: bool) -> None:
    """`msa_kl_fwd_kernel` over every item of `schedule`.

    Args:
        q, k, index_q, index_k: unit stride in the head dim; lse: fp32 `[Tq, Hq]`, contiguous.
        partials: filled for every entry of the schedule.
        teacher_sums: `(teacher_index_keys, teacher_index_queries)`: fp32 `[Tq, Hi, Di]` and
            `[Tk, 1, Di]` accumulators (zeros) that the kernel adds to, or with `deterministic`
            the per-entry rows `[Tq, Hi, topk, Di]` and the per-item rows
            `[max_items * block_size, Di]` it stores into.
    """
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    index_dim = index_q.shape[-1]

    def launch_config(config):
        tokens, heads_per_pass = index_loss_tile_shape(num_heads, num_kv_heads, config.rows)
        msa_kl_fwd_kernel[(schedule.item_start.numel(),)](
            q, k, lse, index_q, index_k, *partials, *teacher_sums, *_schedule_tables(schedule),
            num_queries, num_keys, softmax_scale * LOG2_E.value, index_softmax_scale * LOG2_E.value,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), index_q.stride(0), index_q.stride(1),
            index_k.stride(0),
            NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEADS_PER_PASS=heads_per_pass,
            TOKENS=tokens, TOPK=topk, BLOCK=block_size, DIM=dim, INDEX_DIM=index_dim,
            PRECISION=dot_precision(q.dtype), INDEX_PRECISION=dot_precision(index_q.dtype),
            SPLIT=split_weights(index_q.dtype), DETERMINISTIC=deterministic, **config.options,
        )

    shape_key = (q.device, q.dtype, index_q.dtype, dim, index_dim, block_size, num_heads // num_kv_heads)
    name = "msa_kl_fwd_kernel (deterministic)" if deterministic else "msa_kl_fwd_kernel"
    launch(name, shape_key, FORWARD_CONFIGS, launch_config)


def launch_forward_from_teacher(teacher, index_q, index_k, partials: ForwardPartials, schedule, topk, block_size,
                                index_softmax_scale) -> None:
    """`msa_kl_fwd_from_teacher_kernel` over every item of `schedule` (one row per entry).

    Args:
        teacher: `[Tq, Hi, topk, block_size]`, contiguous; index_q, index_k: unit stride in the
            index dim.
        partials: filled for every entry of the schedule.
    """
    num_queries, num_index_heads, index_dim = index_q.shape

    def launch_config(config):
        msa_kl_fwd_from_teacher_kernel[(schedule.item_start.numel(),)](
            teacher, index_q, index_k, *partials, *_schedule_tables(schedule),
            num_queries, index_k.shape[0], index_softmax_scale * LOG2_E.value, index_q.stride(0), index_q.stride(1),
            index_k.stride(0),
            NUM_KV_HEADS=num_index_heads, TOKENS=config.rows, TOPK=topk, BLOCK=block_size, INDEX_DIM=index_dim,
            INDEX_PRECISION=dot_precision(index_q.dtype), **config.options,
        )

    shape_key = (index_q.device, index_q.dtype, teacher.dtype, index_dim, block_size)
    launch("msa_kl_fwd_from_teacher_kernel", shape_key, FROM_TEACHER_CONFIGS, launch_config)


def indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale, index_softmax_scale,
               plan=None):
    """Same contract as `torch_msa.reference_index_loss.indexer_kl` (sparse support, `lse` given).
    `plan`: the step's plan (as `torch_msa.plan.kernels.schedule_for` takes it); None builds one."""
    check_inputs(lse is not None, index_q)
    check_atomics_allowed()
    num_queries, num_heads, dim = q.shape
    num_keys = k.shape[0]
    num_index_heads, index_dim = index_q.shape[1:]
    topk = block_indices.shape[-1]
    lse = lse.contiguous()
    partials = forward_partials(num_index_heads, num_queries, topk, q.device)
    teacher_index_keys = torch.zeros((num_queries, num_index_heads, index_dim), dtype=torch.float32, device=q.device)
    teacher_index_queries = torch.zeros((num_keys, 1, index_dim), dtype=torch.float32, device=q.device)
    if num_queries > 0 and num_keys > 0:
        q, k, index_q, index_k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, index_q, index_k))
        schedule = schedule_for(block_indices, documents, num_keys, block_size, num_heads, plan)
        launch_forward(q, k, lse, index_q, index_k, partials, (teacher_index_keys, teacher_index_queries), schedule,
                       topk, block_size, softmax_scale, index_softmax_scale, deterministic=False)
    loss, index_lse, mass = finish_forward(partials, loss_dtype(index_q.dtype))
    return loss, lse.clone(), index_lse, mass, teacher_index_keys, teacher_index_queries


def coefficient_scale(index_softmax_scale: float, num_queries: int, num_index_heads: int) -> float:
    """`index_scale / (Tq * Hi)`: the gradient's coefficient is `c = grad_loss * coefficient_scale`,
    `d = c * (student - teacher)`."""
    return index_softmax_scale / max(1, num_queries * num_index_heads)


def launch_backward(index_q, index_k, index_lse, teacher_mass, coefficient: tuple, student_sums, schedule, topk,
                    block_size, index_softmax_scale, deterministic: bool, teacher=None) -> None:
    """`msa_kl_bwd_kernel` over every item of `schedule`.

    Args:
        index_q, index_k: unit stride in the index dim; index_lse, teacher_mass: fp32 `[Tq, Hi]`,
            contiguous; coefficient: `(grad_loss, scale)`, the loss's 0-D gradient and the call's
            `coefficient_scale`: the kernel forms `c = grad_loss * scale`.
        student_sums: `(d_index_q, d_index_k)`: fp32 `[Tq, Hi, Di]` and `[Tk, 1, Di]` that the
            kernel adds `c` times the student's reductions to, or with `deterministic` the
            per-entry rows `[Tq, Hi, topk, Di]` and the per-item rows `[max_items * block_size, Di]`
            it stores them into.
        teacher: a given teacher `[Tq, Hi, topk, block_size]` (contiguous), whose half the kernel
            subtracts in the same reductions, or None (the teacher's half is elsewhere).
    """
    num_index_heads, index_dim = index_q.shape[1:]
    grad_loss, scale = coefficient

    def launch_config(config):
        msa_kl_bwd_kernel[(schedule.item_start.numel(),)](
            index_q, index_k, index_lse, teacher_mass, grad_loss, *student_sums, *_schedule_tables(schedule),
            index_k.shape[0], index_softmax_scale * LOG2_E.value, scale, index_q.stride(0), index_q.stride(1),
            index_k.stride(0),
            NUM_KV_HEADS=num_index_heads, TOKENS=config.rows, TOPK=topk, BLOCK=block_size,
            INDEX_DIM=index_dim, INDEX_PRECISION=dot_precision(index_q.dtype), SPLIT=split_weights(index_q.dtype),
            DETERMINISTIC=deterministic, teacher=teacher, **config.options,
        )

    name = "msa_kl_bwd_kernel" + (" (teacher given)" if teacher is not None else "")
    name += " (deterministic)" if deterministic else ""
    shape_key = (index_q.device, index_q.dtype, None if teacher is None else teacher.dtype, index_dim, block_size)
    launch(name, shape_key, BACKWARD_CONFIGS, launch_config)


def student_schedule(block_indices, documents, num_keys, block_size, num_index_heads, plan):
    """The schedule of the student's passes, one row per entry (the student has one head per index
    head): `plan`'s (as `torch_msa.plan.kernels.schedule_for` takes it) re-cut into such items, or
    (`None`) a new one."""
    if plan is None:
        return schedule_for(block_indices, documents, num_keys, block_size, num_index_heads)
    return with_items(schedule_for(block_indices, documents, num_keys, block_size, num_index_heads, plan),
                      entries_per_item(num_index_heads, block_indices.shape[0]))


def indexer_kl_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                        teacher_index_queries, block_indices, documents, block_size, index_softmax_scale, plan=None):
    """Same contract as `torch_msa.reference_index_loss.indexer_kl_backward` (sparse support).
    `plan`: the step's plan (as `torch_msa.plan.kernels.schedule_for` takes it); None builds one."""
    check_inputs(True, index_q)
    check_atomics_allowed()
    num_queries, num_index_heads, _ = index_q.shape
    num_keys = index_k.shape[0]
    scale = coefficient_scale(index_softmax_scale, num_queries, num_index_heads)
    coefficient = grad_loss.float() * scale
    # d = c * (student - teacher): the buffers start at the teacher's half, the kernel adds the student's.
    d_index_q = (teacher_index_keys.float() * -coefficient).contiguous()
    d_index_k = (teacher_index_queries.float() * -coefficient).contiguous()
    if num_queries > 0 and num_keys > 0:
        index_q, index_k = (x if x.stride(-1) == 1 else x.contiguous() for x in (index_q, index_k))
        schedule = student_schedule(block_indices, documents, num_keys, block_size, num_index_heads, plan)
        launch_backward(index_q, index_k, index_lse.float().contiguous(), teacher_mass.float().contiguous(),
                        (grad_loss, scale), (d_index_q, d_index_k), schedule, block_indices.shape[-1], block_size,
                        index_softmax_scale, deterministic=False)
    return d_index_q.to(index_q.dtype), d_index_k.to(index_k.dtype)


def index_loss_from_teacher(teacher, grad_loss, index_q, index_k, block_indices, documents, block_size,
                            index_softmax_scale, plan=None):
    """Same contract as `torch_msa.reference_index_loss.index_loss_from_teacher`: `(loss, d_index_q,
    d_index_k)` from a given teacher `[Tq, Hi, topk, block_size]`, the gradients None when
    `grad_loss` is None. `plan`: the step's plan (as `torch_msa.plan.kernels.schedule_for` takes
    it), walked in this loss's items; None builds one.

    Raises:
        UnsupportedInputs: as `check_inputs`; with `grad_loss`, under deterministic algorithms
            (`sparse_deterministic.index_loss_from_teacher` serves that mode).
    """
    check_inputs(True, index_q)
    if grad_loss is not None:
        check_atomics_allowed()
    num_queries, num_index_heads, index_dim = index_q.shape
    num_keys = index_k.shape[0]
    topk = block_indices.shape[-1]
    device = index_q.device
    if grad_loss is None:
        partials = forward_partials(num_index_heads, num_queries, topk, device)
    else:
        # The query gradient's accumulator and the partials in one zero fill (the key gradient's
        # apart: the op's two outputs must not share storage).
        d_index_q, partial_rows = zeroed((num_queries, num_index_heads, index_dim),
                                         (4, num_index_heads, num_queries, topk), device=device)
        partials = ForwardPartials(*partial_rows.unbind(0))
        d_index_k = torch.zeros((num_keys, 1, index_dim), dtype=torch.float32, device=device)
    work = num_queries > 0 and num_keys > 0 and topk > 0
    if work:
        index_q, index_k = (x if x.stride(-1) == 1 else x.contiguous() for x in (index_q, index_k))
        teacher = teacher.contiguous()
        schedule = student_schedule(block_indices, documents, num_keys, block_size, num_index_heads, plan)
        launch_forward_from_teacher(teacher, index_q, index_k, partials, schedule, topk, block_size,
                                    index_softmax_scale)
    loss, index_lse, mass = finish_forward(partials, loss_dtype(index_q.dtype))
    if grad_loss is None:
        return loss, None, None
    if work:
        launch_backward(index_q, index_k, index_lse.float().contiguous(), mass.float().contiguous(),
                        (grad_loss, coefficient_scale(index_softmax_scale, num_queries, num_index_heads)),
                        (d_index_q, d_index_k), schedule, topk, block_size, index_softmax_scale, deterministic=False,
                        teacher=teacher)
    return loss, d_index_q.to(index_q.dtype), d_index_k.to(index_k.dtype)
