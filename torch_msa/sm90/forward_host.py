"""`msa::forward` on Hopper (sm_90a): the host side of the CuTe DSL forward kernel.

Scope: G = 16 query heads per KV head, D = 128, key blocks of 128, bf16 or fp16 (MiniMax-M3:
Hq = 64, Hkv = 4); any top-k. Everything else is the Triton backend's: `check_served` and
`check_rows` raise `UnsupportedInputs` before any work.

`forward` takes the step's plan (or builds one), sizes the partial outputs `[Tq * Hkv * topk *
16, 128]` and their log2-sum-exp, launches the kernel on a persistent grid of `CTAS_PER_SM` CTAs
per SM (capped by the item count), and merges the partials of every query into `out` and `lse`
with the Triton combine (`torch_msa.triton.stages.combine`). The kernel itself, its design and its bytes per token:
`forward_kernel.py`; the constants and checks it shares with the backward: `common.py`.

Importing this module imports neither cutlass nor triton: `compile_blocks_kernel` imports the
kernel module (and so cutlass) on the first compile, after `require_cute_dsl()`; one executable
serves a process, dtype and KV head count (sequence lengths are runtime arguments).
"""

import functools
import math

import torch

from ..backends import UnsupportedInputs
from ..contract import compute_dtype
from ..cute_dsl import require_cute_dsl, sm_count
from ..cute_dsl.cute_io import aligned_operand, launcher
from ..stages.combine import combine
from .common import HEAD_DIM, HEADS_PER_KV, blocks_operands, check_served, compile_blocks, launch, step_schedule

CTAS_PER_SM = 1  # one CTA of three warpgroups fills an SM (224 KiB of shared memory)


# The kernel's tensor arguments carry 32-bit dynamic extents (`cute_rows`). Q and the partial
# outputs are read and written only by TMA, whose coordinates are 32-bit per dimension and whose
# addresses are 64-bit, so the bound is on rows, not elements: the partials' `Tq * Hkv * topk * G`
# rows (2**31 at two million queries for M3), whose lse the threads index directly.
MAX_PARTIAL_ROWS = 2**31 - 1


def check_rows(num_queries: int, num_kv_heads: int, topk: int) -> None:
    """Raise `UnsupportedInputs` when the partial rows would not fit 32-bit indices."""
    rows = num_queries * num_kv_heads * topk * HEADS_PER_KV
    if rows > MAX_PARTIAL_ROWS:
        raise UnsupportedInputs(
            f"the SM90 forward indexes its partial rows with 32-bit integers: {num_queries} queries x "
            f"{num_kv_heads} KV heads x topk {topk} x {HEADS_PER_KV} heads need {rows} rows, more than "
            f"{MAX_PARTIAL_ROWS}"
        )


def forward(q, k, v, block_indices, documents, block_size, softmax_scale, plan=None):
    """Same contract as `torch_msa.reference.forward`: `out [Tq, Hq, D]`, `lse [Tq, Hq]` fp32.

    Walks `plan`'s items (any item size), or, without one, those of a new plan with the public
    API's item size. Query fragments (`torch_msa/documents.py`) are read from the plan: a token's
    position and a key block's document are all the kernel needs.

    Raises:
        UnsupportedInputs: outside the served configuration (see `check_served`) or beyond
            32-bit row indices (`check_rows`).
    """
    check_served(q, k, v, block_size)
    check_rows(q.shape[0], k.shape[1], block_indices.shape[-1])
    require_cute_dsl()

    num_queries, num_heads, dim = q.shape
    num_keys, num_kv_heads, _ = k.shape
    topk = block_indices.shape[-1]
    out = torch.empty((num_queries, num_heads, dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((num_queries, num_heads), dtype=compute_dtype(q.dtype), device=q.device)
    if num_queries == 0 or topk == 0 or num_keys == 0:
        return out.zero_(), lse.fill_(-math.inf)
    # TMA reads whole 16-byte aligned rows.
    q, k, v = (aligned_operand(x) for x in (q, k, v))
    schedule, key_count = step_schedule(block_indices, documents, num_keys, num_heads, plan)
    rows = num_queries * num_kv_heads * topk * HEADS_PER_KV
    partial_out = torch.empty((rows, dim), dtype=q.dtype, device=q.device)
    partial_lse = torch.full((rows,), -math.inf, dtype=torch.float32, device=q.device)
    launch_blocks(q, k, v, partial_out, partial_lse, schedule, key_count, topk, softmax_scale)
    combine(partial_out, partial_lse, out, lse, num_kv_heads, topk)
    return out, lse


def operands(num_kv_heads: int):
    """The kernel's tensor operands (`common.blocks_operands`); its own: the partial outputs and their lse."""
    return blocks_operands(num_kv_heads, (("partial_out", (HEAD_DIM,), None), ("partial_lse", (), torch.float32)))


def launch_blocks(q, k, v, partial_out, partial_lse, schedule, key_count, topk, softmax_scale) -> None:
    """Launch the blocks kernel: fills the partials of every scheduled (query, slot)."""
    tensors = {"q": q, "k": k, "v": v, "partial_out": partial_out, "partial_lse": partial_lse}
    num_kv_heads = k.shape[1]
    launch(_compiled(q.dtype, num_kv_heads), operands(num_kv_heads), tensors, schedule, key_count, topk, softmax_scale, (),
           CTAS_PER_SM * sm_count(q.device))


@functools.cache
def _compiled(dtype: torch.dtype, num_kv_heads: int):
    """One executable per process and (dtype, Hkv); token, key and item counts are dynamic."""

    return launcher(compile_blocks_kernel(dtype, num_kv_heads))


def compile_blocks_kernel(
    dtype: torch.dtype = torch.bfloat16,
    num_kv_heads: int = 4,
    arch: str | None = None,
    dump_dir: str | None = None,
    listings: bool = False,
):
    """`cute.compile` the blocks kernel (`arch=None`: this host's GPU) on fake tensors with dynamic
    leading extents. `dump_dir` keeps the cubin there, and with `listings` the PTX and SASS too."""
    require_cute_dsl()
    from .forward_kernel import Sm90ForwardKernel

    return compile_blocks(Sm90ForwardKernel(num_kv_heads), operands(num_kv_heads), dtype, (), arch, dump_dir, listings)
