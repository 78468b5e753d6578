"""The preprocess kernel in CuTe DSL: `delta = rowsum(dO * O) - grad_lse`; host side `preprocess.py`."""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

from ..cute_dsl.cute_io import ACCESS_BYTES
from .common import THREADS_PER_CTA


class DeltaKernel:
    """A group of `head_dim / vector` threads per (token, head) row: each loads one 16-byte
    vector of `out` and of `grad_out`, multiplies in fp32, and the group sums by shuffles."""

    def __init__(self, element_bits: int, head_dim: int):
        self.vector = ACCESS_BYTES * 8 // element_bits
        self.head_dim = head_dim
        self.threads_per_row = head_dim // self.vector
        if head_dim % self.vector or 32 % self.threads_per_row:
            raise ValueError(
                f"head_dim {head_dim}: expected a power-of-two multiple of {self.vector} up to {32 * self.vector}"
            )
        self.rows_per_cta = THREADS_PER_CTA // self.threads_per_row

    @cute.jit
    def __call__(
        self, out: cute.Tensor, grad_out: cute.Tensor, grad_lse: cute.Tensor | None, delta: cute.Tensor,
        stream: cuda.CUstream,
    ):
        self.kernel(out, grad_out, grad_lse, delta).launch(
            grid=[cute.ceil_div(out.shape[0], self.rows_per_cta), 1, 1], block=[THREADS_PER_CTA, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, out: cute.Tensor, grad_out: cute.Tensor, grad_lse: cute.Tensor | None, delta: cute.Tensor):
        thread, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        row = cta * self.rows_per_cta + thread // self.threads_per_row
        lane = thread % self.threads_per_row
        partial = Float32(0.0)
        if row < out.shape[0]:
            # 64-bit offsets: Tq * Hq * D passes 2^31 at about 260K tokens of M3.
            offset = cute.assume(Int64(row) * self.head_dim + lane * self.vector, divby=self.vector)
            layout = cute.make_layout(self.vector)
            out_vector = cute.make_rmem_tensor(layout, out.element_type)
            grad_vector = cute.make_rmem_tensor(layout, grad_out.element_type)
            cute.autovec_copy(cute.make_tensor(out.iterator + offset, layout), out_vector)
            cute.autovec_copy(cute.make_tensor(grad_out.iterator + offset, layout), grad_vector)
            products = out_vector.load().to(Float32) * grad_vector.load().to(Float32)
            partial = products.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        # Every lane takes part in the shuffles, rows past the end with a zero.
        total = cute.arch.warp_reduction_sum(partial, threads_in_group=self.threads_per_row)
        if row < out.shape[0] and lane == 0:
            if cutlass.const_expr(grad_lse is not None):  # a trace-time branch, which mypy does not narrow through
                total = total - grad_lse[row]  # type: ignore[index]
            delta[row] = total

