"""The last stage of a backward whose dQ accumulator groups its dims: dQ in natural order."""

import torch
import triton
import triton.language as tl

from ..triton_utils.launch import LaunchConfig, cached_launches, launch

UNGROUP_CONFIGS = (LaunchConfig(num_stages=1, num_warps=4),)


@cached_launches
@triton.jit
def msa_bwd_ungroup_dq_kernel(dq_acc, dq, HEADS: tl.constexpr, GROUPS: tl.constexpr, WIDTH: tl.constexpr):
    # dq[head, group * WIDTH + w] = dq_acc[group, head, w] within a block of HEADS heads.
    base = tl.program_id(0).to(tl.int64) * (HEADS * GROUPS * WIDTH)
    head = tl.arange(0, HEADS)[:, None, None]
    group = tl.arange(0, GROUPS)[None, :, None]
    width = tl.arange(0, WIDTH)[None, None, :]
    values = tl.load(dq_acc + base + (group * HEADS + head) * WIDTH + width)
    tl.store(dq + base + (head * GROUPS + group) * WIDTH + width, values.to(dq.dtype.element_ty))


def ungroup_dq(dq_acc: torch.Tensor, dq: torch.Tensor, block_heads: int, width: int, shape_key) -> None:
    """Write `dq` from the fp32 `dq_acc`, whose blocks of `block_heads` consecutive heads of a token
    are laid out `[D / width, block_heads, width]`.

    Args:
        dq_acc: fp32 `[Tq, Hq, D]`, contiguous, `Hq` a multiple of `block_heads`; read.
        dq: `[Tq, Hq, D]`, contiguous, any float dtype; written in natural order.
        block_heads, width: powers of two, `width` dividing `D`.
        shape_key: the launch memo's key (`launch.launch`).
    """
    num_queries, num_heads, dim = dq_acc.shape
    num_blocks = num_queries * (num_heads // block_heads)
    if num_blocks == 0:
        return

    def launch_ungroup(config):
        msa_bwd_ungroup_dq_kernel[(num_blocks,)](dq_acc, dq, HEADS=block_heads, GROUPS=dim // width, WIDTH=width,
                                                 **config.options)

    launch("msa_bwd_ungroup_dq_kernel", shape_key, UNGROUP_CONFIGS, launch_ungroup)
