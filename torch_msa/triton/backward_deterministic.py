"""`msa::backward` in Triton, deterministic: every gradient element has one owner and a fixed
summation order, so two runs on the same inputs agree bitwise. It serves the backward under
`torch.use_deterministic_algorithms(True)`; the default backward (`backward_kernel.py`) adds
with atomics instead.

Four stages (`stages.py`): delta; the Triton key pass (`backward_kernel.launch_blocks` with
`deterministic=True`: the atomic backward's KV-outer kernel without dQ, storing each item's
dK/dV in its workspace slot); the fixed-order reduction of the workspace into dK/dV; the
query-outer dQ.
"""

import torch

from . import stages
from .backward_kernel import DETERMINISTIC_BLOCKS_CONFIGS, launch_blocks


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None):
    """Same contract as `torch_msa.reference.backward`: `(dq, dk, dv)` in the inputs' dtype,
    bitwise reproducible. A given `plan` is not read: the key pass and the reduction need items of
    exactly `backward_deterministic_kernel.ITEM_TILES` tiles (the workspace is laid out by item),
    so this backward builds its own schedule of that item size (`stages.key_workspace`).

    Shapes: `grad_out`, `q`, `out` `[Tq, Hq, D]`; `k`, `v` `[Tk, Hkv, D]`; `lse`, `grad_lse`
    `[Tq, Hq]` fp32; `block_indices` int32 `[Hkv, Tq, topk]`.
    """
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
    launch_blocks(q, k, v, grad_out, lse, delta, (workspace.dk_part, workspace.dk_part, workspace.dv_part),
                  workspace.schedule, topk, block_size, softmax_scale, DETERMINISTIC_BLOCKS_CONFIGS,
                  "msa_bwd_blocks_kernel (deterministic)", shape_key, deterministic=True)
    stages.reduce_key_workspace(workspace, dk, dv, topk, block_size, shape_key)
    stages.query_dq(q, k, v, grad_out, lse, delta, dq, block_indices, documents, block_size, softmax_scale, shape_key)
    return dq, dk, dv
