"""Constants, the device gate and the task kernel's operands shared by the SM100 host and kernel modules.

Imports only torch, so the kernel modules can read their constants from here.
"""

from typing import Any, NamedTuple

import torch

from ..contract import M3
from ..cute_dsl import INSTALL_COMMAND as CUTE_INSTALL_COMMAND
from ..cute_dsl import sm_capability

SM100_CAPABILITY = (10, 0)

OFFICIAL_MSA_REVISION = "80434d7f67877c6570ca19cac444b84bc9855dac"
INSTALL_COMMAND = (
    f'{CUTE_INSTALL_COMMAND}; then the official MSA kernels (not on the package index; Linux, a CUDA toolkit): '
    f'pip install "fmha-sm100 @ git+https://github.com/MiniMax-AI/MSA.git@{OFFICIAL_MSA_REVISION}"'
)

NUM_Q_HEADS = M3.query_heads
NUM_KV_HEADS = M3.kv_heads
HEAD_DIM = M3.head_dim
HEADS_PER_KV = M3.group  # 16 query heads share a kv head (GQA group)
TOKENS_PER_TASK = 8  # query tokens per task: 8 tokens x 16 query heads fill one 128-row MMA tile
WORKSPACE_ALIGNMENT = 128  # rows; every document's keys start on such a boundary
THREADS_PER_CTA = 256  # of the task-table, preprocess and postprocess kernels
TILE = 128  # keys per bucket tile = query rows per task tile (TOKENS_PER_TASK * HEADS_PER_KV)
BLOCK_SIZE = M3.block_size


def require_sm100(device: torch.device | str | int) -> None:
    """Refuse, before compiling or launching anything, a device the SM100 kernels are not built for.

    Raises:
        NotImplementedError: unless `device` is a CUDA device of compute capability 10.0
            (B200 / GB200); the message names the device and what it is.
    """
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type != "cuda":
        raise NotImplementedError(
            "the SM100 MSA kernels need a CUDA device of compute capability 10.0; "
            f"got a {resolved.type} device ({resolved})"
        )
    capability = sm_capability(resolved)
    if capability != SM100_CAPABILITY:
        raise NotImplementedError(
            "the SM100 MSA kernels need compute capability 10.0 (they are built for sm_100a); "
            f"{resolved} has compute capability {capability[0]}.{capability[1]}"
        )


class TaskOperands(NamedTuple):
    """The task-table kernel's int32 tensors in launch order (torch on the host, CuTe in the kernel):
    `Schedule`'s tensors of these names, `cu_seqlens_k`, then `TaskTables`' of these names."""

    entry_query: Any
    item_bucket: Any
    item_start: Any
    item_end: Any
    bucket_head: Any
    bucket_key_row: Any
    bucket_block: Any
    position: Any
    num_items: Any
    num_buckets: Any
    cu_seqlens_k: Any
    doc_aligned_start: Any
    task_meta: Any
    task_qrows: Any
    task_qpos: Any
    bucket_task_ptr: Any
