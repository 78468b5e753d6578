"""What the SM90 forward and backward share: the configuration and its check, the schedule
operands, and the host path around their own tensors (`step_schedule`, `blocks_operands`,
`compile_blocks`, `launch`).
"""

import functools
import math
from typing import Any, NamedTuple

import torch

from ..backends import UnsupportedInputs
from ..contract import M3
from ..cute_dsl.cute_io import compile_kernel, fake_rows
from ..plan.kernels import bucket_key_count, schedule_for

HEADS_PER_KV = M3.group
HEAD_DIM = M3.head_dim
BLOCK_SIZE = M3.block_size
TOKENS_PER_TILE = 4  # one warp per token: 4 x 16 heads = the 64 rows of one wgmma
TILE_ROWS = TOKENS_PER_TILE * HEADS_PER_KV
SERVED_DTYPES = (torch.bfloat16, torch.float16)
LOG2_E = math.log2(math.e)
LN_2 = math.log(2)
# The backward's dQ layout per (token, KV head): [128 / 8 dim groups, 16 heads, 8 dims], so a
# warp's 8-byte fragment stores fill contiguous bytes without bank conflicts (README.md).
DQ_DIM_GROUP = 8


QUERY_OUTER_DEFAULT_DEVICES = ("H100",)
"""The GPUs (substrings of their names) on which the forward runs its query-outer part by default:
those where the default's rule measured within its gate (`docs/performance.md`, "The default").
On an H200 a training step's forward measured up to 4.1% slower, so there it runs only when
`TORCH_MSA_QUERY_OUTER=1` asks."""


def runs_query_outer_by_default(device: torch.device) -> bool:
    """Whether the forward on `device` runs its query-outer part without the setting asking for it
    (`QUERY_OUTER_DEFAULT_DEVICES`)."""
    return device.type == "cuda" and _measured_device(torch.cuda.current_device() if device.index is None
                                                      else device.index)


@functools.cache
def _measured_device(index: int) -> bool:
    name = torch.cuda.get_device_name(index)
    return any(model in name for model in QUERY_OUTER_DEFAULT_DEVICES)


def check_served(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int) -> None:
    """Raises `UnsupportedInputs` for dtypes or shapes outside the kernels' configuration."""
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
    """The int32 schedule tensors both kernels take after their own: the tables of
    `torch_msa.plan.schedule.Schedule` and the per-bucket key counts."""

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


SCHEDULE_OPERANDS = tuple((name, (), torch.int32) for name in ScheduleOperands._fields)


def schedule_tensors(schedule, key_count: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of `SCHEDULE_OPERANDS` by name, from `schedule` and `key_count`."""
    return {
        name: key_count if name == "bucket_key_count" else getattr(schedule, name) for name, _, _ in SCHEDULE_OPERANDS
    }


def step_schedule(block_indices: torch.Tensor, documents, num_keys: int, num_heads: int, plan=None):
    """`(schedule, key_count)` for `launch`: `plan`'s schedule or a new one
    (`torch_msa.plan.kernels.schedule_for`), and its per-bucket key counts."""
    schedule = schedule_for(block_indices, documents, num_keys, BLOCK_SIZE, num_heads, plan)
    return schedule, bucket_key_count(schedule.bucket_key_row, documents.cu_seqlens_k, BLOCK_SIZE)


def blocks_operands(num_kv_heads: int, own: tuple) -> tuple:
    """A blocks kernel's tensor operands in launch order, `(name, inner shape, dtype or None for q's)`
    each, dim 0 dynamic: q, k, v, the kernel's `own`, then `SCHEDULE_OPERANDS`. Both `compile_blocks`
    and `launch` read this one list, so they cannot disagree."""
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
    """`cute.compile` the blocks kernel instance `kernel` for `arch` (None: this GPU) on fakes of
    `operands` (q's dtype `dtype`) and stand-ins for the scalars (`own_scalars`: the kernel's own);
    `dump_dir` and `listings` as in `cute_io.compile_kernel`."""
    import cutlass

    fakes = [fake_rows(dtype if want is None else want, inner) for _, inner, want in operands]
    scalars = (cutlass.Int32(1), cutlass.Float32(1.0), *own_scalars, cutlass.Int32(1))
    return compile_kernel(kernel, *fakes, *scalars, arch=arch, dump_dir=dump_dir, listings=listings)


def launch(
    compiled, operands: tuple, tensors: dict, schedule, key_count: torch.Tensor, topk: int, softmax_scale: float,
    own_scalars: tuple, max_ctas: int,
) -> None:
    """Launch `compiled` on a persistent grid of `max_ctas` CTAs capped by the item count, passing
    `operands` in order, `topk`, `softmax_scale * log2(e)` (the kernels use exp2), `own_scalars`."""
    named = {**tensors, **schedule_tensors(schedule, key_count)}
    grid = max(1, min(schedule.item_start.numel(), max_ctas))
    compiled(*(named[name] for name, _, _ in operands), topk, softmax_scale * LOG2_E, *own_scalars, grid)
