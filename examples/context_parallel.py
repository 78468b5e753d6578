"""MSA with context parallelism: one packed batch over the ranks of a process group.

Each rank takes its load-balanced share of a random pack, runs `torch_msa.distributed.msa_attention`
forward and backward and the sparse KL loss, and compares out, dq, dk, dv and the index keys'
gradient with one process running the whole pack (relative Frobenius error), then prints the
step time and the bytes each rank gathered.

    torchrun --nproc-per-node 2 examples/context_parallel.py --device cpu                   # gloo, CPU
    torchrun --nproc-per-node 2 examples/context_parallel.py                                # one GPU per rank, NCCL
    torchrun --nproc-per-node 2 examples/context_parallel.py --backend gloo --same-gpu      # ranks share one GPU

On CPU the reference kernels do the work and the time grows with --tokens: with 2 ranks on 2
cores the default 4096 tokens take about 5 minutes (a warm-up step, the timed step, then the
whole pack in each process for the comparison, as long as one step per rank; --no-check leaves
it out). On GPUs it takes seconds, most of them compiling the kernels in the warm-up.
Rank 0 prints each stage when it starts, on CPU with the time it should take.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import torch_msa
from torch_msa import distributed as cp
from torch_msa.contract import M3


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n")[-1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where every rank runs (default: cuda if available, else cpu)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on CPU")
    parser.add_argument("--same-gpu", action="store_true", help="every rank on cuda:0 (needs --backend gloo)")
    parser.add_argument("--tokens", type=int, help="tokens of the whole pack (default: 32768 on CUDA, 4096 on CPU)")
    parser.add_argument("--documents", type=int, default=3, help="documents of (about) equal length (default: 3)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--no-check", action="store_true", help="skip the single-process comparison")
    return parser.parse_args()


def main():
    args = parse_args()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("context_parallel.py runs one process per rank: start it with torchrun, for example\n"
                         "    torchrun --nproc-per-node 2 examples/context_parallel.py --device cpu")
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", 0 if args.same_gpu else int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype]
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokens = args.tokens or (32768 if device.type == "cuda" else 4096)

    def stage(text: str) -> None:
        """Say on rank 0 that a stage starts (the other ranks run it too)."""
        if rank == 0:
            print(text, flush=True)

    lengths = [tokens // args.documents] * args.documents
    lengths[-1] += tokens - sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    generator = torch.Generator(device=device).manual_seed(0)  # the same pack on every rank

    def tensor(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    T = tokens
    whole = dict(q=tensor(T, M3.query_heads, M3.head_dim), k=tensor(T, M3.kv_heads, M3.head_dim),
                 v=tensor(T, M3.kv_heads, M3.head_dim), index_q=tensor(T, M3.kv_heads, M3.index_dim),
                 index_k=tensor(T, 1, M3.index_dim))
    grad_out = tensor(T, M3.query_heads, M3.head_dim)

    layout = cp.load_balanced_layout(cu_seqlens, world_size, rank, device=device)
    local = {name: layout.shard(x).requires_grad_() for name, x in whole.items()}

    def step():
        attn = cp.msa_attention(local["q"], local["k"], local["v"], local["index_q"].detach(), local["index_k"].detach(),
                                layout, return_lse=True, return_block_indices=True)
        kl = cp.indexer_kl_loss(local["q"].detach(), local["k"].detach(), attn.lse.detach(), local["index_q"],
                                local["index_k"], attn.block_indices, layout)
        ((attn.out.float() * layout.shard(grad_out).float()).sum() + kl).backward()
        return attn.out

    def expected(seconds: float) -> str:
        """On CPU, where the warm-up is a step like the others, the time a stage should take."""
        if device.type != "cpu":
            return ""
        return f" (expected about {seconds:.1f} s)" if seconds < 10 else f" (expected about {seconds:.0f} s)"

    compiling = " (the kernels compile on first use)" if device.type == "cuda" else ""
    stage(f"warm-up step on {world_size} rank{'s' * (world_size > 1)}: forward, backward and KL of "
          f"{layout.num_local_tokens} of {T} tokens each{compiling} ...")
    start = time.perf_counter()
    step()
    warm_up = time.perf_counter() - start
    for x in local.values():
        x.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    stage(f"timed step{expected(warm_up)} ...")
    start = time.perf_counter()
    out = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    gathered_bytes = T * (2 * M3.kv_heads * M3.head_dim + M3.index_dim) * whole["k"].element_size()
    print(f"rank {rank}/{world_size} ({device}, {backend}, {dtype}): {layout.num_local_tokens} of {T} tokens, "
          f"step {elapsed * 1e3:.1f} ms, gathered K/V/index keys {gathered_bytes / 2**20:.1f} MiB", flush=True)

    if not args.no_check:
        stage(f"the whole pack in each process, for the comparison{expected(world_size * elapsed)} ...")
        ref = {name: x.clone().requires_grad_() for name, x in whole.items()}
        ref_attn = torch_msa.msa_attention(
            ref["q"], ref["k"], ref["v"], ref["index_q"].detach(), ref["index_k"].detach(), cu_seqlens, cu_seqlens,
            max(lengths), max(lengths), return_lse=True, return_block_indices=True)
        ref_out = ref_attn.out
        ref_kl = torch_msa.indexer_kl_loss(ref["q"].detach(), ref["k"].detach(), ref_attn.lse.detach(), ref["index_q"],
                                           ref["index_k"], ref_attn.block_indices, cu_seqlens, cu_seqlens, max(lengths),
                                           max(lengths))
        ((ref_out.float() * grad_out.float()).sum() + ref_kl).backward()

        def error(got, want):
            want = layout.shard(want).double()
            return ((got.double() - want).norm() / want.norm().clamp(min=1e-30)).item()

        errors = {"out": error(out, ref_out), **{f"d{name}": error(local[name].grad, ref[name].grad)
                                                for name in ("q", "k", "v", "index_q", "index_k")}}
        print(f"rank {rank}: relative error against one process: "
              + ", ".join(f"{name} {value:.1e}" for name, value in errors.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
