"""The first stage of a backward: `delta = rowsum(dO * O) - grad_lse`, fp32."""

import triton
import triton.language as tl

from ..triton_utils.launch import LaunchConfig, cached_launches, launch

DELTA_CONFIGS = (LaunchConfig(num_stages=3, num_warps=4, rows=64),)


@cached_launches
@triton.jit
def msa_bwd_delta_kernel(
    grad_out, out, grad_lse, delta, num_rows,
    stride_grad_token, stride_grad_head, stride_out_token, stride_out_head,
    NUM_HEADS: tl.constexpr, DIM: tl.constexpr, ROWS: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    token = (rows // NUM_HEADS).to(tl.int64)
    head = rows % NUM_HEADS
    dims = tl.arange(0, DIM)
    d_out = tl.load(grad_out + token[:, None] * stride_grad_token + head[:, None] * stride_grad_head + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
    o = tl.load(out + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    result = tl.sum(d_out.to(tl.float32) * o.to(tl.float32), axis=1)
    if HAS_GRAD_LSE:
        result -= tl.load(grad_lse + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(delta + rows, result, mask=row_ok)


def compute_delta(grad_out, out, grad_lse, delta, shape_key) -> None:
    """The first stage of every backward but SM100's: `delta = rowsum(dO * O) - grad_lse` (fp32).

    Args:
        grad_out, out: `[Tq, Hq, D]` of one dtype, unit stride in D.
        grad_lse: `[Tq, Hq]` (read as fp32), or None for a loss that does not depend on lse.
        delta: fp32 `[Tq, Hq]`, contiguous; written.
        shape_key: the launch memo's key (`launch.launch`).
    """
    num_queries, num_heads, dim = out.shape

    def launch_delta(config):
        msa_bwd_delta_kernel[(triton.cdiv(num_queries * num_heads, config.rows),)](
            grad_out, out, grad_lse.contiguous() if grad_lse is not None else delta, delta, num_queries * num_heads,
            grad_out.stride(0), grad_out.stride(1), out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, DIM=dim, ROWS=config.rows, HAS_GRAD_LSE=grad_lse is not None,
            **config.options,
        )

    launch("msa_bwd_delta_kernel", shape_key, DELTA_CONFIGS, launch_delta)
