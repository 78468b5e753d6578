"""Backward postprocess: the fp32 gradient pools to the output dtype by a CuTe DSL kernel (`postprocess_kernel.py`).

dq is cast row for row; dk / dv are gathered from the 128-aligned workspace back to the packed
key rows (the inverse of `task_tables.align_kv`).
"""

import functools

import torch

from ..cute_dsl import require_cute_dsl
from ..cute_dsl.cute_io import aligned_operand, check_index_tensor, compile_kernel, cutlass_dtype, fake_rows, launcher
from .task_tables import TaskTables, check_tables_match

OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
        `(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, D])` in `dtype`, `Tk = tables.num_keys`; a key
        no document covers gets zero.

    Raises:
        TypeError: a pool not fp32 with 3 dims, `cu_seqlens_k` not int32, `dtype` not in `OUTPUT_DTYPES`.
        ValueError: pools on different or non-CUDA devices, a workspace height other than
            `tables.workspace_rows`, or `tables` built for another number of documents.
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
    if dq.numel():
        _compiled_finish_kernel(dtype, head_dim, False)(
            aligned_operand(dq_accum).view(-1, head_dim), dq.view(-1, head_dim), None, None, None, None, 0,
        )
    if dk.numel():
        row = num_kv_heads * kv_dim
        _compiled_finish_kernel(dtype, row, True)(
            aligned_operand(dk_accum).view(-1, row), dk.view(-1, row),
            aligned_operand(dv_accum).view(-1, row), dv.view(-1, row),
            aligned_operand(cu_seqlens_k), tables.doc_aligned_start, tables.num_keys,
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
    return launcher(compile_finish_kernel(dtype, row_elements, unalign))


def compile_finish_kernel(
    dtype: torch.dtype, row_elements: int, unalign: bool, arch: str | None = None, dump_dir: str | None = None
):
    """Compile the cast (`unalign=False`: row `i` to row `i`) or the un-align gather of two pools
    (`unalign=True`), for rows of `row_elements` fp32 values cast to `dtype`."""
    require_cute_dsl()
    import cutlass

    from .postprocess_kernel import FinishKernel

    def pair():
        return fake_rows(torch.float32, (row_elements,)), fake_rows(dtype, (row_elements,))

    second = pair() if unalign else (None, None)
    documents = (fake_rows(torch.int32), fake_rows(torch.int32)) if unalign else (None, None)
    return compile_kernel(
        FinishKernel(cutlass_dtype(dtype).width, row_elements, unalign), *pair(), *second, *documents,
        cutlass.Int32(0), arch=arch, dump_dir=dump_dir,
    )
