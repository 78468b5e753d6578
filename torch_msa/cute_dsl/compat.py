"""The CuTe DSL names that moved inside the served range: 4.8 moved `LayoutEnum` to
`cutlass.tensor_utils` and `SmemAllocator` to `cutlass.memory` (the old homes warn); both homes
hold the same objects, so the generated code does not depend on which is taken.
"""

try:
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum
except ImportError:  # nvidia-cutlass-dsl before 4.8
    from cutlass.utils import LayoutEnum, SmemAllocator

__all__ = ["LayoutEnum", "SmemAllocator"]
