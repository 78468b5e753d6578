"""`msa::backward` on Hopper, bitwise reproducible: the stages of `torch_msa.stages.deterministic`
with the SM90 kernel's deterministic variant as the key pass.
"""

import torch

from ..cute_dsl import require_cute_dsl
from ..cute_dsl.cute_io import aligned_operand
from ..plan.kernels import bucket_key_count
from ..stages import deterministic as stages
from .backward_host import check_inputs, launch_blocks
from .common import BLOCK_SIZE


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None, teacher=None):
    """`backward_host.backward`'s contract (`teacher` and `UnsupportedInputs` included), bitwise
    reproducible. The key pass walks the step's plan in the workspace's own items
    (`torch_msa.stages.deterministic.key_workspace`)."""
    check_inputs(grad_out, q, k, v, block_size)
    require_cute_dsl()

    state = stages.deterministic_begin(grad_out, q, k, v, out, lse, block_indices, documents, block_size, grad_lse,
                                plan)
    if not state.empty:
        assert state.workspace is not None
        schedule = state.workspace.schedule
        # TMA needs 16-byte aligned rows; the shared stages do not.
        aligned = [aligned_operand(x) for x in (state.q, state.k, state.v, state.grad_out)]
        key_count = bucket_key_count(schedule.bucket_key_row, documents.cu_seqlens_k, BLOCK_SIZE)
        unused_dq = torch.empty((1, *q.shape[1:]), dtype=torch.float32, device=q.device)  # the variant adds no dQ
        launch_blocks(*aligned, state.lse, state.delta, unused_dq, state.workspace.dk_part, state.workspace.dv_part,
                      schedule, key_count, state.topk, softmax_scale, deterministic=True, teacher=teacher)
    return stages.deterministic_finish(state, documents, block_size, softmax_scale)
