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
from .backward_host import check_inputs, launch_blocks
from .common import BLOCK_SIZE


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None):
    """`backward_host.backward`, bitwise reproducible: same contract and `UnsupportedInputs`. A
    given `plan` is not read (the workspace is laid out by the items of the deterministic
    schedule, `torch_msa.triton.stages.key_workspace`)."""
    check_inputs(grad_out, q, k, v, block_size)
    require_cute_dsl()
    from ..cute_dsl.cute_io import aligned_operand
    from ..triton import stages

    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    topk = block_indices.shape[-1]
    device = q.device
    dk = torch.zeros(k.shape, dtype=k.dtype, device=device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=device)
    if num_queries == 0 or num_keys == 0 or topk == 0:
        return torch.zeros(q.shape, dtype=q.dtype, device=device), dk, dv
    dq = torch.empty(q.shape, dtype=q.dtype, device=device)  # `query_dq` writes every row
    q, k, v, grad_out, out = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, grad_out, out))
    lse = lse.contiguous()
    block_indices = block_indices.contiguous()
    delta = torch.empty((num_queries, num_heads), dtype=torch.float32, device=device)
    workspace = stages.key_workspace(block_indices, documents, num_keys, block_size, num_heads, dim)
    shape_key = (device, q.dtype, dim, block_size, num_heads // num_kv_heads, topk)

    stages.compute_delta(grad_out, out, grad_lse, delta, shape_key)
    # TMA reads whole 16-byte aligned rows; the Triton stages take any unit-stride rows.
    aligned = [aligned_operand(x) for x in (q, k, v, grad_out)]
    key_count = stages.bucket_key_count(workspace.schedule.bucket_key_row, documents.cu_seqlens_k, BLOCK_SIZE)
    unused_dq = torch.empty((1, *q.shape[1:]), dtype=torch.float32, device=device)  # the variant adds no dQ
    launch_blocks(*aligned, lse, delta, unused_dq, workspace.dk_part, workspace.dv_part, workspace.schedule,
                  key_count, topk, softmax_scale, deterministic=True)
    stages.reduce_key_workspace(workspace, dk, dv, topk, block_size, shape_key)
    stages.query_dq(q, k, v, grad_out, lse, delta, dq, block_indices, documents, block_size, softmax_scale, shape_key)
    return dq, dk, dv
