"""The SM100 backward's task tables and its 128-aligned K/V workspace (architecture-neutral).

The SM100 backward is KV-outer: a CTA owns one KV head's key block and walks the query tokens that
chose it, eight tokens (x 16 query heads = one 128-row tile) per *task*. The shared schedule
(`torch_msa.schedule`, built with `entries_per_item=8`) already sorts the selections into buckets
(one kv head x key block) and items of at most eight entries; its items are the tasks. This module
turns them into the flat tables the kernel reads (`TaskTables`) with a CuTe DSL kernel, and copies
K/V into the aligned workspace, where every document's keys start on a 128-row boundary so that a
key block is always one whole, TMA-friendly tile that never straddles two documents.

Nothing here synchronises with the host: the workspace height `W` is the bound
`128 * (ceil(Tk / 128) + B)` (the schedule's bound of the key blocks, `max_key_blocks`, for
blocks of 128), which holds every document padded to a multiple of 128 rows, so it is known from
shapes alone (the price is at most `128 * B` rows of zero padding).

The CuTe DSL is imported only inside functions (after `require_cute_dsl`), so this module imports
on hosts without it. The kernels compile for any architecture (`compile_for_target`); this
module uses `cute_io` for how torch tensors are handed to the CuTe kernels.
"""

import functools
from typing import NamedTuple

import torch

from ..schedule import build_schedule, max_key_blocks
from . import require_cute_dsl
from .cute_io import (
    ACCESS_BYTES,
    aligned_operand,
    check_index_tensor,
    compile_options,
    cute_rows,
    cute_stream,
    cutlass_dtype,
    fake_rows,
)

TASK_ROWS = 8  # query tokens per task: 8 tokens x 16 query heads fill one 128-row MMA tile
WORKSPACE_ALIGNMENT = 128  # rows; every document's keys start on such a boundary
THREADS_PER_CTA = 256


class TaskTables(NamedTuple):
    """The tables the SM100 backward walks (int32 device tensors unless noted).

    Attributes:
        task_meta: `[max_tasks, 4]` rows `(kv_head, aligned_key_row, block_id, num_rows)`;
            `aligned_key_row` is the workspace row of the block's first key, `num_rows` in 0..8
            (0: unused task, whose other fields are 0).
        task_qrows: `[max_tasks, 8]` packed query token `t` of each row, -1 padding.
        task_qpos: `[max_tasks, 8]` key position `p(t)` of each row inside its document (key
            `block_id * block_size + c` is visible iff it is `<= p(t)`), -1 padding.
        bucket_task_ptr: `[max_buckets + 1]` tasks of bucket `b` (one kv head x key block,
            ordered by (kv head, packed key row)) are `[ptr[b], ptr[b + 1])`; empty past the real
            buckets.
        num_tasks: `[1]` the real task count.
        workspace_rows: host int `W`, rows of the aligned K/V workspace (a multiple of 128).
        doc_aligned_start: `[B + 1]` workspace row where each document's keys start (a multiple
            of 128); the last entry is `W`.
        num_keys: host int `Tk`, rows of the packed keys (the postprocess un-aligns dk / dv to
            it without reading `cu_seqlens_k[-1]` back to the host).
    """

    task_meta: torch.Tensor
    task_qrows: torch.Tensor
    task_qpos: torch.Tensor
    bucket_task_ptr: torch.Tensor
    num_tasks: torch.Tensor
    workspace_rows: int
    doc_aligned_start: torch.Tensor
    num_keys: int


def workspace_rows(num_keys: int, num_docs: int) -> int:
    """`W`: rows that hold every document's keys padded to a multiple of 128 (never 0)."""
    return WORKSPACE_ALIGNMENT * max(1, max_key_blocks(num_keys, num_docs, WORKSPACE_ALIGNMENT))


def document_key_bounds(cu_seqlens_k: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per document, `(start, length)` of its keys, int64 `[B]`, clamped into `[0, num_keys]`.

    Clamping keeps malformed boundaries from pushing any aligned row past `W`; for well-formed
    ones it changes nothing. The kernels apply the same clamp when they read `cu_seqlens_k`.
    """
    bounds = cu_seqlens_k.to(torch.int64).clamp(0, num_keys)
    return bounds[:-1], (bounds[1:] - bounds[:-1]).clamp(min=0)


def doc_aligned_starts(cu_seqlens_k: torch.Tensor, num_keys: int, rows: int) -> torch.Tensor:
    """int32 `[B + 1]`: exclusive prefix sum of the documents' key counts rounded up to 128,
    then `rows` (= `W`)."""
    _, lengths = document_key_bounds(cu_seqlens_k, num_keys)
    padded = (lengths + WORKSPACE_ALIGNMENT - 1) // WORKSPACE_ALIGNMENT * WORKSPACE_ALIGNMENT
    starts = torch.full((lengths.numel() + 1,), rows, dtype=torch.int64, device=cu_seqlens_k.device)
    starts[:-1] = torch.cumsum(padded, 0) - padded
    return starts.to(torch.int32)


def build_tasks(
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_keys: int,
    block_size: int = 128,
) -> TaskTables:
    """Build the SM100 task tables on the device, with no host synchronisation.

    The sort and bucketing are `torch_msa.schedule.build_schedule(..., entries_per_item=8)`
    (torch ops); a CuTe DSL kernel then writes one task per schedule item, mapping each bucket's
    packed key row to the aligned workspace and each entry to its query token and position.

    Args:
        block_indices: int32 `[Hkv, Tq, topk]` on a CUDA device.
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]` on the same device.
        num_keys: `Tk`, rows of the packed keys.
        block_size: keys per block; it must divide 128 (the contract uses 128).
    """
    check_index_tensor("block_indices", block_indices, dims=3)
    check_index_tensor("cu_seqlens_q", cu_seqlens_q, dims=1, device=block_indices.device)
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, dims=1, device=block_indices.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel() or cu_seqlens_q.numel() < 1:
        raise ValueError(
            f"cu_seqlens_k: expected B + 1 >= 1 entries like cu_seqlens_q ({cu_seqlens_q.numel()}), "
            f"got {cu_seqlens_k.numel()}"
        )
    if not isinstance(num_keys, int) or num_keys < 0:
        raise ValueError(f"num_keys: expected an int >= 0, got {num_keys!r}")
    if block_size <= 0 or WORKSPACE_ALIGNMENT % block_size:
        raise ValueError(f"block_size: expected a divisor of {WORKSPACE_ALIGNMENT}, got {block_size}")
    require_cute_dsl()

    num_docs = cu_seqlens_k.numel() - 1
    rows = workspace_rows(num_keys, num_docs)
    schedule = build_schedule(block_indices, cu_seqlens_q, cu_seqlens_k, num_keys, block_size, TASK_ROWS)
    aligned_starts = doc_aligned_starts(cu_seqlens_k, num_keys, rows)
    max_tasks = schedule.item_bucket.numel()
    device = block_indices.device
    tables = TaskTables(
        task_meta=torch.empty(max_tasks, 4, dtype=torch.int32, device=device),
        task_qrows=torch.empty(max_tasks, TASK_ROWS, dtype=torch.int32, device=device),
        task_qpos=torch.empty(max_tasks, TASK_ROWS, dtype=torch.int32, device=device),
        bucket_task_ptr=torch.empty(schedule.bucket_head.numel() + 1, dtype=torch.int32, device=device),
        num_tasks=schedule.num_items,
        workspace_rows=rows,
        doc_aligned_start=aligned_starts,
        num_keys=num_keys,
    )
    _compiled_task_kernel()(
        *(cute_rows(x) for x in (
            schedule.entry_query, schedule.item_bucket, schedule.item_start, schedule.item_end,
            schedule.bucket_head, schedule.bucket_key_row, schedule.bucket_block, schedule.position,
            schedule.num_items, schedule.num_buckets, aligned_operand(cu_seqlens_k), aligned_starts,
            tables.task_meta, tables.task_qrows, tables.task_qpos, tables.bucket_task_ptr,
        )),
        block_indices.shape[-1], num_keys, cute_stream(device),
    )
    return tables


def align_kv(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor, tables: TaskTables
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy packed K/V into the aligned workspace with a CuTe DSL gather kernel.

    Args:
        k, v: `[Tk, Hkv, D]` on a CUDA device, one dtype of 2 or 4 bytes (bf16 in the contract).
        cu_seqlens_k: int32 `[B + 1]`.
        tables: from `build_tasks` on the same documents.

    Returns:
        `(k_ws, v_ws)`, `[W, Hkv, D]` in k's dtype: document `d`'s key `j` at row
        `doc_aligned_start[d] + j`; every other row is zero.
    """
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k, [Tk, Hkv, D] = {tuple(k.shape)}, got {tuple(v.shape)}")
    if v.dtype != k.dtype or k.element_size() not in (2, 4):
        raise TypeError(f"v: expected k's dtype (a 2- or 4-byte float), got k {k.dtype}, v {v.dtype}")
    if k.device.type != "cuda" or v.device != k.device:
        raise ValueError(f"k, v: expected one CUDA device, got {k.device} and {v.device}")
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, dims=1, device=k.device)
    check_tables_match(tables, cu_seqlens_k)
    require_cute_dsl()
    num_keys, num_kv_heads, head_dim = k.shape
    rows = tables.workspace_rows
    k_ws = torch.empty(rows, num_kv_heads, head_dim, dtype=k.dtype, device=k.device)
    v_ws = torch.empty_like(k_ws)
    row = num_kv_heads * head_dim
    kernel = _compiled_align_kernel(k.dtype, row)
    kernel(
        *(cute_rows(x.view(x.shape[0], row)) for x in (aligned_operand(k), aligned_operand(v), k_ws, v_ws)),
        cute_rows(aligned_operand(cu_seqlens_k)), cute_rows(tables.doc_aligned_start), num_keys, cute_stream(k.device),
    )
    return k_ws, v_ws


def check_tables_match(tables: TaskTables, cu_seqlens_k: torch.Tensor) -> None:
    """Refuse tables built for another number of documents than `cu_seqlens_k` describes."""
    if tables.doc_aligned_start.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"tables: built for {tables.doc_aligned_start.numel() - 1} documents, "
            f"cu_seqlens_k has {cu_seqlens_k.numel() - 1}"
        )


# ---------------------------------------------------------------------------------------------
# CuTe DSL kernels. Their classes need cutlass at definition time, so they are defined on first
# use (`_kernel_types`), never while this module loads.
# ---------------------------------------------------------------------------------------------


def compile_for_target(arch: str, dump_dir: str | None = None) -> dict:
    """Compile this module's kernels at the contract's shapes (bf16, Hkv=4, D=128, block 128)
    for `arch` (`"sm_90a"`, `"sm_100a"`); no GPU is needed. Returns name -> compiled kernel."""
    return {
        "task_tables": compile_task_kernel(arch, dump_dir),
        "align_kv": compile_align_kernel(torch.bfloat16, 4 * 128, arch, dump_dir),
    }


@functools.cache
def _compiled_task_kernel():
    return compile_task_kernel()


@functools.cache
def _compiled_align_kernel(dtype: torch.dtype, row_elements: int):
    return compile_align_kernel(dtype, row_elements)


def compile_task_kernel(arch: str | None = None, dump_dir: str | None = None):
    """Compile the task-table kernel (`arch=None`: this host's GPU)."""
    require_cute_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    index = torch.int32
    inputs = [fake_rows(index) for _ in range(12)]
    outputs = [fake_rows(index, (4,)), fake_rows(index, (TASK_ROWS,)), fake_rows(index, (TASK_ROWS,)), fake_rows(index)]
    task_kernel, _ = _kernel_types()
    return cute.compile(
        task_kernel(), *inputs, *outputs, cutlass.Int32(1), cutlass.Int32(1), make_fake_stream(),
        options=compile_options(arch, dump_dir),
    )


def compile_align_kernel(dtype: torch.dtype, row_elements: int, arch: str | None = None, dump_dir: str | None = None):
    """Compile the K/V alignment kernel for rows of `row_elements` (= Hkv * D) values of `dtype`."""
    require_cute_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    rows = [fake_rows(dtype, (row_elements,)) for _ in range(4)]
    _, align_kernel = _kernel_types()
    return cute.compile(
        align_kernel(cutlass_dtype(dtype).width, row_elements), *rows, fake_rows(torch.int32), fake_rows(torch.int32),
        cutlass.Int32(1), make_fake_stream(), options=compile_options(arch, dump_dir),
    )


@functools.cache
def document_lookup():
    """`@cute.jit` device helpers that find a row's document (shared with the postprocess)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    @cute.jit
    def clamped(value: Int32, limit: Int32) -> Int32:
        """`value` clamped into `[0, limit]`."""
        return cutlass.min(cutlass.max(value, Int32(0)), limit)

    @cute.jit
    def last_document_at_or_before(boundaries: cute.Tensor, row: Int32, limit: Int32) -> Int32:
        """The largest `d < B` with `clamped(boundaries[d], limit) <= row`, 0 when there is none.

        `boundaries` is `cu_seqlens_k` or `doc_aligned_start` (`[B + 1]`). Among documents that
        start on the same row (empty ones) the search lands on the last, the one whose rows
        actually follow. Callers check `B > 0` and that the row lies inside the document found.
        """
        low = Int32(0)
        high = boundaries.shape[0] - 2
        while low < high:
            middle = (low + high + 1) >> 1
            if clamped(boundaries[middle], limit) <= row:
                low = middle
            else:
                high = middle - 1
        return low

    return clamped, last_document_at_or_before


@functools.cache
def _kernel_types():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    clamped, last_document_at_or_before = document_lookup()

    class TaskKernel:
        """One thread per schedule item writes that task's meta, query rows and positions.

        Thread `i` also writes `bucket_task_ptr[b] = i` when it is the first task of bucket `b`,
        and, for `i` in `[num_buckets, max_buckets]`, the end marker `num_tasks`. Buckets are
        dense (`0..num_buckets-1` all hold entries) and items are sorted by bucket, so every
        pointer is written exactly once.
        """

        @cute.jit
        def __call__(
            self, entry_query: cute.Tensor, item_bucket: cute.Tensor, item_start: cute.Tensor,
            item_end: cute.Tensor, bucket_head: cute.Tensor, bucket_key_row: cute.Tensor,
            bucket_block: cute.Tensor, position: cute.Tensor, num_items: cute.Tensor,
            num_buckets: cute.Tensor, cu_seqlens_k: cute.Tensor, doc_aligned_start: cute.Tensor,
            task_meta: cute.Tensor, task_qrows: cute.Tensor, task_qpos: cute.Tensor,
            bucket_task_ptr: cute.Tensor, topk: Int32, num_keys: Int32, stream: cuda.CUstream,
        ):
            threads = cutlass.max(task_meta.shape[0], bucket_task_ptr.shape[0])
            self.kernel(
                entry_query, item_bucket, item_start, item_end, bucket_head, bucket_key_row,
                bucket_block, position, num_items, num_buckets, cu_seqlens_k, doc_aligned_start,
                task_meta, task_qrows, task_qpos, bucket_task_ptr, topk, num_keys,
            ).launch(
                grid=[cute.ceil_div(threads, THREADS_PER_CTA), 1, 1], block=[THREADS_PER_CTA, 1, 1], stream=stream
            )

        @cute.kernel
        def kernel(
            self, entry_query: cute.Tensor, item_bucket: cute.Tensor, item_start: cute.Tensor,
            item_end: cute.Tensor, bucket_head: cute.Tensor, bucket_key_row: cute.Tensor,
            bucket_block: cute.Tensor, position: cute.Tensor, num_items: cute.Tensor,
            num_buckets: cute.Tensor, cu_seqlens_k: cute.Tensor, doc_aligned_start: cute.Tensor,
            task_meta: cute.Tensor, task_qrows: cute.Tensor, task_qpos: cute.Tensor,
            bucket_task_ptr: cute.Tensor, topk: Int32, num_keys: Int32,
        ):
            thread, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            task = cta * THREADS_PER_CTA + thread
            if task < task_meta.shape[0]:
                bucket = item_bucket[task]
                first_entry = item_start[task]
                num_rows = item_end[task] - first_entry
                meta = cute.make_rmem_tensor(cute.make_layout(4), Int32)
                query_rows = cute.make_rmem_tensor(cute.make_layout(TASK_ROWS), Int32)
                positions = cute.make_rmem_tensor(cute.make_layout(TASK_ROWS), Int32)
                meta.fill(0)
                query_rows.fill(-1)
                positions.fill(-1)
                if num_rows > 0:
                    key_row = bucket_key_row[bucket]
                    document = last_document_at_or_before(cu_seqlens_k, key_row, num_keys)
                    workspace = doc_aligned_start[doc_aligned_start.shape[0] - 1]
                    aligned_row = doc_aligned_start[document] + key_row - clamped(cu_seqlens_k[document], num_keys)
                    meta[0] = bucket_head[bucket]
                    # Only malformed cu_seqlens_k can move a block off its document; even then
                    # the tile it names stays inside the workspace.
                    meta[1] = clamped(aligned_row, workspace - WORKSPACE_ALIGNMENT)
                    meta[2] = bucket_block[bucket]
                    meta[3] = num_rows
                    for row in cutlass.range_constexpr(TASK_ROWS):
                        if row < num_rows:
                            token = entry_query[first_entry + row] // topk
                            query_rows[row] = token
                            positions[row] = position[token]
                    previous_bucket = item_bucket[cutlass.max(task - 1, Int32(0))]
                    if task == 0 or previous_bucket != bucket:
                        bucket_task_ptr[bucket] = task
                cute.autovec_copy(meta, task_meta[task, None])
                cute.autovec_copy(query_rows, task_qrows[task, None])
                cute.autovec_copy(positions, task_qpos[task, None])
            if task < bucket_task_ptr.shape[0]:
                if task >= num_buckets[0]:
                    bucket_task_ptr[task] = num_items[0]

    class AlignKernel:
        """One CTA per 128-row block of the workspace: the block lies in one document's padded
        span (or past the last), so the CTA finds that document once and gathers its rows."""

        def __init__(self, element_bits: int, row_elements: int):
            self.vector = ACCESS_BYTES * 8 // element_bits  # elements per 16-byte access
            if row_elements % self.vector:
                raise ValueError(f"Hkv * D = {row_elements} is not a multiple of {self.vector} elements")
            self.row_elements = row_elements
            self.vectors_per_row = row_elements // self.vector
            self.tile_vectors = WORKSPACE_ALIGNMENT * self.vectors_per_row

        @cute.jit
        def __call__(
            self, k: cute.Tensor, v: cute.Tensor, k_workspace: cute.Tensor, v_workspace: cute.Tensor,
            cu_seqlens_k: cute.Tensor, doc_aligned_start: cute.Tensor, num_keys: Int32, stream: cuda.CUstream,
        ):
            self.kernel(k, v, k_workspace, v_workspace, cu_seqlens_k, doc_aligned_start, num_keys).launch(
                grid=[k_workspace.shape[0] // WORKSPACE_ALIGNMENT, 1, 1], block=[THREADS_PER_CTA, 1, 1], stream=stream
            )

        @cute.kernel
        def kernel(
            self, k: cute.Tensor, v: cute.Tensor, k_workspace: cute.Tensor, v_workspace: cute.Tensor,
            cu_seqlens_k: cute.Tensor, doc_aligned_start: cute.Tensor, num_keys: Int32,
        ):
            thread, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            first_row = cta * WORKSPACE_ALIGNMENT
            key_start = Int32(0)
            key_count = Int32(0)
            first_local = Int32(0)
            if cu_seqlens_k.shape[0] > 1:
                document = last_document_at_or_before(doc_aligned_start, first_row, k_workspace.shape[0])
                key_start = clamped(cu_seqlens_k[document], num_keys)
                key_count = clamped(cu_seqlens_k[document + 1], num_keys) - key_start
                first_local = first_row - doc_aligned_start[document]
            for step in cutlass.range(cute.ceil_div(self.tile_vectors, THREADS_PER_CTA)):
                flat = step * THREADS_PER_CTA + thread
                if flat < self.tile_vectors:
                    row = flat // self.vectors_per_row
                    column = (flat % self.vectors_per_row) * self.vector
                    local = first_local + row
                    key_fragment = cute.make_rmem_tensor(cute.make_layout(self.vector), k.element_type)
                    value_fragment = cute.make_rmem_tensor(cute.make_layout(self.vector), v.element_type)
                    if local >= 0 and local < key_count:
                        source = cute.assume(Int64(key_start + local) * self.row_elements + column, divby=self.vector)
                        cute.autovec_copy(self._vector_at(k, source), key_fragment)
                        cute.autovec_copy(self._vector_at(v, source), value_fragment)
                    else:
                        key_fragment.fill(0)
                        value_fragment.fill(0)
                    target = cute.assume(Int64(first_row + row) * self.row_elements + column, divby=self.vector)
                    cute.autovec_copy(key_fragment, self._vector_at(k_workspace, target))
                    cute.autovec_copy(value_fragment, self._vector_at(v_workspace, target))

        @cute.jit
        def _vector_at(self, rows: cute.Tensor, offset: Int64) -> cute.Tensor:
            # 64-bit element offsets: K/V of long sequences exceed 2^31 elements.
            return cute.make_tensor(rows.iterator + offset, cute.make_layout(self.vector))

    return TaskKernel, AlignKernel
