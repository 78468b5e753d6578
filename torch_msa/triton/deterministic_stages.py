"""The stages of a deterministic backward around a backend's own key pass.

`begin` allocates the gradients, makes the operands unit-stride, computes `delta` and lays out the
key workspace (`backward_deterministic_kernel.key_workspace`: a schedule of fixed-size items and
one dK/dV slot per item); the backend's key pass then stores each item's dK/dV into
`workspace.dk_part` / `workspace.dv_part`; `finish` sums the slots of every key in item order and
computes dQ query-outer. Every gradient element has one owner and a fixed summation order, so two
runs on the same inputs agree bitwise.
"""

from typing import NamedTuple

import torch

from .backward_deterministic_kernel import KeyWorkspace, key_workspace, query_dq, reduce_key_workspace
from .backward_kernel import compute_delta


class DeterministicBackward(NamedTuple):
    """A deterministic backward between `begin` and `finish`.

    `q, k, v, grad_out` unit-stride in D, `lse` contiguous, `delta` fp32 `[Tq, Hq]` computed;
    `dq, dk, dv` the gradients in the inputs' dtype (`dk`, `dv` zeroed, `dq` written by `finish`);
    `empty`: nothing to attend (no query, key or slot), the gradients are the zeros they hold and
    neither the key pass nor `finish` has anything to do (`workspace` is None then). `shape_key`:
    the Triton launch memo's key (`launch.launch`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    block_indices: torch.Tensor
    workspace: KeyWorkspace | None
    topk: int
    shape_key: tuple
    empty: bool


def begin(grad_out, q, k, v, out, lse, block_indices, documents, block_size, grad_lse) -> DeterministicBackward:
    """The gradients' buffers, delta and the key workspace of `msa::backward`'s inputs (shapes as
    in `torch_msa.reference.backward`)."""
    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    topk = block_indices.shape[-1]
    device = q.device
    dk = torch.zeros(k.shape, dtype=k.dtype, device=device)
    dv = torch.zeros(v.shape, dtype=v.dtype, device=device)
    shape_key = (device, q.dtype, dim, block_size, num_heads // num_kv_heads, topk)
    if num_queries == 0 or num_keys == 0 or topk == 0:
        dq = torch.zeros(q.shape, dtype=q.dtype, device=device)
        return DeterministicBackward(q, k, v, grad_out, lse, lse, dq, dk, dv, block_indices, None, topk, shape_key, True)
    dq = torch.empty(q.shape, dtype=q.dtype, device=device)  # `query_dq` writes every row
    q, k, v, grad_out, out = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, grad_out, out))
    delta = torch.empty((num_queries, num_heads), dtype=torch.float32, device=device)
    compute_delta(grad_out, out, grad_lse, delta, shape_key)
    block_indices = block_indices.contiguous()
    workspace = key_workspace(block_indices, documents, num_keys, block_size, num_heads, dim)
    return DeterministicBackward(q, k, v, grad_out, lse.contiguous(), delta, dq, dk, dv, block_indices, workspace,
                                 topk, shape_key, False)


def finish(state: DeterministicBackward, documents, block_size, softmax_scale):
    """`(dq, dk, dv)`: the key pass's slots reduced into dK/dV in item order, and dQ query-outer."""
    if not state.empty:
        assert state.workspace is not None
        reduce_key_workspace(state.workspace, state.dk, state.dv, state.topk, block_size, state.shape_key)
        query_dq(state.q, state.k, state.v, state.grad_out, state.lse, state.delta, state.dq, state.block_indices,
                 documents, block_size, softmax_scale, state.shape_key)
    return state.dq, state.dk, state.dv
