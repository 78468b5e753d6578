"""What the SM90 forward and backward share on the host side and as compile-time constants.

The one configuration both kernels are built for (16 query heads per KV head, D = 128, key
blocks of 128, bf16 or fp16), their 64-row tile of 4 tokens x 16 heads, the check that refuses
other inputs, and the schedule operands both kernels take after their own: the plan's tables and
the per-bucket key counts (`bucket_key_count`). The host path both follow around their own
tensors: the step's schedule (`step_schedule`), the operand table (`blocks_operands`), the
compile (`compile_blocks`) and the launch on a persistent grid (`launch`).

Both host modules (`forward_host.py`, `backward_host.py`) and both kernel modules
(`forward_kernel.py`, `backward_kernel.py`, and their shared device modules) read their
constants from here, so no module imports another kernel module for them. This module imports
only torch: the CuTe DSL and the Triton stages are imported inside the functions that use them.
"""

import math
from typing import Any, NamedTuple

import torch

from ..backends import UnsupportedInputs
from ..contract import M3
from ..plan.kernels import bucket_key_count, schedule_for

HEADS_PER_KV = M3.group
HEAD_DIM = M3.head_dim
BLOCK_SIZE = M3.block_size
TOKENS_PER_TILE = 4  # one warp per token: 4 x 16 heads = the 64 rows of one wgmma
TILE_ROWS = TOKENS_PER_TILE * HEADS_PER_KV
SERVED_DTYPES = (torch.bfloat16, torch.float16)
LOG2_E = math.log2(math.e)
# The backward's dQ order: each (token, KV head) block of 16 heads x 128 dims, in its shared-memory
# dQ tile and its fp32 dQ accumulator, is laid out [128 / 8 dim groups, 16 heads, 8 dims]. A
# warp's wgmma accumulator fragment holds 8 rows x 8 dims per register pair, so each 8-byte store
# of a warp fills 256 contiguous bytes, free of bank conflicts; the host's cast ungroups.
DQ_DIM_GROUP = 8


def check_served(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int) -> None:
    """Raise `UnsupportedInputs` for inputs outside the kernel's configuration; nothing launched."""
    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) != 1 or q.dtype not in SERVED_DTYPES:
        raise UnsupportedInputs(
            f"the SM90 kernels take q, k, v all bf16 or all fp16; got {', '.join(sorted(map(str, dtypes)))}"
        )
    num_heads, num_kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if num_kv_heads == 0 or num_heads != HEADS_PER_KV * num_kv_heads or dim != HEAD_DIM or block_size != BLOCK_SIZE:
        raise UnsupportedInputs(
            f"the SM90 kernels serve {HEADS_PER_KV} query heads per KV head, D={HEAD_DIM}, block_size={BLOCK_SIZE}; "
            f"got Hq={num_heads}, Hkv={num_kv_heads}, D={dim}, block_size={block_size}"
        )


class ScheduleOperands(NamedTuple):
    """The schedule's tensors both SM90 kernels read, int32 each, in launch order after their own
    operands: the plan's tables (`torch_msa.plan.schedule.Schedule`) and the per-bucket key counts. The
    host launches them as torch tensors; the kernels receive them as CuTe tensors and walk them
    through `tile_scheduler.ItemScheduler`."""

    entry_query: Any
    item_bucket: Any
    item_start: Any
    item_end: Any
    bucket_head: Any
    bucket_key_row: Any
    bucket_block: Any
    bucket_key_count: Any
    position: Any
    num_items: Any


# (name, inner shape, dtype) of each, as the host modules describe their operands.
SCHEDULE_OPERANDS = tuple((name, (), torch.int32) for name in ScheduleOperands._fields)


def schedule_tensors(schedule, key_count: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of `SCHEDULE_OPERANDS` by name: `schedule`'s (`torch_msa.plan.schedule.Schedule`) and
    the per-bucket key counts (`bucket_key_count`)."""
    return {
        name: key_count if name == "bucket_key_count" else getattr(schedule, name) for name, _, _ in SCHEDULE_OPERANDS
    }


def step_schedule(block_indices: torch.Tensor, documents, num_keys: int, num_heads: int, plan=None):
    """`(schedule, key_count)` for `launch`: `plan`'s schedule, or without one a new schedule with
    the public API's item size (`torch_msa.plan.schedule.schedule_for`), and its per-bucket key counts."""

    schedule = schedule_for(block_indices, documents, num_keys, BLOCK_SIZE, num_heads, plan)
    return schedule, bucket_key_count(schedule.bucket_key_row, documents.cu_seqlens_k, BLOCK_SIZE)


def blocks_operands(num_kv_heads: int, own: tuple) -> tuple:
    """A blocks kernel's tensor operands in launch order, `(name, inner shape, dtype or None for q's
    dtype)` each, dim 0 dynamic: q `[Tq, Hq, 128]`, k and v `[Tk, Hkv, 128]`, the kernel's `own`, then
    `SCHEDULE_OPERANDS` (the order `blocks_kernel.BlocksKernel`'s host functions take them in).
    `compile_blocks` describes each with `fake_rows` and `launch` passes the tensors in this order, so
    the two cannot disagree (and the compiled function checks every tensor against its description
    when it is called)."""
    return (
        ("q", (HEADS_PER_KV * num_kv_heads, HEAD_DIM), None),
        ("k", (num_kv_heads, HEAD_DIM), None),
        ("v", (num_kv_heads, HEAD_DIM), None),
        *own,
        *SCHEDULE_OPERANDS,
    )


def compile_blocks(
    kernel, operands: tuple, dtype: torch.dtype, own_scalars: tuple, arch: str | None, dump_dir: str | None,
    listings: bool,
):
    """`cute.compile` the blocks kernel `kernel` (an instance; its host function) for `arch` (None:
    this host's GPU) on fake tensors of `operands` (`blocks_operands`, q's dtype `dtype`) with dynamic
    leading extents and on stand-ins for the scalars `launch` passes (`own_scalars`: CuTe DSL scalars
    for the kernel's own). `dump_dir` keeps the cubin there, and with `listings` the PTX and SASS
    too (`cute_io.compile_kernel`)."""
    import cutlass

    from ..cute_dsl.cute_io import compile_kernel, fake_rows

    fakes = [fake_rows(dtype if want is None else want, inner) for _, inner, want in operands]
    scalars = (cutlass.Int32(1), cutlass.Float32(1.0), *own_scalars, cutlass.Int32(1))
    return compile_kernel(kernel, *fakes, *scalars, arch=arch, dump_dir=dump_dir, listings=listings)


def launch(
    compiled, operands: tuple, tensors: dict, schedule, key_count: torch.Tensor, topk: int, softmax_scale: float,
    own_scalars: tuple, max_ctas: int,
) -> None:
    """Launch `compiled` (the launcher of a blocks kernel compiled by `compile_blocks` for `operands`)
    on a persistent grid of `max_ctas` CTAs, capped by the schedule's item count (at least one). It
    passes the tensors of `operands` in order (`tensors` by name, then `schedule_tensors(schedule,
    key_count)`), then the scalars: `topk`, `softmax_scale * log2(e)` (the kernels exponentiate
    base 2), the kernel's `own_scalars`, the grid size."""
    named = {**tensors, **schedule_tensors(schedule, key_count)}
    grid = max(1, min(schedule.item_start.numel(), max_ctas))
    compiled(*(named[name] for name, _, _ in operands), topk, softmax_scale * LOG2_E, *own_scalars, grid)
