"""The SM100 backward's task tables and its 128-aligned K/V workspace, built on the device.

Tasks are the items of the shared schedule (`torch_msa.plan.schedule`, 8 entries per item); the
workspace height `W` is known from shapes alone. Design: `README.md`. The kernels are
`task_tables_kernel.py`.
"""

import functools
from typing import NamedTuple

import torch

from ..cute_dsl import require_cute_dsl
from ..cute_dsl.cute_io import aligned_operand, check_index_tensor, compile_kernel, cutlass_dtype, fake_rows, launcher
from ..documents import Documents
from ..plan.schedule import build_schedule, max_key_blocks
from .common import TOKENS_PER_TASK, WORKSPACE_ALIGNMENT, TaskOperands


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


# The inner shapes of the `TaskOperands` that are not `[N]`.
TASK_OPERAND_INNER = {"task_meta": (4,), "task_qrows": (TOKENS_PER_TASK,), "task_qpos": (TOKENS_PER_TASK,)}


def task_operands(schedule, cu_seqlens_k: torch.Tensor, tables: TaskTables) -> TaskOperands:
    """The `TaskOperands` of `build_tasks`' launch: `schedule`'s tensors, `cu_seqlens_k`, `tables`'."""
    return TaskOperands(**{
        name: cu_seqlens_k if name == "cu_seqlens_k" else getattr(schedule if name in schedule._fields else tables, name)
        for name in TaskOperands._fields
    })


def workspace_rows(num_keys: int, num_docs: int) -> int:
    """`W`: rows that hold every document's keys padded to a multiple of 128 (never 0)."""
    return WORKSPACE_ALIGNMENT * max(1, max_key_blocks(num_keys, num_docs, WORKSPACE_ALIGNMENT))


def document_key_bounds(cu_seqlens_k: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per document, `(start, length)` of its keys, int64 `[B]`, clamped into `[0, num_keys]`.

    The clamp (the kernels' too) keeps malformed boundaries from pushing an aligned row past `W`.
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
    """Build the SM100 task tables on the device, with no host synchronisation: one task per item of
    `build_schedule(..., entries_per_item=8)`, written by a CuTe DSL kernel.

    Args:
        block_indices: int32 `[Hkv, Tq, topk]` on a CUDA device.
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]` on the same device.
        num_keys: `Tk`, rows of the packed keys.
        block_size: keys per block; it must divide 128 (the contract uses 128).

    Raises:
        TypeError: an index tensor that is not int32 of the stated dims.
        ValueError: a non-CUDA or mismatched device, cu_seqlens of different lengths, a negative
            `num_keys`, or a `block_size` that does not divide 128.
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
    # Tq and Tk bound every document's length, and the schedule reads no tighter bound.
    documents = Documents(cu_seqlens_q, cu_seqlens_k, block_indices.shape[1], num_keys)
    schedule = build_schedule(block_indices, documents, num_keys, block_size, TOKENS_PER_TASK)
    aligned_starts = doc_aligned_starts(cu_seqlens_k, num_keys, rows)
    max_tasks = schedule.item_bucket.numel()
    device = block_indices.device
    tables = TaskTables(
        task_meta=torch.empty(max_tasks, 4, dtype=torch.int32, device=device),
        task_qrows=torch.empty(max_tasks, TOKENS_PER_TASK, dtype=torch.int32, device=device),
        task_qpos=torch.empty(max_tasks, TOKENS_PER_TASK, dtype=torch.int32, device=device),
        bucket_task_ptr=torch.empty(schedule.bucket_head.numel() + 1, dtype=torch.int32, device=device),
        num_tasks=schedule.num_items,
        workspace_rows=rows,
        doc_aligned_start=aligned_starts,
        num_keys=num_keys,
    )
    _compiled_task_kernel()(
        *task_operands(schedule, aligned_operand(cu_seqlens_k), tables), block_indices.shape[-1], num_keys
    )
    return tables


def align_kv(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor, tables: TaskTables
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy packed K/V into the aligned workspace with a CuTe DSL kernel.

    Args:
        k, v: `[Tk, Hkv, D]` on a CUDA device, one dtype of 2 or 4 bytes (bf16 in the contract).
        cu_seqlens_k: int32 `[B + 1]`.
        tables: from `build_tasks` on the same documents.

    Returns:
        `(k_ws, v_ws)`, `[W, Hkv, D]` in k's dtype: document `d`'s key `j` at row
        `doc_aligned_start[d] + j`; every other row is zero.

    Raises:
        ValueError, TypeError: k and v of different shapes, dtypes or devices, or `tables` built
            for another number of documents.
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
        *(x.view(x.shape[0], row) for x in (aligned_operand(k), aligned_operand(v), k_ws, v_ws)),
        aligned_operand(cu_seqlens_k), tables.doc_aligned_start, num_keys,
    )
    return k_ws, v_ws


def check_tables_match(tables: TaskTables, cu_seqlens_k: torch.Tensor) -> None:
    """Refuse tables built for another number of documents than `cu_seqlens_k` describes."""
    if tables.doc_aligned_start.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"tables: built for {tables.doc_aligned_start.numel() - 1} documents, "
            f"cu_seqlens_k has {cu_seqlens_k.numel() - 1}"
        )


def compile_for_target(arch: str, dump_dir: str | None = None) -> dict:
    """Compile the task and align kernels at the contract's shapes for `arch` (`"sm_90a"`,
    `"sm_100a"`); no GPU is needed. Returns name -> compiled kernel."""
    return {
        "task_tables": compile_task_kernel(arch, dump_dir),
        "align_kv": compile_align_kernel(torch.bfloat16, 4 * 128, arch, dump_dir),
    }


@functools.cache
def _compiled_task_kernel():
    return launcher(compile_task_kernel())


@functools.cache
def _compiled_align_kernel(dtype: torch.dtype, row_elements: int):
    return launcher(compile_align_kernel(dtype, row_elements))


def compile_task_kernel(arch: str | None = None, dump_dir: str | None = None):
    """Compile the task-table kernel (`arch=None`: this host's GPU)."""
    require_cute_dsl()
    import cutlass

    from .task_tables_kernel import TaskKernel

    fakes = [fake_rows(torch.int32, TASK_OPERAND_INNER.get(name, ())) for name in TaskOperands._fields]
    return compile_kernel(TaskKernel(), *fakes, cutlass.Int32(1), cutlass.Int32(1), arch=arch, dump_dir=dump_dir)


def compile_align_kernel(dtype: torch.dtype, row_elements: int, arch: str | None = None, dump_dir: str | None = None):
    """Compile the K/V alignment kernel for rows of `row_elements` (= Hkv * D) values of `dtype`."""
    require_cute_dsl()
    import cutlass

    from .task_tables_kernel import AlignKernel

    rows = [fake_rows(dtype, (row_elements,)) for _ in range(4)]
    return compile_kernel(
        AlignKernel(cutlass_dtype(dtype).width, row_elements), *rows, fake_rows(torch.int32), fake_rows(torch.int32),
        cutlass.Int32(1), arch=arch, dump_dir=dump_dir,
    )
