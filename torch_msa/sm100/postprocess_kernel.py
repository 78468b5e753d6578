"""The postprocess kernel of the backward pipeline in CuTe DSL: fp32 gradient pools to the output dtype.

`FinishKernel` casts row for row (`unalign=False`: dq), or gathers two pools back from the
128-aligned K/V workspace to the packed key rows (`unalign=True`: dk and dv, the inverse of
`task_tables.align_kv`), finding each row's document with the binary search of `task_tables_kernel.py`; a
row no document covers gets zeros. 64-bit element offsets, so the pools may pass 2^31 values.
Architecture-neutral: it compiles for sm_90a and sm_100a alike. Its host side (checks, launch,
compile cache) is `postprocess.py`, which imports this module, and so cutlass, only when it
first compiles the kernel.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..cute_dsl.cute_io import ACCESS_BYTES
from .common import THREADS_PER_CTA
from .task_tables_kernel import clamped, last_document_at_or_before

VECTORS_PER_THREAD = 4  # rows of a CTA are sized so each thread moves about this many vectors


class FinishKernel:
    """Each thread converts 16-byte output vectors: it reads the matching fp32 values of its
    source row (the same row, or for the un-align the row's workspace row) and stores them
    in the output dtype; a source row that does not exist gives zeros."""

    def __init__(self, output_bits: int, row_elements: int, unalign: bool):
        self.vector = ACCESS_BYTES * 8 // output_bits
        if row_elements % self.vector:
            raise ValueError(f"row of {row_elements} values is not a multiple of {self.vector}")
        self.row_elements = row_elements
        self.unalign = unalign
        self.vectors_per_row = row_elements // self.vector
        self.rows_per_cta = max(1, THREADS_PER_CTA * VECTORS_PER_THREAD // self.vectors_per_row)
        self.tile_vectors = self.rows_per_cta * self.vectors_per_row

    @cute.jit
    def __call__(
        self, source: cute.Tensor, target: cute.Tensor, second_source: cute.Tensor | None,
        second_target: cute.Tensor | None, cu_seqlens_k: cute.Tensor | None,
        doc_aligned_start: cute.Tensor | None, num_keys: Int32, stream: cuda.CUstream,
    ):
        self.kernel(source, target, second_source, second_target, cu_seqlens_k, doc_aligned_start, num_keys).launch(
            grid=[cute.ceil_div(target.shape[0], self.rows_per_cta), 1, 1], block=[THREADS_PER_CTA, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self, source: cute.Tensor, target: cute.Tensor, second_source: cute.Tensor | None,
        second_target: cute.Tensor | None, cu_seqlens_k: cute.Tensor | None,
        doc_aligned_start: cute.Tensor | None, num_keys: Int32,
    ):
        thread, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        for step in cutlass.range(cute.ceil_div(self.tile_vectors, THREADS_PER_CTA)):
            flat = step * THREADS_PER_CTA + thread
            row = cta * self.rows_per_cta + flat // self.vectors_per_row
            column = (flat % self.vectors_per_row) * self.vector
            if flat < self.tile_vectors and row < target.shape[0]:
                source_row = row
                present = True
                # With unalign the host passes cu_seqlens_k and doc_aligned_start: a trace-time branch,
                # which mypy does not narrow through.
                if cutlass.const_expr(self.unalign):
                    present = cutlass.Boolean(False)
                    if cu_seqlens_k.shape[0] > 1:  # type: ignore[union-attr]
                        document = last_document_at_or_before(cu_seqlens_k, row, num_keys)
                        key_start = clamped(cu_seqlens_k[document], num_keys)  # type: ignore[index]
                        local = row - key_start
                        present = local >= 0 and local < clamped(cu_seqlens_k[document + 1], num_keys) - key_start  # type: ignore[index]
                        source_row = doc_aligned_start[document] + local  # type: ignore[index]
                self._convert(source, target, source_row, row, column, present)
                if cutlass.const_expr(second_source is not None):
                    self._convert(second_source, second_target, source_row, row, column, present)

    @cute.jit
    def _convert(
        self, source: cute.Tensor, target: cute.Tensor, source_row: Int32, target_row: Int32,
        column: Int32, present: cutlass.Boolean,
    ):
        layout = cute.make_layout(self.vector)
        values = cute.make_rmem_tensor(layout, Float32)
        values.fill(0.0)
        if present:
            # 64-bit element offsets: the pools pass 2^31 values at about 260K tokens of M3.
            offset = cute.assume(Int64(source_row) * self.row_elements + column, divby=self.vector)
            cute.autovec_copy(cute.make_tensor(source.iterator + offset, layout), values)
        converted = cute.make_rmem_tensor(layout, target.element_type)
        converted.store(values.load().to(target.element_type))
        offset = cute.assume(Int64(target_row) * self.row_elements + column, divby=self.vector)
        cute.autovec_copy(converted, cute.make_tensor(target.iterator + offset, layout))

