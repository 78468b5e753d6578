"""What the SM90 GPU tests share: the marks that skip them without a compute capability 9.0 GPU
or the CuTe DSL (with junk in the buffers the kernels are promised to write in full), and M3-shaped
random problems."""

import pytest
import torch

from tests.support.cute_dsl import requires_cute
from torch_msa.testing import cu_seqlens, random_block_indices, skewed_block_indices

HQ, HKV, D, BLOCK, TOPK = 64, 4, 128, 128, 16
SCALE = D**-0.5

requires_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs a GPU of compute capability 9.0 (H100 / H200)",
)
# `junk_in_uninitialized_buffers` (`tests/conftest.py`): a kernel reading what it did not write
# fails its test. (Files that count a call's launches or ATen calls take `SM90_MARKS` alone.)
SM90_MARKS = [pytest.mark.cuda, requires_cute, requires_sm90]
SM90_KERNEL_MARKS = [*SM90_MARKS, pytest.mark.usefixtures("junk_in_uninitialized_buffers")]

# The document layouts both directions are checked on against the reference.
REFERENCE_LAYOUTS = pytest.mark.parametrize(
    "q_lens, k_lens",
    [
        ([1024], [1024]),
        ([0, 1, 300, 0, 1000, 1, 129], [0, 1, 300, 0, 1000, 1, 129]),  # empty and one-token documents
        ([100, 500, 77, 1], [1000, 700, 77, 260]),  # fewer queries than keys
    ],
    ids=["1k", "pack", "lq-lt-lk"],
)


def random_problem(q_lens, k_lens, dtype, selection="random", seed=0, generator=None, device="cuda", kv_heads=HKV):
    """`(q, k, v, block_indices, cu_q, cu_k, max_q, max_k)` of documents `q_lens` / `k_lens` at M3
    shapes (`HQ // HKV` query heads per KV head, `kv_heads` KV heads): standard normal q, k, v in
    `dtype`, and random selections (or, with `selection="skewed"`, every query reading block 0 of
    its document). Draws from `generator` when given (the caller may draw more from it), else from
    one seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed) if generator is None else generator
    cu_q, cu_k = cu_seqlens(q_lens, k_lens, device=device)
    num_queries, num_keys = sum(q_lens), sum(k_lens)

    def tensor(*shape):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    q = tensor(num_queries, HQ // HKV * kv_heads, D)
    k, v = tensor(num_keys, kv_heads, D), tensor(num_keys, kv_heads, D)
    if selection == "skewed":
        blocks = skewed_block_indices(cu_q, cu_k, kv_heads, TOPK, BLOCK)
    else:
        blocks = random_block_indices(cu_q, cu_k, kv_heads, TOPK, BLOCK, generator=generator).to(device)
    return q, k, v, blocks, cu_q, cu_k, max(q_lens, default=0), max(k_lens, default=0)


def with_junk_ids(block_indices: torch.Tensor, seed: int = 5) -> torch.Tensor:
    """`block_indices` (`[Hkv >= 3, Tq, topk >= 10]`) with out-of-contract ids: random small ids
    (negative, or beyond a query's horizon) in its -1 slots and over slot 9, the largest and the
    smallest int32 in slots 3 and 4 of KV heads 0 and 1, and repeats of slot 4 in slots 5-7 of KV
    head 2."""
    generator = torch.Generator().manual_seed(seed)
    junk = torch.randint(-3, 12, block_indices.shape, generator=generator, dtype=torch.int32).to(block_indices.device)
    junk[0, :, 3] = 2**31 - 1
    junk[1, :, 4] = -(2**31)
    junk[2, :, 5:8] = junk[2, :, 4:5]  # repeats
    blocks = torch.where(block_indices >= 0, block_indices, junk)
    blocks[:, :, 9] = junk[:, :, 9]  # over a valid id too
    return blocks
