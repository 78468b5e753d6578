"""The last stage of a backward whose dQ accumulator groups its dims: dQ in natural order, from fp32
sums or from fixed-point ones (`fixed_point_dq.py`)."""

import torch
import triton
import triton.language as tl

from ..triton_utils.launch import LaunchConfig, cached_launches, launch
from .fixed_point_dq import MAX_EXPONENT

UNGROUP_CONFIGS = (LaunchConfig(num_stages=1, num_warps=4),)


@cached_launches
@triton.jit
def msa_bwd_ungroup_dq_kernel(dq_acc, dq, row_scale, row_redo, softmax_scale, redo_below, clamp_scale,
                              HEADS: tl.constexpr, GROUPS: tl.constexpr, WIDTH: tl.constexpr,
                              FIXED_POINT: tl.constexpr):
    # dq[head, group * WIDTH + w] = dq_acc[group, head, w] within a block of HEADS heads.
    block = tl.program_id(0).to(tl.int64)
    base = block * (HEADS * GROUPS * WIDTH)
    head = tl.arange(0, HEADS)[:, None, None]
    group = tl.arange(0, GROUPS)[None, :, None]
    width = tl.arange(0, WIDTH)[None, None, :]
    values = tl.load(dq_acc + base + (group * HEADS + head) * WIDTH + width)
    if FIXED_POINT:
        rows = block * HEADS + tl.arange(0, HEADS)
        scale = tl.load(row_scale + rows)
        # Sums stay within 2**30 + topk / 2 in magnitude: abs cannot overflow. A refused row (NaN
        # scale; NaN != NaN) stays refused. A row at the clamp had a bound below 2**-100 (zero for
        # a zero dO): its rounding, at most topk / 2 * 2**-126 in all, is a few of fp32's
        # smallest normals.
        largest = tl.max(tl.max(tl.abs(values), axis=2), axis=1)
        tl.store(row_redo + rows, ((largest < redo_below) & (scale < clamp_scale)).to(tl.int8))
        # A power of two: the division is exact. A marked row's NaN scale makes the row NaN.
        values = tl.div_rn(values.to(tl.float32), scale[:, None, None]) * softmax_scale
    tl.store(dq + base + (head * GROUPS + group) * WIDTH + width, values.to(dq.dtype.element_ty))


def ungroup_dq(dq_acc: torch.Tensor, dq: torch.Tensor, block_heads: int, width: int, shape_key,
               row_scale: torch.Tensor | None = None, softmax_scale: float = 1.0,
               row_redo: torch.Tensor | None = None, redo_below: int = 0) -> None:
    """Write `dq` from `dq_acc`, whose blocks of `block_heads` consecutive heads of a token are laid
    out `[D / width, block_heads, width]`.

    Args:
        dq_acc: `[Tq, Hq, D]`, contiguous, `Hq` a multiple of `block_heads`; read. fp32 sums, or,
            with `row_scale`, int32 fixed-point ones.
        dq: `[Tq, Hq, D]`, contiguous, any float dtype; written in natural order.
        block_heads, width: powers of two, `width` dividing `D`.
        shape_key: the launch memo's key (`launch.launch`).
        row_scale: None, or fp32 `[Tq, Hq]` contiguous, each row's fixed-point scale (a power of
            two, or NaN for a row whose sum is not to be trusted): `dq = dq_acc / row_scale *
            softmax_scale`.
        row_redo, redo_below: with `row_scale`, int8 `[Tq, Hq]` contiguous, written, and a
            positive count of units: 1 where the row's largest |sum| is below `redo_below` units
            and its scale is neither NaN nor `2**MAX_EXPONENT`, the clamp of a zero or vanishing
            bound (a row its fixed point serves too coarsely, to recompute), else 0.
    """
    num_queries, num_heads, dim = dq_acc.shape
    num_blocks = num_queries * (num_heads // block_heads)
    if num_blocks == 0:
        return
    fixed_point = row_scale is not None
    if fixed_point and row_redo is None:
        raise ValueError("row_redo: expected an int8 [Tq, Hq] tensor with row_scale, got None")
    if fixed_point and redo_below <= 0:
        raise ValueError(f"redo_below: expected a positive count of units with row_scale, got {redo_below}")

    def launch_ungroup(config):
        msa_bwd_ungroup_dq_kernel[(num_blocks,)](
            dq_acc, dq, row_scale if fixed_point else dq_acc, row_redo if fixed_point else dq_acc, softmax_scale,
            redo_below, 2.0**MAX_EXPONENT, HEADS=block_heads, GROUPS=dim // width, WIDTH=width, FIXED_POINT=fixed_point,
            **config.options,
        )

    launch("msa_bwd_ungroup_dq_kernel", (*shape_key, fixed_point), UNGROUP_CONFIGS, launch_ungroup)
