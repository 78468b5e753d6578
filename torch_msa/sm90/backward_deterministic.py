"""`msa::backward` on Hopper, bitwise reproducible: the SM90 kernel's deterministic variant adds dQ
in fixed point (`torch_msa.stages.fixed_point_dq`) and stores dK/dV per item, which
`torch_msa.stages.deterministic` reduces in item order; the rows the fixed point serves too
coarsely are recomputed by its query-outer dQ kernel.
"""

import torch

from ..cute_dsl import require_cute_dsl
from ..cute_dsl.cute_io import aligned_operand
from ..plan.kernels import bucket_key_count
from ..stages import deterministic as stages
from ..stages.dq import ungroup_dq
from ..stages.fixed_point_dq import dq_scales, recompute_below
from ..uninitialized import uninitialized
from .backward_host import check_inputs, launch_blocks
from .common import BLOCK_SIZE, DQ_DIM_GROUP, HEADS_PER_KV


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None, teacher=None):
    """`backward_host.backward`'s contract (`teacher` and `UnsupportedInputs` included), bitwise
    reproducible. The kernel walks the step's plan in the workspace's own items
    (`torch_msa.stages.deterministic.key_workspace`). A row whose dQ shares are not finite, or whose
    bound no fixed-point scale serves (`torch_msa.stages.fixed_point_dq.dq_scales`), is NaN; a row
    whose fixed-point sums are too small for their rounding (`fixed_point_dq.recompute_below`) is
    recomputed query-outer in fp32."""
    check_inputs(grad_out, q, k, v, block_size)
    require_cute_dsl()

    state = stages.deterministic_begin(grad_out, q, k, v, out, lse, block_indices, documents, block_size, grad_lse,
                                       plan)
    if state.empty:
        return state.dq, state.dk, state.dv
    assert state.workspace is not None
    schedule = state.workspace.schedule
    # TMA needs 16-byte aligned rows; the shared stages do not.
    aligned = [aligned_operand(x) for x in (state.q, state.k, state.v, state.grad_out)]
    key_count = bucket_key_count(schedule.bucket_key_row, documents.cu_seqlens_k, BLOCK_SIZE)
    dq_scale = dq_scales(state.grad_out, state.delta, state.k, state.v, state.block_indices, documents, block_size,
                         state.shape_key)
    dq_acc = torch.zeros(q.shape, dtype=torch.int32, device=q.device)
    launch_blocks(*aligned, state.lse, state.delta, dq_acc, state.workspace.dk_part, state.workspace.dv_part,
                  schedule, key_count, state.topk, softmax_scale, teacher=teacher, dq_scale=dq_scale)
    stages.reduce_key_workspace(state.workspace, state.dk, state.dv, state.topk, block_size, state.shape_key)
    row_redo = uninitialized(dq_scale.shape, dtype=torch.int8, device=q.device)
    ungroup_dq(dq_acc, state.dq, HEADS_PER_KV, DQ_DIM_GROUP, state.shape_key, dq_scale, softmax_scale, row_redo,
               recompute_below(state.topk))
    stages.query_dq(state.q, state.k, state.v, state.grad_out, state.lse, state.delta, state.dq, state.block_indices,
                    documents, block_size, softmax_scale, state.shape_key, row_redo)
    return state.dq, state.dk, state.dv
