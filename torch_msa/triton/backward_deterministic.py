"""`msa::backward` in Triton, deterministic: the key pass of `backward.py` without dQ, then the
fixed-order stages of `torch_msa/stages/deterministic.py` (`torch_msa/stages/README.md`).
"""

from ..stages.deterministic import deterministic_begin, deterministic_finish
from .backward import DETERMINISTIC_BLOCKS_CONFIGS, launch_blocks


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None):
    """Same contract as `torch_msa.reference.backward`: `(dq, dk, dv)` in the inputs' dtype,
    bitwise reproducible.

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
