"""The SM100 (Blackwell) backend: the official MiniMax MSA flat forward and our CuTe DSL backward.

Serves a CUDA device of compute capability 10.0 with the `cute` extra and the official MSA
package (`common.INSTALL_COMMAND`), in the MiniMax-M3 configuration only, and only under
`TORCH_MSA_BACKEND=sm100` (opt-in until it has run on SM100 hardware). Everything else it declines
with `UnsupportedInputs` before any work. Design notes: `README.md` in this folder.
"""

import functools

import torch

from ..backends import BACKEND_ENV, Backend, UnsupportedInputs
from ..contract import M3
from ..cute_dsl import CUTE_DSL_MODULES, device_unavailable_reason, importable, sm_capability
from ..documents import locate_queries
from ..plan.schedule import valid_entries
from . import bindings
from .common import BLOCK_SIZE, HEAD_DIM, INSTALL_COMMAND, NUM_KV_HEADS, NUM_Q_HEADS, SM100_CAPABILITY

NAME = "sm100"
PRIORITY = 20

TOPK = M3.topk
DTYPE = torch.bfloat16

_REQUIRED_MODULES = (bindings.OFFICIAL_PACKAGE, *CUTE_DSL_MODULES, bindings.BACKWARD_MODULE)


def available(device: torch.device) -> bool:
    """True on a CUDA device of compute capability 10.0 with the CuTe DSL and the official MSA package installed."""
    if not _on_sm100(device):
        return False
    return _extras_installed()


def unavailable_reason(device: torch.device) -> str | None:
    """Why the backend cannot serve `device` (no CUDA device, its capability, missing extras), or None."""
    return device_unavailable_reason(device, SM100_CAPABILITY, "the SM100 kernels need", "B200/GB200", _REQUIRED_MODULES,
                                     f"install: {INSTALL_COMMAND}")


def opt_in_note(device: torch.device) -> str | None:
    """The one-time note on an SM100 device: the backend is opt-in until it has run on hardware."""
    if not _on_sm100(device):
        return None
    return (
        f"the sm100 backend (official MSA forward + CuTe DSL backward) has not yet run on SM100 hardware, so "
        f"it is opt-in (the Triton backend serves {device} meanwhile); enable it with {BACKEND_ENV}={NAME}"
        + ("" if _extras_installed() else f" after installing what it needs ({INSTALL_COMMAND})")
    )


def _on_sm100(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and sm_capability(device) == SM100_CAPABILITY


@functools.cache
def _extras_installed() -> bool:
    return all(importable(name) for name in _REQUIRED_MODULES)


def _decline_fragments(documents) -> None:
    if documents.has_fragments:
        raise UnsupportedInputs("query fragments (fragment_documents given): the SM100 kernels serve one causal "
                                "suffix of queries per document")


def _require_official_configuration(q, k, v, block_indices, block_size) -> None:
    expected = (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, TOPK)
    actual = (q.shape[1], k.shape[1], q.shape[2], block_size, block_indices.shape[2])
    dtypes = {q.dtype, k.dtype, v.dtype}
    if actual != expected or dtypes != {DTYPE}:
        names = ("Hq", "Hkv", "D", "block_size", "topk")
        raise UnsupportedInputs(
            "the SM100 backend serves only the official MSA configuration "
            f"({', '.join(f'{n}={e}' for n, e in zip(names, expected))}, {DTYPE}); "
            f"got {', '.join(f'{n}={a}' for n, a in zip(names, actual))}, "
            f"{'/'.join(sorted(str(dtype) for dtype in dtypes))}"
        )


def canonical_block_indices(
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_keys: int,
    block_size: int,
) -> torch.Tensor:
    """The key-block set of every (KV head, query), in the form the SM100 kernels require.

    Returns int32 `[Hkv, Tq, topk]`: per row the distinct ids in `[0, nvb(t))`, ascending, then
    `-1`. That is exactly the set the reference reads (negative, beyond-horizon and repeated ids
    add nothing), so an out-of-contract id can neither be read out of bounds nor counted twice.
    No host synchronisation.
    """
    position = locate_queries(cu_seqlens_q, cu_seqlens_k, block_indices.shape[1], num_keys).position
    dropped = torch.iinfo(torch.int64).max  # sorts after every real id
    valid = valid_entries(block_indices, position, block_size)
    kept = torch.where(valid, block_indices.to(torch.int64), dropped).sort(dim=-1).values
    return kept.masked_fill(kept == dropped, -1).to(torch.int32).contiguous()


def _self_attention_key_rows(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> int:
    """Rows of the official key-block CSR (the sum over documents of `ceil(L / 128)`), in one host sync.

    Raises:
        UnsupportedInputs: unless every document is self-attention (`cu_seqlens_q == cu_seqlens_k`).
    """
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int64).clamp(min=0)
    rows = torch.div(lengths + BLOCK_SIZE - 1, BLOCK_SIZE, rounding_mode="floor").sum()
    if cu_seqlens_q is cu_seqlens_k:
        differs = torch.zeros((), dtype=torch.int64, device=rows.device)
    elif cu_seqlens_q.shape != cu_seqlens_k.shape:
        differs = torch.ones((), dtype=torch.int64, device=rows.device)
    else:
        differs = (cu_seqlens_q != cu_seqlens_k).any().to(torch.int64)
    rows, differs = torch.stack((rows, differs)).tolist()
    if differs:
        raise UnsupportedInputs(
            "the SM100 backend sends only self-attention packs (cu_seqlens_q == cu_seqlens_k) to the official "
            "forward; these documents have fewer queries than keys"
        )
    return rows


def _aligned(x: torch.Tensor) -> torch.Tensor:
    # The official kernels load q/k/v with 16-byte vector copies and reject a misaligned base.
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan=None):
    """`msa::forward` through the official flat forward: `(out [Tq, 64, 128] bf16, lse [Tq, 64] fp32)`.

    The official forward builds its own key-to-query CSR, so `plan` is not read.

    Raises:
        UnsupportedInputs: outside the official configuration, during CUDA-graph capture, for
            documents with fewer queries than keys, or for query fragments; nothing has been
            launched.
    """
    _decline_fragments(documents)
    _require_official_configuration(q, k, v, block_indices, block_size)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise UnsupportedInputs(
            "the SM100 forward synchronises with the host once (the official CSR builder takes host sizes), "
            "which CUDA-graph capture forbids"
        )
    num_queries = q.shape[0]
    if num_queries == 0:
        return q.new_empty(q.shape), q.new_empty((0, NUM_Q_HEADS), dtype=torch.float32)
    if num_queries != k.shape[0]:
        raise UnsupportedInputs(
            "the SM100 backend sends only self-attention packs (Tq == Tk, cu_seqlens_q == cu_seqlens_k) to the "
            f"official forward; got Tq={num_queries}, Tk={k.shape[0]}"
        )
    cu_seqlens_q, cu_seqlens_k = documents.cu_seqlens_q.contiguous(), documents.cu_seqlens_k.contiguous()
    key_rows = _self_attention_key_rows(cu_seqlens_q, cu_seqlens_k)
    launchers = bindings.kernels()
    support = canonical_block_indices(block_indices, cu_seqlens_q, cu_seqlens_k, k.shape[0], BLOCK_SIZE)
    max_seqlen_q, max_seqlen_k = int(documents.max_seqlen_q), int(documents.max_seqlen_k)
    # The official CSR builder carries no device guard: bind both launches to the tensors' device.
    with torch.cuda.device(q.device):
        row_ptr, q_indices, schedule = launchers.build_k2q_csr(
            support,
            cu_seqlens_q,
            cu_seqlens_k,
            BLOCK_SIZE,
            total_k=k.shape[0],
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            total_rows=key_rows,
            qhead_per_kv=NUM_Q_HEADS // NUM_KV_HEADS,
            return_schedule=True,
        )
        out, lse = launchers.sparse_atten_func(
            _aligned(q),
            _aligned(k),
            _aligned(v),
            row_ptr,
            q_indices,
            TOPK,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            blk_kv=BLOCK_SIZE,
            causal=True,
            softmax_scale=float(softmax_scale),
            partial_dtype=torch.bfloat16,
            return_softmax_lse=True,
            schedule=schedule,
        )
    # The official lse is already natural-log fp32 [Tq, Hq] (README.md): no conversion.
    return out, lse


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None):
    """`msa::backward` through our CuTe DSL `run_backward`: `(dq, dk, dv)` in bfloat16.

    Its tasks hold 8 queries each, a finer split than the public API's plans, so `plan` is not read.

    Raises:
        UnsupportedInputs: under `torch.use_deterministic_algorithms(True)` (dK/dV/dQ are
            accumulated with atomics), outside the official configuration, or for query
            fragments; nothing launched.
    """
    _decline_fragments(documents)
    if torch.are_deterministic_algorithms_enabled():
        raise UnsupportedInputs(
            "the SM100 backward adds dQ, dK and dV with fp32 atomics, so it is not deterministic, and "
            "torch.use_deterministic_algorithms(True) is on"
        )
    _require_official_configuration(q, k, v, block_indices, block_size)
    if q.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    launchers = bindings.kernels()
    support = canonical_block_indices(block_indices, documents.cu_seqlens_q, documents.cu_seqlens_k, k.shape[0],
                                      BLOCK_SIZE)
    with torch.cuda.device(q.device):
        return launchers.run_backward(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            grad_out.contiguous(),
            out.contiguous(),
            lse.contiguous(),
            support,
            documents.cu_seqlens_q.contiguous(),
            documents.cu_seqlens_k.contiguous(),
            int(documents.max_seqlen_q),
            int(documents.max_seqlen_k),
            float(softmax_scale),
            None if grad_lse is None else grad_lse.contiguous(),
        )


BACKEND = Backend(
    name=NAME,
    ops={
        "forward": forward,
        "backward": backward,
    },
    priority=PRIORITY,
    device_types=("cuda",),
    available=available,
    unavailable_reason=unavailable_reason,
    opt_in_note=opt_in_note,
)
