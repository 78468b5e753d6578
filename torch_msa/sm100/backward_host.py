"""`run_backward`: the MSA backward on an SM100 GPU, and the launch and compile of its main kernel.

`launch_main` checks every operand against `OPERANDS`, the table `compile_main_kernel` compiles
for; one executable serves the process (token, workspace and task counts are runtime arguments).
"""

import functools

import torch

from ..backends import UnsupportedInputs
from ..cute_dsl import require_cute_dsl, sm_count
from ..cute_dsl.cute_io import aligned_operand, compile_kernel, fake_rows, launcher
from .common import BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, TOKENS_PER_TASK, require_sm100
from .postprocess import finish_gradients
from .preprocess import prepare_delta
from .task_tables import TaskTables, align_kv, build_tasks


def run_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_indices: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MSA backward on an SM100 GPU: `(dq, dk, dv)` in q's dtype, with no host synchronisation.

    dQ, dK and dV are summed with fp32 atomics, so the result is not deterministic; the backend
    declines deterministic mode before calling this.

    Args:
        q, grad_out, out: bf16 `[Tq, 64, 128]` on a CUDA device of capability 10.0.
        k, v: bf16 `[Tk, 4, 128]`.
        lse: fp32 `[Tq, 64]`, natural log, from the forward.
        block_indices: int32 `[4, Tq, topk]`, blocks of 128 keys (ids read as a set).
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]`.
        max_seqlen_q, max_seqlen_k: part of the op signature; not read.
        softmax_scale: the forward's scale of `q k^T`.
        grad_lse: optional `[Tq, 64]` gradient of `lse`, folded into delta.

    Raises:
        NotImplementedError: unless the device has compute capability 10.0.
        UnsupportedInputs: outside the M3 configuration (Hq=64, Hkv=4, D=128, block 128, bf16).
    """
    del max_seqlen_q, max_seqlen_k
    require_sm100(q.device)
    _check_contract(q, k, v, grad_out, out, lse, block_indices)
    # The kernel reads these with TMA and vector loads: contiguous, 16-byte aligned rows.
    q, grad_out, lse = (aligned_operand(x) for x in (q, grad_out, lse))
    delta = prepare_delta(out, grad_out, grad_lse)
    tables = build_tasks(block_indices, cu_seqlens_q, cu_seqlens_k, k.shape[0], BLOCK_SIZE)
    k_ws, v_ws = align_kv(k, v, cu_seqlens_k, tables)
    dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk_accum = torch.zeros(k_ws.shape, dtype=torch.float32, device=q.device)
    dv_accum = torch.zeros_like(dk_accum)
    launch_main(q, k_ws, v_ws, grad_out, lse, delta, tables, dq_accum, dk_accum, dv_accum, softmax_scale)
    return finish_gradients(dq_accum, dk_accum, dv_accum, cu_seqlens_k, tables, q.dtype)


def _check_contract(q, k, v, grad_out, out, lse, block_indices) -> None:
    """Raise `UnsupportedInputs` naming the first argument outside the kernel's contract."""
    num_queries = q.shape[0] if q.dim() == 3 else -1
    expected = {
        "q": ((num_queries, NUM_Q_HEADS, HEAD_DIM), torch.bfloat16),
        "grad_out": ((num_queries, NUM_Q_HEADS, HEAD_DIM), torch.bfloat16),
        "out": ((num_queries, NUM_Q_HEADS, HEAD_DIM), torch.bfloat16),
        "k": ((k.shape[0] if k.dim() == 3 else -1, NUM_KV_HEADS, HEAD_DIM), torch.bfloat16),
        "v": (tuple(k.shape), torch.bfloat16),
        "lse": ((num_queries, NUM_Q_HEADS), torch.float32),
    }
    tensors = {"q": q, "grad_out": grad_out, "out": out, "k": k, "v": v, "lse": lse}
    for name, (shape, dtype) in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != q.device:
            raise UnsupportedInputs(
                f"{name}: the SM100 backward serves {dtype} {list(shape)} on {q.device} "
                f"(Hq={NUM_Q_HEADS}, Hkv={NUM_KV_HEADS}, D={HEAD_DIM}); got {tensor.dtype} "
                f"{list(tensor.shape)} on {tensor.device}"
            )
    if block_indices.dim() != 3 or block_indices.shape[:2] != (NUM_KV_HEADS, num_queries):
        raise UnsupportedInputs(
            f"block_indices: the SM100 backward serves [{NUM_KV_HEADS}, Tq={num_queries}, topk]; "
            f"got {list(block_indices.shape)}"
        )


# The kernel's tensor operands in launch order: (name, dtype, extent of dim 0, inner shape); dim 0 is dynamic.
OPERANDS = (
    ("q", torch.bfloat16, "Tq", (NUM_Q_HEADS, HEAD_DIM)),
    ("k_ws", torch.bfloat16, "W", (NUM_KV_HEADS, HEAD_DIM)),
    ("v_ws", torch.bfloat16, "W", (NUM_KV_HEADS, HEAD_DIM)),
    ("grad_out", torch.bfloat16, "Tq", (NUM_Q_HEADS, HEAD_DIM)),
    ("lse", torch.float32, "Tq", (NUM_Q_HEADS,)),
    ("delta", torch.float32, "Tq", (NUM_Q_HEADS,)),
    ("task_meta", torch.int32, "max_tasks", (4,)),
    ("task_qrows", torch.int32, "max_tasks", (TOKENS_PER_TASK,)),
    ("task_qpos", torch.int32, "max_tasks", (TOKENS_PER_TASK,)),
    ("num_tasks", torch.int32, "1", ()),
    ("dq_accum", torch.float32, "Tq", (NUM_Q_HEADS, HEAD_DIM)),
    ("dk_accum", torch.float32, "W", (NUM_KV_HEADS, HEAD_DIM)),
    ("dv_accum", torch.float32, "W", (NUM_KV_HEADS, HEAD_DIM)),
)


def launch_main(
    q: torch.Tensor,
    k_ws: torch.Tensor,
    v_ws: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    tables: TaskTables,
    dq_accum: torch.Tensor,
    dk_accum: torch.Tensor,
    dv_accum: torch.Tensor,
    softmax_scale: float,
) -> None:
    """Add dQ, dK and dV (fp32; dQ and dK times `softmax_scale`) into the accumulators with atomics.

    Args:
        q, grad_out: bf16 `[Tq, 64, 128]`.
        k_ws, v_ws: bf16 `[W, 4, 128]`, the aligned workspace of `task_tables.align_kv`.
        lse: fp32 `[Tq, 64]` (natural log); delta: fp32 `[Tq, 64]` from `prepare_delta`.
        tables: `task_tables.TaskTables` of the same documents (`W == tables.workspace_rows`).
        dq_accum: fp32 `[Tq, 64, 128]`; dk_accum, dv_accum: fp32 `[W, 4, 128]`; all zero on
            entry (the kernel only adds).
        softmax_scale: scale of `q k^T`; it also scales dQ and dK.

    Raises:
        ValueError: a tensor of another shape or dtype, not contiguous, not 16-byte aligned, or
            not on q's CUDA device.
    """
    tensors = {
        "q": q, "k_ws": k_ws, "v_ws": v_ws, "grad_out": grad_out, "lse": lse, "delta": delta,
        "task_meta": tables.task_meta, "task_qrows": tables.task_qrows, "task_qpos": tables.task_qpos,
        "num_tasks": tables.num_tasks, "dq_accum": dq_accum, "dk_accum": dk_accum, "dv_accum": dv_accum,
    }
    extents = {"Tq": q.shape[0], "W": tables.workspace_rows, "max_tasks": tables.task_meta.shape[0], "1": 1}
    for name, dtype, rows, inner in OPERANDS:
        tensor, shape = tensors[name], (extents[rows], *inner)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name}: expected {dtype} {list(shape)}, got {tensor.dtype} {list(tensor.shape)}")
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tensor.stride()}")
        if tensor.data_ptr() % 16:
            # TMA sources and the 16-byte atomics need 16-byte aligned rows.
            raise ValueError(f"{name}: expected 16-byte aligned storage, got address {tensor.data_ptr():#x}")
    for name, tensor in tensors.items():
        if tensor.device != q.device or q.device.type != "cuda":
            raise ValueError(f"{name}: expected q's CUDA device, got {tensor.device} (q on {q.device})")
    if extents["Tq"] == 0 or extents["max_tasks"] == 0:
        return
    # One CTA per SM (shared memory allows no more); the CTAs split the real tasks evenly.
    grid = max(1, min(sm_count(q.device), extents["max_tasks"]))
    _compile()(*(tensors[name] for name, _, _, _ in OPERANDS), grid, softmax_scale)


@functools.cache
def _compile():
    return launcher(compile_main_kernel())


def compile_for_target(arch: str, dump_dir: str | None = None) -> dict:
    """Compile the main kernel for `arch` (`"sm_100a"`); no GPU is needed. Returns name -> kernel."""
    return {"main": compile_main_kernel(arch, dump_dir)}


def compile_main_kernel(arch: str | None = None, dump_dir: str | None = None, listings: bool = False):
    """`cute.compile` the main kernel (`arch=None`: this host's GPU) for `OPERANDS`. `dump_dir` keeps
    the cubin there, and with `listings` also the PTX and the SASS."""
    require_cute_dsl()
    import cutlass

    from .backward_kernel import Sm100BackwardKernel

    operands = [fake_rows(dtype, inner) for _, dtype, _, inner in OPERANDS]
    return compile_kernel(Sm100BackwardKernel(), *operands, cutlass.Int32(1), cutlass.Float32(1.0), arch=arch,
                          dump_dir=dump_dir, listings=listings)
