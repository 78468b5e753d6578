"""Inline-PTX reductions the CuTe DSL kernels of torch_msa share (the SM90 backward, the SM100
backward): fp32 vector atomics and the bulk (TMA-engine) reduce-add of a shared-memory range.

This module imports cutlass at the top; only kernel modules import it, and their host modules
import those only after `require_cute_dsl()`.
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
    """`cp.reduce.async.bulk .add.f32`: the TMA engine adds `size_bytes` (a multiple of 16, both
    addresses 16-byte aligned) of fp32 from shared to global memory, element-wise atomically.

    It joins the thread's current bulk group: `cute.arch.cp_async_bulk_commit_group()` closes the
    group and `cute.arch.cp_async_bulk_wait_group(0, read=True)` waits until the source may be
    overwritten. Shared-memory writes of other threads must be fenced with
    `fence_proxy("async.shared", space="cta")` and a barrier before it is issued.
    """
    _inline(
        (Int64(global_address), Int32(shared_address), Int32(size_bytes)),
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;", "l,r,r", loc, ip,
    )
