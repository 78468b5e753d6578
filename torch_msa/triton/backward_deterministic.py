"""`msa::backward` in Triton, deterministic: every gradient element has one owner and a fixed
summation order, so two runs on the same inputs agree bitwise. It serves the backward under
`torch.use_deterministic_algorithms(True)`; the default backward (`backward_kernel.py`) adds
with atomics instead.

Four stages (`deterministic_stages.py`): delta; the Triton key pass (`backward_kernel.launch_blocks` with
`deterministic=True`: the atomic backward's KV-outer kernel without dQ, storing each item's
dK/dV in its workspace slot); the fixed-order reduction of the workspace into dK/dV; the
query-outer dQ.
"""

from . import deterministic_stages
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
    state = deterministic_stages.begin(grad_out, q, k, v, out, lse, block_indices, documents, block_size, grad_lse)
    if not state.empty:
        assert state.workspace is not None
        launch_blocks(state.q, state.k, state.v, state.grad_out, state.lse, state.delta,
                      (state.workspace.dk_part, state.workspace.dk_part, state.workspace.dv_part),
                      state.workspace.schedule, state.topk, block_size, softmax_scale, DETERMINISTIC_BLOCKS_CONFIGS,
                      "msa_bwd_blocks_kernel (deterministic)", state.shape_key, deterministic=True)
    return deterministic_stages.finish(state, documents, block_size, softmax_scale)
