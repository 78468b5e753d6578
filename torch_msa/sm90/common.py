"""What the SM90 forward and backward share on the host side and as compile-time constants.

The one configuration both kernels are built for (16 query heads per KV head, D = 128, key
blocks of 128, bf16 or fp16), their 64-row tile of 4 tokens x 16 heads, the check that refuses
other inputs, and the schedule operands both kernels take after their own: the plan's tables and
the per-bucket key counts (`bucket_key_count`).

Both host modules (`forward_host.py`, `backward_host.py`) and both kernel modules
(`forward_kernel.py`, `backward_kernel.py`, and their shared device modules) read their
constants from here, so no module imports another kernel module for them. This module imports
only torch.
"""

import math
from typing import Any, NamedTuple

import torch

from ..backends import UnsupportedInputs
from ..contract import M3

HEADS_PER_KV = M3.group
HEAD_DIM = M3.head_dim
BLOCK_SIZE = M3.block_size
TOKENS_PER_TILE = 4  # one warp per token: 4 x 16 heads = the 64 rows of one wgmma
TILE_ROWS = TOKENS_PER_TILE * HEADS_PER_KV
SERVED_DTYPES = (torch.bfloat16, torch.float16)
LOG2_E = math.log2(math.e)


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
    operands: the plan's tables (`torch_msa.schedule.Schedule`) and the per-bucket key counts. The
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
    """The tensors of `SCHEDULE_OPERANDS` by name: `schedule`'s (`torch_msa.schedule.Schedule`) and
    the per-bucket key counts (`bucket_key_count`)."""
    return {
        name: key_count if name == "bucket_key_count" else getattr(schedule, name) for name, _, _ in SCHEDULE_OPERANDS
    }
