"""`msa::backward` in Triton, deterministic: every gradient element has one owner and a fixed
summation order, so two runs on the same inputs agree bitwise. It serves the backward under
`torch.use_deterministic_algorithms(True)`; the default backward (`backward_kernel.py`) adds
with atomics instead.

Four stages (`deterministic_stages.py`): delta; the Triton key pass (`backward_kernel.launch_blocks` with
`deterministic=True`: the atomic backward's KV-outer kernel without dQ, storing each item's
dK/dV in its workspace slot); the fixed-order reduction of the workspace into dK/dV; the
query-outer dQ.
"""

from ..stages.deterministic import deterministic_begin, deterministic_finish
from .backward import DETERMINISTIC_BLOCKS_CONFIGS, launch_blocks


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None):
    """Same contract as `torch_msa.reference.backward`: `(dq, dk, dv)` in the inputs' dtype,
    bitwise reproducible. The key pass walks the plan's entries in items of
    `torch_msa.stages.deterministic.ITEM_TILES` tiles (the workspace is laid out by item).

    Shapes: `grad_out`, `q`, `out` `[Tq, Hq, D]`; `k`, `v` `[Tk, Hkv, D]`; `lse`, `grad_lse`
    `[Tq, Hq]` fp32; `block_indices` int32 `[Hkv, Tq, topk]`.
    """
    state = deterministic_begin(grad_out, q, k, v, out, lse, block_indices, documents, block_size, grad_lse,
                                plan)
    if not state.empty:
        assert state.workspace is not None
        launch_blocks(state.q, state.k, state.v, state.grad_out, state.lse, state.delta,
                      (state.workspace.dk_part, state.workspace.dk_part, state.workspace.dv_part),
                      state.workspace.schedule, state.topk, block_size, softmax_scale, DETERMINISTIC_BLOCKS_CONFIGS,
                      "msa_bwd_blocks_kernel (deterministic)", state.shape_key, deterministic=True)
    return deterministic_finish(state, documents, block_size, softmax_scale)
