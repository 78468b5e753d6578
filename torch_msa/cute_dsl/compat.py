"""The CuTe DSL names that moved inside the served version range (`CUTE_DSL_REQUIREMENT`).

nvidia-cutlass-dsl 4.8 moved `LayoutEnum` to `cutlass.tensor_utils` and `SmemAllocator` to
`cutlass.memory`; their old homes in `cutlass.utils` still work there but raise a
`DeprecationWarning` on every use, and releases before 4.8 have only the old homes. The kernel
modules import both names from here, which takes the new home where it exists. Either home holds
the same enum and the same allocator (4.8's deprecated `SmemAllocator` is a subclass that only
adds the warning), so the kernels compile to the same code whichever is taken.

This module imports cutlass at the top; only kernel modules import it, and their host modules
import those only after `require_cute_dsl()`.
"""

try:
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum
except ImportError:  # nvidia-cutlass-dsl before 4.8
    from cutlass.utils import LayoutEnum, SmemAllocator

__all__ = ["LayoutEnum", "SmemAllocator"]
