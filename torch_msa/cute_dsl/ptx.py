"""Inline PTX the CuTe DSL kernels share: fp32 vector atomics, the TMA-engine bulk reduce-add of a
shared-memory range (fp32 or 32-bit integers) and fp32 rounded to a 32-bit integer.
"""

import cutlass
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm


def _inline(operands, asm: str, constraints: str, loc, ip, result=None, side_effects: bool = True):
    return llvm.inline_asm(
        result, [x.ir_value(loc=loc, ip=ip) for x in operands], asm, constraints,
        has_side_effects=side_effects, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
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
    _bulk_reduce_add("f32", global_address, shared_address, size_bytes, loc, ip)


@cutlass.dsl_user_op
def bulk_reduce_add_u32(global_address: Int64, shared_address: Int32, size_bytes: Int32, *, loc=None, ip=None) -> None:
    """`bulk_reduce_add_f32` for 32-bit integers: the sums wrap modulo 2**32, so signed (two's
    complement) values add exactly as long as no sum leaves int32's range."""
    _bulk_reduce_add("u32", global_address, shared_address, size_bytes, loc, ip)


def _bulk_reduce_add(element: str, global_address, shared_address, size_bytes, loc, ip) -> None:
    _inline(
        (Int64(global_address), Int32(shared_address), Int32(size_bytes)),
        f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.{element} [$0], [$1], $2;", "l,r,r", loc, ip,
    )


@cutlass.dsl_user_op
def round_to_int32(value: Float32, *, loc=None, ip=None) -> Int32:
    """`cvt.rni.s32.f32`: `value` rounded to the nearest integer (ties to even); the caller keeps it
    inside int32's range (out of range saturates, NaN gives 0)."""
    return Int32(_inline((Float32(value),), "cvt.rni.s32.f32 $0, $1;", "=r,f", loc, ip, Int32.mlir_type, False))
