"""The Triton backend: every MSA op on CUDA capability 8.0 and newer, tuned on Hopper (SM90).

Kernels, one module per op: `select_kernel.py` (index scoring + top-k), `plan_kernel.py` (the
key-to-query schedule of `torch_msa/schedule.py`, packed as a plan), `forward_kernel.py`
(KV-outer attention + combine), `backward_kernel.py` (KV-outer dQ/dK/dV, adding with atomics),
`backward_deterministic_kernel.py` (the fixed-order reduction of per-item dK/dV and the
query-outer dQ), `kl_kernel.py` (the index branch's KL loss on the sparse support, KV-outer: the
forward computes the teacher once and reduces it into the teacher's half of the gradient, the
backward only the student; or, from a given teacher tensor, the loss and both halves of the
gradient in one reduction) and `kl_dense_kernel.py` (the same loss on the dense causal support of
the warm-up stage, query-tile-outer like a flash forward). No kernel module imports another: what
they share is in `common.py` (and `launch.py`, the launch configurations that fit the device).
`backward_deterministic.py` composes the backward that serves under
`torch.use_deterministic_algorithms(True)` from the stages of two of them (`deterministic_stages.py`:
all but the key pass, shared with the SM90 deterministic backward), `kl_deterministic.py`
the sparse KL loss of that mode from `kl_kernel.py`'s kernels and the fixed-order reduction of
`backward_deterministic_kernel.py`, and `stages.py` is
the interface through which other backends (SM90) compose those stages with their own kernels.
The forward and the default backward read the plan they are given, or build one; a forward whose
partials would pass `query_windows.PARTIAL_BYTES` runs over windows of queries
(`torch_msa/query_windows.py`).

Importing this package imports no triton: the kernel modules load on the first call, and the
backend reports itself unavailable on a host without triton. It serves CUDA devices of compute
capability 8.0 or newer, SM100 included (the kernels use only portable `tl.dot`; they are tuned
and measured on SM90, and `launch.py` picks per device a configuration that fits its shared
memory) with bf16, fp16 or fp32 inputs and at most 128 query heads per KV head; other inputs get
`UnsupportedInputs`, so the registry falls back to the reference with a one-time warning.
"""

import functools
import importlib
import importlib.util

import torch

from ..backends import Backend, UnsupportedInputs, register_backend
from ..index_loss import by_registry, separate
from ..query_windows import forward_in_windows

NAME = "triton"
MIN_CAPABILITY = (8, 0)
INSTALL_COMMAND = "pip install triton"
SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_dtype_and_group(name: str, dtype: torch.dtype, group_size: int = 1) -> None:
    """Decline, before any launch, a dtype or a head group (`Hq / Hkv`) the Triton kernels do not handle.

    Raises:
        UnsupportedInputs: `dtype` is not bf16, fp16 or fp32, or `group_size > 128`.
    """
    if dtype not in SERVED_DTYPES:
        raise UnsupportedInputs(f"{name} dtype {dtype} (the Triton kernels take bf16, fp16 or fp32)")
    if group_size > 128:
        raise UnsupportedInputs(
            f"Hq / Hkv = {group_size} query heads per KV head (the Triton kernels take at most 128)")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _triton_installed() -> bool:
    # Cached: every op call asks, and the lookup walks sys.path (about 0.1 ms, more than a launch).
    return importlib.util.find_spec("triton") is not None


def unavailable_reason(device: torch.device) -> str | None:
    """Why the backend cannot serve `device`, or None if it can."""
    if device.type != "cuda":
        return f"it serves CUDA devices only, not {device.type}"
    if not _triton_installed():
        return f"triton is not installed ({INSTALL_COMMAND}; it ships with Linux x86_64 torch)"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = _capability(index)
    if capability < MIN_CAPABILITY:
        return (f"cuda:{index} has compute capability {capability[0]}.{capability[1]} < "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, the least the Triton kernels need")
    return None


def available(device: torch.device) -> bool:
    return unavailable_reason(device) is None


def _kernels(module: str):
    return importlib.import_module(f"{__name__}.{module}")


def select_blocks(index_q, index_k, documents, topk, block_size):
    check_dtype_and_group("index_q", index_q.dtype)
    return _kernels("select_kernel").select_blocks(index_q, index_k, documents, topk, block_size)


def plan(block_indices, documents, num_keys, block_size, entries_per_item):
    return _kernels("plan_kernel").plan(block_indices, documents, num_keys, block_size, entries_per_item)


def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan=None):
    check_dtype_and_group("q", q.dtype, q.shape[1] // k.shape[1])
    return forward_in_windows(_kernels("forward_kernel").forward, q, k, v, block_indices, documents, block_size,
                              softmax_scale, plan)


def backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale, grad_lse=None,
             plan=None):
    check_dtype_and_group("q", q.dtype, q.shape[1] // k.shape[1])
    # Decided per call, like torch's own kernels: the flag may change between steps.
    module = "backward_deterministic" if torch.are_deterministic_algorithms_enabled() else "backward_kernel"
    return _kernels(module).backward(grad_out, q, k, v, out, lse, block_indices, documents, block_size, softmax_scale,
                                     grad_lse, plan)


def _sparse_kl_module() -> str:
    # Decided per call, like the backward's kernels.
    return "kl_deterministic" if torch.are_deterministic_algorithms_enabled() else "kl_kernel"


def indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, block_size, softmax_scale, index_softmax_scale):
    check_dtype_and_group("q", q.dtype, q.shape[1] // k.shape[1])
    check_dtype_and_group("index_q", index_q.dtype)
    if block_indices is None:
        return _kernels("kl_dense_kernel").indexer_kl_dense(q, k, lse, index_q, index_k, documents, softmax_scale,
                                                            index_softmax_scale)
    return _kernels(_sparse_kl_module()).indexer_kl(q, k, lse, index_q, index_k, block_indices, documents, block_size,
                                            softmax_scale, index_softmax_scale)


def indexer_kl_backward(grad_loss, index_q, index_k, index_lse, teacher_mass, teacher_index_keys,
                        teacher_index_queries, block_indices, documents, block_size, index_softmax_scale):
    check_dtype_and_group("index_q", index_q.dtype)
    teacher = (index_lse, teacher_mass, teacher_index_keys, teacher_index_queries)
    if block_indices is None:
        return _kernels("kl_dense_kernel").indexer_kl_dense_backward(grad_loss, index_q, index_k, *teacher, documents,
                                                                     index_softmax_scale)
    return _kernels(_sparse_kl_module()).indexer_kl_backward(grad_loss, index_q, index_k, *teacher, block_indices, documents,
                                                     block_size, index_softmax_scale)


BACKEND = Backend(
    name=NAME,
    ops={"select_blocks": select_blocks, "plan": plan, "forward": forward, "backward": backward,
         "indexer_kl": indexer_kl, "indexer_kl_backward": indexer_kl_backward,
         # The KL ops through the registry: index inputs these kernels decline fall back alone, after
         # this backend's attention backward.
         "backward_with_index_loss": functools.partial(
             separate, backward, by_registry("indexer_kl"), by_registry("indexer_kl_backward"))},
    priority=10,
    device_types=("cuda",),
    available=available,
    unavailable_reason=unavailable_reason,
)


def register() -> None:
    """Add the backend to the registry (`import torch_msa` does)."""
    register_backend(BACKEND)
