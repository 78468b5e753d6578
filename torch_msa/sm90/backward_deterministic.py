"""`msa::backward` on Hopper (sm_90a), bitwise reproducible: it serves the SM90 backend under
`torch.use_deterministic_algorithms(True)`, where the SM90 backward kernel (`backward_kernel.py`)
would add with atomics.

Four stages, those of the Triton deterministic backward with the SM90 key pass in place of the
Triton one (`torch_msa.triton.stages`): delta; the SM90 blocks kernel compiled without dQ
(`backward_host.launch_blocks(deterministic=True)`), which stores each schedule item's dK/dV in
the item's own workspace rows; the fixed-order reduction of the workspace into dK/dV; the
query-outer dQ. Every gradient element has one owner and a fixed summation order.

The CuTe DSL and triton are imported only inside the function, so this module imports on hosts
without them.
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
    """`backward_host.backward`, bitwise reproducible: same contract (the KL `teacher` included)
    and `UnsupportedInputs`. The key pass walks the plan's entries in the items of the
    deterministic workspace (`torch_msa.stages.deterministic.key_workspace`)."""
    check_inputs(grad_out, q, k, v, block_size)
    require_cute_dsl()

    state = stages.deterministic_begin(grad_out, q, k, v, out, lse, block_indices, documents, block_size, grad_lse,
                                plan)
    if not state.empty:
        assert state.workspace is not None
        schedule = state.workspace.schedule
        # TMA reads whole 16-byte aligned rows; the Triton stages take any unit-stride rows.
        aligned = [aligned_operand(x) for x in (state.q, state.k, state.v, state.grad_out)]
        key_count = bucket_key_count(schedule.bucket_key_row, documents.cu_seqlens_k, BLOCK_SIZE)
        unused_dq = torch.empty((1, *q.shape[1:]), dtype=torch.float32, device=q.device)  # the variant adds no dQ
        launch_blocks(*aligned, state.lse, state.delta, unused_dq, state.workspace.dk_part, state.workspace.dv_part,
                      schedule, key_count, state.topk, softmax_scale, deterministic=True, teacher=teacher)
    return stages.deterministic_finish(state, documents, block_size, softmax_scale)
