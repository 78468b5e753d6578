"""What the Triton kernel tests (`tests/triton/kernels/`) share: the device they run on, the layouts
and selections they build, their tolerance check and the non-finite poison of one document.

On a CUDA host the files run the compiled kernels; on CPU they run under the Triton interpreter
(`TRITON_INTERPRET=1`, set by `tests/triton/test_interpret.py` for a subprocess per file, because
the interpreter must be chosen before triton is imported). The interpreter does not compute bf16
`tl.dot` correctly (triton 3.8), so the small cases use fp32 and fp16; bf16 is covered at M3
shapes by `tests/triton/test_cuda.py`.
"""

import os

import pytest
import torch

from torch_msa import testing

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETING else "cuda"
# The attention kernels' cases: (q lengths, k lengths, Hq, Hkv, D, block, topk, dtype).
ATTENTION_CASES = {
    "pack-empty-and-1-token": ([40, 0, 1, 90], [140, 5, 1, 90], 4, 2, 64, 64, 4, torch.float32),
    "one-doc-d128-b128-fp16": ([150], [150], 8, 2, 128, 128, 2, torch.float16),
    "suffix-pack-group3": ([30, 70], [140, 70], 6, 2, 64, 64, 3, torch.float32),
    "mha-topk-beyond-blocks": ([200], [200], 2, 2, 64, 64, 16, torch.float16),
}
# The largest error against the reference, relative to max(1, max |reference|), by dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2}
# The document `poison` is applied to; its neighbours' results must not change.
POISONED_DOC = 1
NON_FINITE = (float("nan"), float("inf"), float("-inf"))


def require_a_device() -> None:
    """Skip the calling test module (at import) without CUDA or the interpreter."""
    if not INTERPRETING and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device, or TRITON_INTERPRET=1 for the CPU interpreter (tests/triton/test_interpret.py "
                    "runs these files with it)", allow_module_level=True)


def layout(q_lens, k_lens):
    """`(cu_q, cu_k, Tq, Tk, max_q, max_k)` of documents of these lengths on `DEVICE`."""
    cu_q, cu_k = testing.cu_seqlens(q_lens, k_lens, DEVICE)
    return cu_q, cu_k, int(cu_q[-1]), int(cu_k[-1]), max(q_lens), max(k_lens)


def junk_indices(cu_q, cu_k, num_kv_heads, topk, block_size):
    """Valid random selections with out-of-contract ids mixed in: repeats, far ids, negatives."""
    block_indices = testing.random_block_indices(cu_q, cu_k, num_kv_heads, topk, block_size)
    if topk > 1:
        block_indices[0, :, -1] = block_indices[0, :, 0]
        block_indices[-1, ::3, 0] = 10_000
        block_indices[-1, 1::4, 1] = -5
    return block_indices


def close(actual, expected, tolerance, what):
    """Assert that `actual` is within `tolerance x max(1, max |expected|)` of `expected`."""
    error = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.double().abs().max().item() if expected.numel() else 0.0)
    assert error <= tolerance * scale, f"{what}: max error {error:.3g} > {tolerance:.1g} x {scale:.3g}"


def poison(x, rows):
    """A copy of `x` whose `rows` cycle through NaN, +Inf and -Inf."""
    x = x.clone()
    for i, row in enumerate(range(rows.start, rows.stop)):
        x[row] = NON_FINITE[i % len(NON_FINITE)]
    return x


def doc_rows(cu):
    return [range(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]
