"""The index loss on the dense causal support in Triton, query-tile-outer (flash style); the
formulas and kernels: `torch_msa/index_loss/README.md`.
"""

import math

import torch
import triton
import triton.language as tl

from ..backends import UnsupportedInputs
from ..triton_utils.common import LN_2, LOG2_E, check_dtype_and_group, dot_precision, locate_queries, split_weights, weighted_dot
from ..triton_utils.launch import LaunchConfig, cached_launches, launch
from ..uninitialized import uninitialized

# SM90's tiles first, then smaller ones for less shared memory. `rows`: query tokens of a tile
# (of the key-outer kernels' inner tile); `block_n`: keys per tile.
TEACHER_LSE_CONFIGS = (LaunchConfig(rows=128, block_n=128, num_stages=3, num_warps=8),
                       LaunchConfig(rows=64, block_n=64, num_stages=2, num_warps=4))
LOSS_CONFIGS = (LaunchConfig(rows=64, block_n=128, num_stages=2, num_warps=8),
                LaunchConfig(rows=64, block_n=64, num_stages=1, num_warps=4),
                LaunchConfig(rows=32, block_n=32, num_stages=1, num_warps=4))
QUERY_GRAD_CONFIGS = (LaunchConfig(rows=128, block_n=64, num_stages=3, num_warps=8),
                      LaunchConfig(rows=64, block_n=32, num_stages=1, num_warps=4))
KEY_GRAD_CONFIGS = (LaunchConfig(rows=64, block_n=64, num_stages=2, num_warps=8),
                    LaunchConfig(rows=32, block_n=32, num_stages=1, num_warps=4))
TEACHER_QUERIES_CONFIGS = (LaunchConfig(rows=64, block_n=64, num_stages=2, num_warps=8),
                           LaunchConfig(rows=32, block_n=32, num_stages=1, num_warps=4))


def _check_dim(name: str, dim: int) -> None:
    if dim < 16 or dim > 256 or dim & (dim - 1):
        raise UnsupportedInputs(f"{name} {dim} (the Triton dense KL kernels take a power of two in [16, 256])")


def check_inputs(q, k, index_q) -> None:
    """Decline, before any launch, what these kernels do not serve (the reference does).

    Raises:
        UnsupportedInputs: a dtype or head group `check_dtype_and_group` declines, or a head dim
            or index head dim that is not a power of two in [16, 256].
    """
    check_dtype_and_group("q", q.dtype, q.shape[1] // k.shape[1])
    check_dtype_and_group("index_q", index_q.dtype)
    _check_dim("head dim", q.shape[-1])
    _check_dim("index head dim", index_q.shape[-1])


@triton.jit
def _query_tile(key_start, position, cu_seqlens_q, num_queries, num_docs, tiles_per_doc, TOKENS: tl.constexpr):
    """The program's tile of `TOKENS` consecutive queries of one document (or fragment), a
    document's last tiles first: `(empty, token, real, pos, tile_key_start, last)`, `token` int64
    (padded rows repeat the first), `pos` -1 for a row that sees no key, `last` the largest `pos`."""
    pid = tl.program_id(0)
    doc = pid % num_docs
    end = tl.minimum(tl.load(cu_seqlens_q + doc + 1), num_queries)
    start = tl.load(cu_seqlens_q + doc) + (tiles_per_doc - 1 - pid // num_docs) * TOKENS
    empty = (start >= end) | (start < 0)
    token = start + tl.arange(0, TOKENS)
    real = (token < end) & (not empty)
    token = tl.where(real, token, start).to(tl.int64)
    tile_key_start = tl.load(key_start + start, mask=not empty, other=-1)
    # A row of another document (malformed cu_seqlens) would need other keys: it sees none.
    same = tl.load(key_start + token, mask=real, other=-1) == tile_key_start
    pos = tl.where(real & same, tl.load(position + token, mask=real, other=-1), -1)
    return empty, token, real, pos, tile_key_start, tl.max(pos, axis=0)


@triton.jit
def _online_lse(row_max, row_sum, scores):
    """One step of a running log-sum-exp (log2 domain) over `scores [rows, keys]`."""
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    row_sum = row_sum * tl.exp2(row_max - shift) + tl.sum(tl.exp2(scores - shift[:, None]), axis=1)
    return new_max, row_sum


@triton.jit
def _finite_or_zero(x):
    return tl.where((x == float("inf")) | (x == float("-inf")), 0.0, x)


@cached_launches
@triton.jit
def msa_kl_dense_teacher_lse_kernel(
    q, k, key_start, position, cu_seqlens_q, teacher_lse,
    num_queries, num_docs, tiles_per_doc, qk_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
    DIM: tl.constexpr, PRECISION: tl.constexpr,
):
    """`teacher_lse` of one query tile and head: the log-sum-exp of its scores over the tile's
    visible keys."""
    head = tl.program_id(1)
    empty, token, real, pos, tile_key_start, last = _query_tile(key_start, position, cu_seqlens_q, num_queries, num_docs,
                                                                tiles_per_doc, TOKENS)
    if empty:
        return
    lowest = tl.min(tl.where(real, pos, last), axis=0)
    dims = tl.arange(0, DIM)
    offsets = tl.arange(0, BLOCK_N)
    query = tl.load(q + token[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                    mask=real[:, None], other=0.0)
    k_head = k + (head // GROUP) * stride_k_head
    row_max = tl.full((TOKENS,), float("-inf"), tl.float32)
    row_sum = tl.zeros((TOKENS,), tl.float32)
    # Key tiles every real query sees entirely: no mask.
    full = (lowest + 1) // BLOCK_N * BLOCK_N
    for first in range(0, full, BLOCK_N):
        key_row = (tile_key_start + first + offsets).to(tl.int64)
        keys = tl.load(k_head + key_row[:, None] * stride_k_token + dims[None, :])
        scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * qk_scale
        row_max, row_sum = _online_lse(row_max, row_sum, scores)
    # The causal edge: mask each query's horizon; keys past the tile's last position are not read.
    for first in range(full, last + 1, BLOCK_N):
        key_pos = first + offsets
        key_row = (tile_key_start + key_pos).to(tl.int64)
        keys = tl.load(k_head + key_row[:, None] * stride_k_token + dims[None, :],
                       mask=(key_pos <= last)[:, None], other=0.0)
        scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * qk_scale
        scores = tl.where(key_pos[None, :] <= pos[:, None], scores, float("-inf"))
        row_max, row_sum = _online_lse(row_max, row_sum, scores)
    lse = tl.where(row_sum > 0.0, (row_max + tl.log2(tl.where(row_sum > 0.0, row_sum, 1.0))) * LN_2, float("-inf"))
    tl.store(teacher_lse + token * NUM_HEADS + head, lse, mask=real)


@cached_launches
@triton.jit
def msa_kl_dense_loss_kernel(
    q, k, teacher_lse, index_q, index_k, key_start, position, cu_seqlens_q,
    weighted, mass, index_lse, teacher_index_keys, teacher_index_queries,
    num_queries, num_docs, tiles_per_doc, qk_scale, index_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    stride_iq_token, stride_iq_head, stride_ik_token,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr, DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    PRECISION: tl.constexpr, INDEX_PRECISION: tl.constexpr, SPLIT: tl.constexpr, DETERMINISTIC: tl.constexpr = False,
):
    """`DETERMINISTIC`: `teacher_index_queries` is not touched."""
    kv_head = tl.program_id(1)
    empty, token, real, pos, tile_key_start, last = _query_tile(key_start, position, cu_seqlens_q, num_queries, num_docs,
                                                                tiles_per_doc, TOKENS)
    if empty:
        return
    dims = tl.arange(0, DIM)
    index_dims = tl.arange(0, INDEX_DIM)
    offsets = tl.arange(0, BLOCK_N)
    index_queries = tl.load(
        index_q + token[:, None] * stride_iq_token + kv_head * stride_iq_head + index_dims[None, :],
        mask=real[:, None], other=0.0)
    q_rows = q + token[:, None] * stride_q_token + dims[None, :]
    lse_rows = teacher_lse + token * NUM_HEADS
    k_head = k + kv_head * stride_k_head

    student_max = tl.full((TOKENS,), float("-inf"), tl.float32)
    student_sum = tl.zeros((TOKENS,), tl.float32)
    total_weighted = tl.zeros((TOKENS,), tl.float32)
    total_mass = tl.zeros((TOKENS,), tl.float32)
    index_keys_acc = tl.zeros((TOKENS, INDEX_DIM), tl.float32)
    for first in range(0, last + 1, BLOCK_N):
        key_pos = first + offsets
        key_ok = key_pos <= last
        key_row = (tile_key_start + key_pos).to(tl.int64)
        keys = tl.load(k_head + key_row[:, None] * stride_k_token + dims[None, :], mask=key_ok[:, None], other=0.0)
        index_keys = tl.load(index_k + key_row[:, None] * stride_ik_token + index_dims[None, :],
                             mask=key_ok[:, None], other=0.0)
        visible = key_pos[None, :] <= pos[:, None]

        # The teacher: the group's heads stream over the tile's keys, one score GEMM each.
        teacher = tl.zeros((TOKENS, BLOCK_N), tl.float32)
        for group_head in tl.range(0, GROUP):
            head = kv_head * GROUP + group_head
            queries = tl.load(q_rows + head * stride_q_head, mask=real[:, None], other=0.0)
            # A query whose lse is infinite (empty key set) shifts by 0, as the reference does.
            shift = _finite_or_zero(tl.load(lse_rows + head, mask=real, other=0.0) * LOG2_E)
            scores = tl.dot(queries, tl.trans(keys), input_precision=PRECISION) * qk_scale
            teacher += tl.exp2(scores - shift[:, None])
        teacher = tl.where(visible, teacher * (1.0 / GROUP), 0.0)

        logits = tl.dot(index_queries, tl.trans(index_keys), input_precision=INDEX_PRECISION) * index_scale
        logits = tl.where(visible, logits, float("-inf"))  # log2 domain
        student_max, student_sum = _online_lse(student_max, student_sum, logits)
        positive = teacher > 0.0
        log_ratio = tl.log(tl.where(positive, teacher, 1.0)) - tl.where(positive, logits, 0.0) * LN_2
        total_weighted += tl.sum(tl.where(positive, teacher * log_ratio, 0.0), axis=1)
        total_mass += tl.sum(teacher, axis=1)

        index_keys_acc = weighted_dot(teacher, index_keys, index_keys_acc, SPLIT, INDEX_PRECISION)
        if not DETERMINISTIC:
            index_queries_share = weighted_dot(tl.trans(teacher), index_queries,
                                               tl.zeros((BLOCK_N, INDEX_DIM), tl.float32), SPLIT, INDEX_PRECISION)
            tl.atomic_add(teacher_index_queries + key_row[:, None] * INDEX_DIM + index_dims[None, :],
                          index_queries_share, mask=key_ok[:, None], sem="relaxed")

    pair = token * NUM_KV_HEADS + kv_head
    student_lse = tl.where(student_sum > 0.0,
                           (student_max + tl.log2(tl.where(student_sum > 0.0, student_sum, 1.0))) * LN_2,
                           float("-inf"))
    tl.store(index_lse + pair, student_lse, mask=real)
    tl.store(weighted + pair, total_weighted, mask=real)
    tl.store(mass + pair, total_mass, mask=real)
    tl.store(teacher_index_keys + pair[:, None] * INDEX_DIM + index_dims[None, :], index_keys_acc,
             mask=real[:, None])


@triton.jit
def _key_tile(cu_seqlens_k, num_keys, num_docs, BLOCK_N: tl.constexpr):
    """`(doc, doc_key_start, doc_key_end, first_pos)` of a key-tile-outer program's tile: its
    document, the document's packed key rows and the tile's first key position. The tile is
    empty when `doc_key_start + first_pos >= doc_key_end` (or the start is negative)."""
    pid = tl.program_id(0)
    doc = pid % num_docs
    doc_key_start = tl.load(cu_seqlens_k + doc)
    doc_key_end = tl.minimum(tl.load(cu_seqlens_k + doc + 1), num_keys)
    first_pos = (pid // num_docs) * BLOCK_N  # the first tiles of a document are seen by most queries
    return doc, doc_key_start, doc_key_end, first_pos


@triton.jit
def _key_tile_rows(doc_key_start, doc_key_end, first_pos, BLOCK_N: tl.constexpr):
    """A non-empty key tile's key positions, packed rows (int64; rows past the document repeat
    its first) and which are real (`key_ok`)."""
    key_pos = first_pos + tl.arange(0, BLOCK_N)
    key_row = (doc_key_start + key_pos).to(tl.int64)
    key_ok = key_row < doc_key_end
    return key_pos, tl.where(key_ok, key_row, doc_key_start), key_ok


@triton.jit
def _query_runs(doc, num_runs, FRAGMENTS: tl.constexpr):
    """The query runs `[lo, hi)` a key tile of document `doc` walks: the document's own queries,
    or, with fragments, every fragment (`_query_run` empties those of other documents)."""
    if FRAGMENTS:
        lo = 0
        hi = num_runs
    else:
        lo = doc
        hi = doc + 1
    return lo, hi


@triton.jit
def _query_run(run, doc, doc_key_start, first_pos, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
               num_queries, FRAGMENTS: tl.constexpr):
    """Query rows `[first_query, query_end)` of run `run` that may see the key tile at
    `first_pos` of document `doc`. A run's local query `i` sits at key position `start + i`:
    without fragments the run is the document's queries, the causal suffix of its keys
    (`start = Lk - Lq`); with fragments it is fragment `run` (`start = fragment_starts[run]`),
    empty unless it belongs to `doc`. Queries before the first that can see the tile are skipped
    (the masks decide the rest)."""
    run_start = tl.load(cu_seqlens_q + run)
    run_end = tl.load(cu_seqlens_q + run + 1)
    if FRAGMENTS:
        start = tl.load(fragment_starts + run)
    else:
        start = tl.load(cu_seqlens_k + doc + 1) - doc_key_start - (run_end - run_start)
    first_query = tl.maximum(run_start + tl.maximum(0, first_pos - start), 0)
    query_end = tl.minimum(run_end, num_queries)
    if FRAGMENTS:
        query_end = tl.where(tl.load(fragment_documents + run) == doc, query_end, first_query)
    return first_query, query_end


@triton.jit
def _seeing_queries(key_start, position, doc_key_start, first, query_end, TOKENS: tl.constexpr):
    """`TOKENS` queries of a key tile's run from `first`: rows (int64; padded rows repeat
    `first`), which are real, and their key positions (`-1`: a padded row, or a row of another
    document under malformed boundaries, sees no key)."""
    token = first + tl.arange(0, TOKENS)
    real = token < query_end
    token = tl.where(real, token, first).to(tl.int64)
    same = tl.load(key_start + token) == doc_key_start
    return token, real, tl.where(real & same, tl.load(position + token), -1)


@cached_launches
@triton.jit
def msa_kl_dense_teacher_queries_kernel(
    q, k, teacher_lse, index_q, key_start, position, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
    teacher_index_queries, num_queries, num_keys, num_docs, num_runs, qk_scale,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_iq_token, stride_iq_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr, DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    PRECISION: tl.constexpr, INDEX_PRECISION: tl.constexpr, SPLIT: tl.constexpr, FRAGMENTS: tl.constexpr,
):
    """`teacher_index_queries` of one key tile, with no atomics: the tile's teacher probabilities
    recomputed for every KV head and every query that sees the tile, reduced in registers."""
    doc, doc_key_start, doc_key_end, first_pos = _key_tile(cu_seqlens_k, num_keys, num_docs, BLOCK_N)
    if (doc_key_start + first_pos >= doc_key_end) | (doc_key_start < 0):
        return
    key_pos, key_row, key_ok = _key_tile_rows(doc_key_start, doc_key_end, first_pos, BLOCK_N)
    runs_lo, runs_hi = _query_runs(doc, num_runs, FRAGMENTS)
    dims = tl.arange(0, DIM)
    index_dims = tl.arange(0, INDEX_DIM)
    acc = tl.zeros((BLOCK_N, INDEX_DIM), tl.float32)
    for kv_head in range(0, NUM_KV_HEADS):
        keys = tl.load(k + key_row[:, None] * stride_k_token + kv_head * stride_k_head + dims[None, :],
                       mask=key_ok[:, None], other=0.0)
        for run in range(runs_lo, runs_hi):
            first_query, query_end = _query_run(run, doc, doc_key_start, first_pos, cu_seqlens_q, cu_seqlens_k,
                                                fragment_documents, fragment_starts, num_queries, FRAGMENTS)
            for first in range(first_query, query_end, TOKENS):
                token, real, pos = _seeing_queries(key_start, position, doc_key_start, first, query_end, TOKENS)
                index_queries = tl.load(
                    index_q + token[:, None] * stride_iq_token + kv_head * stride_iq_head + index_dims[None, :],
                    mask=real[:, None], other=0.0)
                # Transposed (`[keys, queries]`), the loss kernel's teacher: the group's heads in turn.
                teacher = tl.zeros((BLOCK_N, TOKENS), tl.float32)
                for group_head in tl.range(0, GROUP):
                    head = kv_head * GROUP + group_head
                    queries = tl.load(q + token[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                                      mask=real[:, None], other=0.0)
                    shift = _finite_or_zero(
                        tl.load(teacher_lse + token * NUM_HEADS + head, mask=real, other=0.0) * LOG2_E)
                    scores = tl.dot(keys, tl.trans(queries), input_precision=PRECISION) * qk_scale
                    teacher += tl.exp2(scores - shift[None, :])
                visible = (key_pos[:, None] <= pos[None, :]) & key_ok[:, None]
                teacher = tl.where(visible, teacher * (1.0 / GROUP), 0.0)
                acc = weighted_dot(teacher, index_queries, acc, SPLIT, INDEX_PRECISION)
    tl.store(teacher_index_queries + key_row[:, None] * INDEX_DIM + index_dims[None, :], acc, mask=key_ok[:, None])


@cached_launches
@triton.jit
def msa_kl_dense_query_grad_kernel(
    index_q, index_k, index_lse, teacher_mass, teacher_index_keys, coefficient, d_index_q,
    key_start, position, cu_seqlens_q,
    num_queries, num_docs, tiles_per_doc, index_scale,
    stride_iq_token, stride_iq_head, stride_ik_token,
    NUM_KV_HEADS: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, INDEX_DIM: tl.constexpr,
    INDEX_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    """`d_index_q` of one query tile and index head: the student's probabilities over the visible
    keys times their index keys, against the teacher's index keys."""
    kv_head = tl.program_id(1)
    empty, token, real, pos, tile_key_start, last = _query_tile(key_start, position, cu_seqlens_q, num_queries, num_docs,
                                                                tiles_per_doc, TOKENS)
    if empty:
        return
    index_dims = tl.arange(0, INDEX_DIM)
    offsets = tl.arange(0, BLOCK_N)
    pair = token * NUM_KV_HEADS + kv_head
    index_queries = tl.load(
        index_q + token[:, None] * stride_iq_token + kv_head * stride_iq_head + index_dims[None, :],
        mask=real[:, None], other=0.0)
    student_shift = _finite_or_zero(tl.load(index_lse + pair, mask=real, other=0.0) * LOG2_E)
    acc = tl.zeros((TOKENS, INDEX_DIM), tl.float32)
    for first in range(0, last + 1, BLOCK_N):
        key_pos = first + offsets
        key_row = (tile_key_start + key_pos).to(tl.int64)
        index_keys = tl.load(index_k + key_row[:, None] * stride_ik_token + index_dims[None, :],
                             mask=(key_pos <= last)[:, None], other=0.0)
        logits = tl.dot(index_queries, tl.trans(index_keys), input_precision=INDEX_PRECISION) * index_scale
        student = tl.where(key_pos[None, :] <= pos[:, None], tl.exp2(logits - student_shift[:, None]), 0.0)
        acc = weighted_dot(student, index_keys, acc, SPLIT, INDEX_PRECISION)
    mass = tl.load(teacher_mass + pair, mask=real, other=0.0)
    teacher_keys = tl.load(teacher_index_keys + pair[:, None] * INDEX_DIM + index_dims[None, :],
                           mask=real[:, None], other=0.0)
    grad = tl.load(coefficient) * (mass[:, None] * acc - teacher_keys)
    tl.store(d_index_q + pair[:, None] * INDEX_DIM + index_dims[None, :], grad.to(d_index_q.dtype.element_ty),
             mask=real[:, None])


@cached_launches
@triton.jit
def msa_kl_dense_key_grad_kernel(
    index_q, index_k, index_lse, teacher_mass, teacher_index_queries, coefficient, d_index_k,
    key_start, position, cu_seqlens_q, cu_seqlens_k, fragment_documents, fragment_starts,
    num_queries, num_keys, num_docs, num_runs, index_scale,
    stride_iq_token, stride_iq_head, stride_ik_token,
    NUM_KV_HEADS: tl.constexpr, TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, INDEX_DIM: tl.constexpr,
    INDEX_PRECISION: tl.constexpr, SPLIT: tl.constexpr, FRAGMENTS: tl.constexpr,
):
    doc, doc_key_start, doc_key_end, first_pos = _key_tile(cu_seqlens_k, num_keys, num_docs, BLOCK_N)
    if (doc_key_start + first_pos >= doc_key_end) | (doc_key_start < 0):
        return
    key_pos, key_row, key_ok = _key_tile_rows(doc_key_start, doc_key_end, first_pos, BLOCK_N)
    runs_lo, runs_hi = _query_runs(doc, num_runs, FRAGMENTS)
    index_dims = tl.arange(0, INDEX_DIM)
    index_keys = tl.load(index_k + key_row[:, None] * stride_ik_token + index_dims[None, :],
                         mask=key_ok[:, None], other=0.0)
    acc = tl.zeros((BLOCK_N, INDEX_DIM), tl.float32)
    for kv_head in range(0, NUM_KV_HEADS):
        for run in range(runs_lo, runs_hi):
            first_query, query_end = _query_run(run, doc, doc_key_start, first_pos, cu_seqlens_q, cu_seqlens_k,
                                                fragment_documents, fragment_starts, num_queries, FRAGMENTS)
            for first in range(first_query, query_end, TOKENS):
                token, real, pos = _seeing_queries(key_start, position, doc_key_start, first, query_end, TOKENS)
                pair = token * NUM_KV_HEADS + kv_head
                index_queries = tl.load(
                    index_q + token[:, None] * stride_iq_token + kv_head * stride_iq_head + index_dims[None, :],
                    mask=real[:, None], other=0.0)
                student_shift = _finite_or_zero(tl.load(index_lse + pair, mask=real, other=0.0) * LOG2_E)
                mass = tl.load(teacher_mass + pair, mask=real, other=0.0)
                logits = tl.dot(index_keys, tl.trans(index_queries), input_precision=INDEX_PRECISION) * index_scale
                visible = (key_pos[:, None] <= pos[None, :]) & key_ok[:, None]
                weights = tl.where(visible, tl.exp2(logits - student_shift[None, :]) * mass[None, :], 0.0)
                acc = weighted_dot(weights, index_queries, acc, SPLIT, INDEX_PRECISION)
    teacher_queries = tl.load(teacher_index_queries + key_row[:, None] * INDEX_DIM + index_dims[None, :],
                              mask=key_ok[:, None], other=0.0)
    grad = tl.load(coefficient) * (acc - teacher_queries)
    tl.store(d_index_k + key_row[:, None] * INDEX_DIM + index_dims[None, :], grad.to(d_index_k.dtype.element_ty),
             mask=key_ok[:, None])


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels take any token and head strides but a unit stride along the head dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _tiles_per_doc(max_seqlen: int, num_rows: int, tile: int) -> int:
    return triton.cdiv(max(1, min(max_seqlen, num_rows)), tile)


def _key_documents(documents) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
    """The key-tile-outer kernels' documents: how many (`cu_seqlens_k`'s, which with fragments
    are not `cu_seqlens_q`'s) and the contiguous fragment tensors (without fragments, any int32
    pointer: the kernels do not read it)."""
    fragment_documents, fragment_starts = documents.fragments
    if fragment_documents is None or fragment_starts is None:
        fragment_documents = fragment_starts = documents.cu_seqlens_q
    return documents.cu_seqlens_k.numel() - 1, (fragment_documents.contiguous(), fragment_starts.contiguous())


def indexer_kl_dense(q, k, lse, index_q, index_k, documents, softmax_scale, index_softmax_scale):
    """The index loss on the dense support and what its backward needs.

    Args:
        q: `[Tq, Hq, D]`, k: `[Tk, Hkv, D]` (bf16, fp16 or fp32; D a power of two in [16, 256]).
        lse: `[Tq, Hq]` the dense causal attention's log-sum-exp (natural log), or None to
            compute it here.
        index_q: `[Tq, Hi, Di]` with `Hi == Hkv`; index_k: `[Tk, 1, Di]` (Di a power of two in
            [16, 256]).
        documents: the documents (`torch_msa/documents.py`): queries are the causal suffix of
            the keys, or, with fragments, `cu_seqlens_q` `[F + 1]` delimits query fragments.

    Returns:
        `loss` (0-D), `teacher_lse [Tq, Hq]` (the lse used), `index_lse [Tq, Hi]` (the student's
        lse over J, `-inf` where J is empty), `teacher_mass [Tq, Hi]` (`sum_J P_t`),
        `teacher_index_keys [Tq, Hi, Di]` (`sum_J P_t index_k`) and `teacher_index_queries
        [Tk, 1, Di]` (`sum_(t, r): j in J P_t index_q[t, r]`), all fp32.
    """
    check_inputs(q, k, index_q)
    # Decided per call, like the backward's kernels.
    deterministic = torch.are_deterministic_algorithms_enabled()
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    index_dim = index_q.shape[-1]
    device, f32 = q.device, torch.float32
    if lse is None:
        teacher_lse = torch.full((num_queries, num_heads), -math.inf, dtype=f32, device=device)
    else:
        teacher_lse = uninitialized((num_queries, num_heads), dtype=f32, device=device)
        teacher_lse.copy_(lse)
    index_lse = torch.full((num_queries, num_kv_heads), -math.inf, dtype=f32, device=device)
    weighted = torch.zeros((num_queries, num_kv_heads), dtype=f32, device=device)
    mass = torch.zeros_like(weighted)
    teacher_index_keys = torch.zeros((num_queries, num_kv_heads, index_dim), dtype=f32, device=device)
    teacher_index_queries = torch.zeros((num_keys, 1, index_dim), dtype=f32, device=device)
    num_docs = documents.cu_seqlens_q.numel() - 1
    outputs = (teacher_lse, index_lse, mass, teacher_index_keys, teacher_index_queries)
    if num_queries == 0 or num_keys == 0 or num_docs < 1:
        return (torch.zeros((), dtype=f32, device=device), *outputs)

    q, k, index_q, index_k = (_rows_contiguous(x) for x in (q, k, index_q, index_k))
    cu_seqlens_q, cu_seqlens_k = documents.cu_seqlens_q.contiguous(), documents.cu_seqlens_k.contiguous()
    max_seqlen_q, max_seqlen_k = documents.max_seqlen_q, documents.max_seqlen_k
    docs = locate_queries(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys, *documents.fragments)
    num_key_docs, fragments = _key_documents(documents)
    group = num_heads // num_kv_heads
    qk_scale, index_scale = softmax_scale * LOG2_E.value, index_softmax_scale * LOG2_E.value
    precision, index_precision = dot_precision(q.dtype), dot_precision(index_q.dtype)
    shape_key = (device, q.dtype, index_q.dtype, dim, index_dim, group)

    if lse is None:
        def launch_teacher_lse(config):
            tiles = _tiles_per_doc(max_seqlen_q, num_queries, config.rows)
            msa_kl_dense_teacher_lse_kernel[(num_docs * tiles, num_heads)](
                q, k, docs.key_start, docs.position, cu_seqlens_q, teacher_lse,
                num_queries, num_docs, tiles, qk_scale,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                NUM_HEADS=num_heads, GROUP=group, TOKENS=config.rows, BLOCK_N=config.block_n, DIM=dim,
                PRECISION=precision, **config.options,
            )

        launch("msa_kl_dense_teacher_lse_kernel", shape_key, TEACHER_LSE_CONFIGS, launch_teacher_lse)

    def launch_loss(config):
        tiles = _tiles_per_doc(max_seqlen_q, num_queries, config.rows)
        msa_kl_dense_loss_kernel[(num_docs * tiles, num_kv_heads)](
            q, k, teacher_lse, index_q, index_k, docs.key_start, docs.position, cu_seqlens_q,
            weighted, mass, index_lse, teacher_index_keys, teacher_index_queries,
            num_queries, num_docs, tiles, qk_scale, index_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), index_q.stride(0), index_q.stride(1), index_k.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, TOKENS=config.rows, BLOCK_N=config.block_n,
            DIM=dim, INDEX_DIM=index_dim, PRECISION=precision, INDEX_PRECISION=index_precision,
            SPLIT=split_weights(index_q.dtype), DETERMINISTIC=deterministic,
            **config.options,
        )

    def launch_teacher_queries(config):
        tiles = _tiles_per_doc(max_seqlen_k, num_keys, config.block_n)
        msa_kl_dense_teacher_queries_kernel[(num_key_docs * tiles,)](
            q, k, teacher_lse, index_q, docs.key_start, docs.position, cu_seqlens_q, cu_seqlens_k, *fragments,
            teacher_index_queries, num_queries, num_keys, num_key_docs, num_docs, qk_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), index_q.stride(0), index_q.stride(1),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, TOKENS=config.rows, BLOCK_N=config.block_n,
            DIM=dim, INDEX_DIM=index_dim, PRECISION=precision, INDEX_PRECISION=index_precision,
            SPLIT=split_weights(index_q.dtype), FRAGMENTS=documents.has_fragments,
            **config.options,
        )

    if deterministic:
        launch("msa_kl_dense_loss_kernel (deterministic)", shape_key, LOSS_CONFIGS, launch_loss)
        launch("msa_kl_dense_teacher_queries_kernel", shape_key, TEACHER_QUERIES_CONFIGS, launch_teacher_queries)
    else:
        launch("msa_kl_dense_loss_kernel", shape_key, LOSS_CONFIGS, launch_loss)
    divergence = weighted + torch.where(mass > 0, mass * index_lse.masked_fill(torch.isinf(index_lse), 0), 0)
    loss = divergence.sum() / (num_queries * num_kv_heads)
    return (loss, *outputs)


def indexer_kl_dense_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                              teacher_index_queries, documents, index_softmax_scale):
    """`(d index_q [Tq, Hi, Di], d index_k [Tk, 1, Di])` in the index inputs' dtype, from the
    forward's `index_lse`, `teacher_mass`, `teacher_index_keys` and `teacher_index_queries`:

        d index_q[t, r] = c (M[t, r] sum_J P_s(j) index_k[j] - teacher_index_keys[t, r])
        d index_k[j] = c (sum_(t, r): j in J M[t, r] P_s(t, j) index_q[t, r] - teacher_index_queries[j])

    with `c = grad_loss * index_softmax_scale / (Tq * Hi)`. Deterministic (no atomics).
    """
    check_dtype_and_group("index_q", index_q.dtype)
    index_dim = index_q.shape[-1]
    _check_dim("index head dim", index_dim)
    num_queries, num_kv_heads, _ = index_q.shape
    num_keys = index_k.shape[0]
    device = index_q.device
    d_index_q = torch.zeros(index_q.shape, dtype=index_q.dtype, device=device)
    d_index_k = torch.zeros((num_keys, 1, index_dim), dtype=index_k.dtype, device=device)
    num_docs = documents.cu_seqlens_q.numel() - 1
    if num_queries == 0 or num_keys == 0 or num_docs < 1:
        return d_index_q, d_index_k

    index_q, index_k = _rows_contiguous(index_q), _rows_contiguous(index_k)
    index_lse, teacher_mass, teacher_index_keys, teacher_index_queries = (
        x.float().contiguous() for x in (index_lse, teacher_mass, teacher_index_keys, teacher_index_queries))
    documents = documents.map_tensors(torch.Tensor.contiguous)
    cu_seqlens_q, cu_seqlens_k = documents.cu_seqlens_q, documents.cu_seqlens_k
    max_seqlen_q, max_seqlen_k = documents.max_seqlen_q, documents.max_seqlen_k
    docs = locate_queries(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys, *documents.fragments)
    num_key_docs, fragments = _key_documents(documents)
    coefficient = (grad_loss.float() * (index_softmax_scale / (num_queries * num_kv_heads))).reshape(1)
    index_scale = index_softmax_scale * LOG2_E.value
    index_precision = dot_precision(index_q.dtype)
    shape_key = (device, index_q.dtype, index_dim)

    def launch_query_grad(config):
        tiles = _tiles_per_doc(max_seqlen_q, num_queries, config.rows)
        msa_kl_dense_query_grad_kernel[(num_docs * tiles, num_kv_heads)](
            index_q, index_k, index_lse, teacher_mass, teacher_index_keys, coefficient, d_index_q,
            docs.key_start, docs.position, cu_seqlens_q,
            num_queries, num_docs, tiles, index_scale,
            index_q.stride(0), index_q.stride(1), index_k.stride(0),
            NUM_KV_HEADS=num_kv_heads, TOKENS=config.rows, BLOCK_N=config.block_n, INDEX_DIM=index_dim,
            INDEX_PRECISION=index_precision, SPLIT=split_weights(index_q.dtype),
            **config.options,
        )

    def launch_key_grad(config):
        tiles = _tiles_per_doc(max_seqlen_k, num_keys, config.block_n)
        msa_kl_dense_key_grad_kernel[(num_key_docs * tiles,)](
            index_q, index_k, index_lse, teacher_mass, teacher_index_queries, coefficient, d_index_k,
            docs.key_start, docs.position, cu_seqlens_q, cu_seqlens_k, *fragments,
            num_queries, num_keys, num_key_docs, num_docs, index_scale,
            index_q.stride(0), index_q.stride(1), index_k.stride(0),
            NUM_KV_HEADS=num_kv_heads, TOKENS=config.rows, BLOCK_N=config.block_n, INDEX_DIM=index_dim,
            INDEX_PRECISION=index_precision, SPLIT=split_weights(index_q.dtype), FRAGMENTS=documents.has_fragments,
            **config.options,
        )

    launch("msa_kl_dense_query_grad_kernel", shape_key, QUERY_GRAD_CONFIGS, launch_query_grad)
    launch("msa_kl_dense_key_grad_kernel", shape_key, KEY_GRAD_CONFIGS, launch_key_grad)
    return d_index_q, d_index_k
