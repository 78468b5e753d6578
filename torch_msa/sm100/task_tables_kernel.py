"""The task-table and K/V alignment kernels in CuTe DSL, and the document lookup the postprocess
kernel shares; host side `task_tables.py`."""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..cute_dsl.cute_io import ACCESS_BYTES
from .common import THREADS_PER_CTA, TOKENS_PER_TASK, WORKSPACE_ALIGNMENT, TaskOperands


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


class TaskKernel:
    """One thread per schedule item writes that task's meta, query rows and positions.

    Thread `i` also writes `bucket_task_ptr[b] = i` when it is the first task of bucket `b`,
    and, for `i` in `[num_buckets, max_buckets]`, the end marker `num_tasks`. Buckets are
    dense (`0..num_buckets-1` all hold entries) and items are sorted by bucket, so every
    pointer is written exactly once.
    """

    @cute.jit
    def __call__(self, *operands_and_scalars):
        """The `TaskOperands` (CuTe tensors, in order), then `topk` and `num_keys` (Int32), the stream last."""
        count = len(TaskOperands._fields)
        operands = TaskOperands(*operands_and_scalars[:count])
        topk, num_keys, stream = operands_and_scalars[count:]
        threads = cutlass.max(operands.task_meta.shape[0], operands.bucket_task_ptr.shape[0])
        self.kernel(operands, topk, num_keys).launch(
            grid=[cute.ceil_div(threads, THREADS_PER_CTA), 1, 1], block=[THREADS_PER_CTA, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, operands: TaskOperands, topk: Int32, num_keys: Int32):
        thread, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        task = cta * THREADS_PER_CTA + thread
        if task < operands.task_meta.shape[0]:
            bucket = operands.item_bucket[task]
            first_entry = operands.item_start[task]
            num_rows = operands.item_end[task] - first_entry
            meta = cute.make_rmem_tensor(cute.make_layout(4), Int32)
            query_rows = cute.make_rmem_tensor(cute.make_layout(TOKENS_PER_TASK), Int32)
            positions = cute.make_rmem_tensor(cute.make_layout(TOKENS_PER_TASK), Int32)
            meta.fill(0)
            query_rows.fill(-1)
            positions.fill(-1)
            if num_rows > 0:
                key_row = operands.bucket_key_row[bucket]
                document = last_document_at_or_before(operands.cu_seqlens_k, key_row, num_keys)
                workspace = operands.doc_aligned_start[operands.doc_aligned_start.shape[0] - 1]
                aligned_row = (
                    operands.doc_aligned_start[document] + key_row - clamped(operands.cu_seqlens_k[document], num_keys)
                )
                meta[0] = operands.bucket_head[bucket]
                # Only malformed cu_seqlens_k can move a block off its document; even then
                # the tile it names stays inside the workspace.
                meta[1] = clamped(aligned_row, workspace - WORKSPACE_ALIGNMENT)
                meta[2] = operands.bucket_block[bucket]
                meta[3] = num_rows
                for row in cutlass.range_constexpr(TOKENS_PER_TASK):
                    if row < num_rows:
                        token = operands.entry_query[first_entry + row] // topk
                        query_rows[row] = token
                        positions[row] = operands.position[token]
                previous_bucket = operands.item_bucket[cutlass.max(task - 1, Int32(0))]
                if task == 0 or previous_bucket != bucket:
                    operands.bucket_task_ptr[bucket] = task
            cute.autovec_copy(meta, operands.task_meta[task, None])
            cute.autovec_copy(query_rows, operands.task_qrows[task, None])
            cute.autovec_copy(positions, operands.task_qpos[task, None])
        if task < operands.bucket_task_ptr.shape[0]:
            if task >= operands.num_buckets[0]:
                operands.bucket_task_ptr[task] = operands.num_items[0]


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

