"""The base of the SM90 blocks kernels (`forward_kernel.py`, `backward_kernel.py`).

Both are KV-outer kernels over the step's plan for `num_kv_heads` KV heads of 16 query heads each,
with fp32 accumulators, and their `cute.jit` host functions take the same argument list after
their own tensors: the schedule's tensors in `ScheduleOperands` order, then their scalars, the
stream last (the order `forward_host.operands` / `backward_host.operands` launch them in).

Device code: this module imports cutlass at the top, and only the kernel modules import it.
"""

from cutlass import Float32

from .common import HEADS_PER_KV, ScheduleOperands


class BlocksKernel:
    """A blocks kernel for `num_kv_heads` KV heads (`num_heads` query heads), fp32 accumulators."""

    acc_dtype = Float32

    def __init__(self, num_kv_heads: int):
        self.num_kv_heads = num_kv_heads
        self.num_heads = HEADS_PER_KV * num_kv_heads

    @staticmethod
    def split_schedule(arguments: tuple) -> tuple[ScheduleOperands, tuple]:
        """The host function's arguments after its own tensors as (the schedule, the rest)."""
        count = len(ScheduleOperands._fields)
        return ScheduleOperands(*arguments[:count]), tuple(arguments[count:])
