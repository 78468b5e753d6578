"""`python -m benchmarks.overhead [T ...]`: eager host overhead of one forward call.

For one document of `T` tokens at M3 shapes (bf16, random valid selections), times 50 eager
`sparse_attention` calls (plan included) on the host, and the same calls' kernels with the torch
profiler; the difference is what the Python layer costs above the GPU work. CUDA only.
"""

import argparse
import time

import torch

import torch_msa
from torch_msa import testing

CALLS = 50


def measure(tokens: int) -> dict[str, float]:
    """Milliseconds per call: host enqueue, wall (until the GPU is done) and device kernels."""
    cu = testing.cu_seqlens([tokens], [tokens], "cuda")[0]
    q = torch.randn(tokens, 64, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(tokens, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    block_indices = testing.random_block_indices(cu, cu, 4, 16, 128).cuda()

    def call():
        return torch_msa.sparse_attention(q, k, v, block_indices, cu, cu, tokens, tokens)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    enqueue = (time.perf_counter() - start) / CALLS * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / CALLS * 1e3
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    device_us = sum(e.device_time_total for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"enqueue": enqueue, "wall": wall, "kernels": device_us / CALLS / 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("tokens", type=int, nargs="*", default=[8192], help="document lengths (default 8192)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    for tokens in args.tokens:
        ms = measure(tokens)
        print(f"T={tokens}: enqueue {ms['enqueue']:.3f} ms/call, wall {ms['wall']:.3f} ms/call, kernels "
              f"{ms['kernels']:.3f} ms/call, wall - kernels {ms['wall'] - ms['kernels']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
