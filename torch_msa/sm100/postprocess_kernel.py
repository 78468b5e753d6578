"""The postprocess kernel in CuTe DSL: fp32 gradient pools to the output dtype; host side `postprocess.py`."""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..cute_dsl.cute_io import ACCESS_BYTES
from .common import THREADS_PER_CTA
from .task_tables_kernel import clamped, last_document_at_or_before

VECTORS_PER_THREAD = 4  # rows of a CTA are sized so each thread moves about this many vectors


class FinishKernel:
    """Casts row for row (`unalign=False`: dq), or gathers two pools from workspace rows back to
    packed key rows (`unalign=True`: dk and dv); a row no document covers gets zeros. Each thread
    converts 16-byte output vectors; offsets are 64-bit."""

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
                # A trace-time branch with both tensors given, which mypy does not narrow through.
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

