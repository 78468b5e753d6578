"""Inline-PTX reductions the CuTe DSL kernels share: fp32 vector atomics and the TMA-engine bulk
reduce-add of a shared-memory range.
"""

import cutlass
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm


def _inline(operands, asm: str, constraints: str, loc, ip) -> None:
    llvm.inline_asm(
        None, [x.ir_value(loc=loc, ip=ip) for x in operands], asm, constraints,
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@cutlass.dsl_user_op
def red_add_f32x2(address: Int64, v0: Float32, v1: Float32, *, loc=None, ip=None) -> None:
    """`red.global.add.v2.f32`: one 8-byte fp32 atomic add (`address` 8-byte aligned, sm_90+)."""
    _inline((Int64(address), Float32(v0), Float32(v1)), "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f", loc, ip)


@cutlass.dsl_user_op
def red_add_f32x4(
    address: Int64, v0: Float32, v1: Float32, v2: Float32, v3: Float32, *, loc=None, ip=None
) -> None:
    """`red.global.add.v4.f32`: one 16-byte fp32 atomic add (`address` 16-byte aligned, sm_90+)."""
    _inline(
        (Int64(address), Float32(v0), Float32(v1), Float32(v2), Float32(v3)),
        "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};", "l,f,f,f,f", loc, ip,
    )


@cutlass.dsl_user_op
def bulk_reduce_add_f32(global_address: Int64, shared_address: Int32, size_bytes: Int32, *, loc=None, ip=None) -> None:
    """`cp.reduce.async.bulk .add.f32`: atomically add `size_bytes` (a multiple of 16, both addresses
    16-byte aligned) of fp32 from shared to global memory, in the thread's current bulk group.
    Other threads' shared writes need `fence_proxy("async.shared")` and a barrier first."""
    _inline(
        (Int64(global_address), Int32(shared_address), Int32(size_bytes)),
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;", "l,r,r", loc, ip,
    )
