"""Backward postprocess of the SM100 pipeline: fp32 gradient pools to the output dtype (CuTe DSL).

The main kernel accumulates with fp32 atomics into `dq_accum [Tq, Hq, D]` and, in the 128-aligned
workspace, `dk_accum` / `dv_accum [W, Hkv, D]`. This casts dq row for row and gathers dk / dv
back to the packed key rows (the inverse of `task_tables.align_kv`): packed key `j` of document
`d` comes from workspace row `doc_aligned_start[d] + j`, and a key no document covers gets zero.
Architecture-neutral; the CuTe DSL is imported only inside functions.
"""

import functools

import torch

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
from .task_tables import THREADS_PER_CTA, TaskTables, check_tables_match, document_lookup

OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VECTORS_PER_THREAD = 4  # rows of a CTA are sized so each thread moves about this many vectors


def finish_gradients(
    dq_accum: torch.Tensor,
    dk_accum: torch.Tensor,
    dv_accum: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    tables: TaskTables,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast the fp32 pools to `dtype` and move dk / dv from the workspace to the packed rows.

    Args:
        dq_accum: fp32 `[Tq, Hq, D]`.
        dk_accum, dv_accum: fp32 `[W, Hkv, D]`, `W = tables.workspace_rows`.
        cu_seqlens_k: int32 `[B + 1]`, the documents `tables` was built for.
        tables: from `task_tables.build_tasks`.
        dtype: output dtype (bf16 in the contract; fp16 or fp32 also served).

    Returns:
        `(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])` in `dtype`, `Tk = tables.num_keys`.
    """
    pools = (("dq_accum", dq_accum), ("dk_accum", dk_accum), ("dv_accum", dv_accum))
    for name, pool in pools:
        if not isinstance(pool, torch.Tensor) or pool.dtype != torch.float32 or pool.dim() != 3:
            raise TypeError(f"{name}: expected an fp32 tensor with 3 dims, got {getattr(pool, 'dtype', type(pool).__name__)}")
    for name, pool in pools:
        if pool.device != dq_accum.device or pool.device.type != "cuda":
            raise ValueError(f"{name}: expected one CUDA device for the three pools, got {pool.device}")
    if dk_accum.shape[0] != tables.workspace_rows or dv_accum.shape != dk_accum.shape:
        raise ValueError(
            f"dk_accum, dv_accum: expected [W={tables.workspace_rows}, Hkv, D] each, "
            f"got {tuple(dk_accum.shape)} and {tuple(dv_accum.shape)}"
        )
    if dtype not in OUTPUT_DTYPES:
        raise TypeError(f"dtype: expected one of {OUTPUT_DTYPES}, got {dtype}")
    check_index_tensor("cu_seqlens_k", cu_seqlens_k, dims=1, device=dq_accum.device)
    check_tables_match(tables, cu_seqlens_k)
    require_cute_dsl()
    num_queries, num_heads, head_dim = dq_accum.shape
    _, num_kv_heads, kv_dim = dk_accum.shape
    device = dq_accum.device
    dq = torch.empty(num_queries, num_heads, head_dim, dtype=dtype, device=device)
    dk = torch.empty(tables.num_keys, num_kv_heads, kv_dim, dtype=dtype, device=device)
    dv = torch.empty_like(dk)
    stream = cute_stream(device)
    if dq.numel():
        _compiled_finish_kernel(dtype, head_dim, False)(
            cute_rows(aligned_operand(dq_accum).view(-1, head_dim)), cute_rows(dq.view(-1, head_dim)),
            None, None, None, None, 0, stream,
        )
    if dk.numel():
        row = num_kv_heads * kv_dim
        _compiled_finish_kernel(dtype, row, True)(
            cute_rows(aligned_operand(dk_accum).view(-1, row)), cute_rows(dk.view(-1, row)),
            cute_rows(aligned_operand(dv_accum).view(-1, row)), cute_rows(dv.view(-1, row)),
            cute_rows(aligned_operand(cu_seqlens_k)), cute_rows(tables.doc_aligned_start), tables.num_keys, stream,
        )
    return dq, dk, dv


def compile_for_target(arch: str, dump_dir: str | None = None) -> dict:
    """Compile the postprocess at the contract's shapes (bf16 out, Hkv=4, D=128) for `arch`
    (`"sm_90a"`, `"sm_100a"`); no GPU is needed. Returns name -> compiled kernel."""
    return {
        "cast_dq": compile_finish_kernel(torch.bfloat16, 128, False, arch, dump_dir),
        "unalign_dk_dv": compile_finish_kernel(torch.bfloat16, 4 * 128, True, arch, dump_dir),
    }


@functools.cache
def _compiled_finish_kernel(dtype: torch.dtype, row_elements: int, unalign: bool):
    return compile_finish_kernel(dtype, row_elements, unalign)


def compile_finish_kernel(
    dtype: torch.dtype, row_elements: int, unalign: bool, arch: str | None = None, dump_dir: str | None = None
):
    """Compile the cast (`unalign=False`: row `i` to row `i`) or the un-align gather of two pools
    (`unalign=True`), for rows of `row_elements` fp32 values cast to `dtype`."""
    require_cute_dsl()
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    def pair():
        return fake_rows(torch.float32, (row_elements,)), fake_rows(dtype, (row_elements,))

    second = pair() if unalign else (None, None)
    documents = (fake_rows(torch.int32), fake_rows(torch.int32)) if unalign else (None, None)
    return cute.compile(
        _finish_kernel_type()(cutlass_dtype(dtype).width, row_elements, unalign), *pair(), *second, *documents,
        cutlass.Int32(0), make_fake_stream(), options=compile_options(arch, dump_dir),
    )


@functools.cache
def _finish_kernel_type():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    clamped, last_document_at_or_before = document_lookup()

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
                    if cutlass.const_expr(self.unalign):
                        present = cutlass.Boolean(False)
                        if cu_seqlens_k.shape[0] > 1:
                            document = last_document_at_or_before(cu_seqlens_k, row, num_keys)
                            key_start = clamped(cu_seqlens_k[document], num_keys)
                            local = row - key_start
                            present = local >= 0 and local < clamped(cu_seqlens_k[document + 1], num_keys) - key_start
                            source_row = doc_aligned_start[document] + local
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

    return FinishKernel
