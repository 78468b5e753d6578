"""`python -m benchmarks.kl`: the index branch's KL loss against the attention it distils.

For each length (one document, or `--documents N` equal documents packed, M3 shapes, bf16) it
times, with the benchmark's timer:

* `attention step`: select + sparse attention forward + backward (`msa_attention`, `lse` and the
  selection returned, `out.backward`), the training step the loss rides on;
* `sparse KL fwd+bwd`: `indexer_kl_loss` on that step's `lse` and selection, then its backward;
* `sparse KL fwd`: the same loss without grad (the forward, where the teacher is computed; the
  backward is the difference);
* `step with KL`: the attention step with `msa_attention(..., index_loss=True)`, `out`'s
  gradient the attention step's and the KL's 1: the KL fused into the attention's backward where
  a backend fuses it (`msa::backward_with_index_loss`), with the peak memory it adds over the
  attention step; `step with KL, deterministic` the same under
  `torch.use_deterministic_algorithms(True)`;
* `dense KL fwd+bwd` (warm-up stage, with `--dense`): `indexer_kl_loss_dense` computing its own
  teacher normaliser, then its backward, against a dense causal SDPA forward + backward (cuDNN on
  CUDA when available), with the peak memory it adds; `dense KL fwd+bwd, lse given` takes the
  normaliser (the difference of the two rows is the cost of computing it).

and prints the KL rows as a share of their reference step and the backend serving each op.
`kl.json` under `--out` holds the medians; it is rewritten after every length and on Ctrl-C, and
its `status` (`running`, `interrupted`, `complete`) says whether it is partial. On a terminal
stderr shows each length's progress (rows done, elapsed, time left).
"""

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

import torch_msa
from torch_msa._progress import Progress
from torch_msa.contract import M3, Shape
from torch_msa.testing import pick_device

from . import command
from .results import RUNNING, run_recorded, write_record
from .timing import free_memory, measure

SPARSE_ROWS = ("attention step", "sparse KL fwd+bwd", "sparse KL fwd", "step with KL", "step with KL, deterministic")
DENSE_ROWS = ("dense SDPA fwd+bwd", "dense KL fwd+bwd", "dense KL fwd+bwd, lse given")


def _inputs(tokens: int, shape: Shape, device, dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*size, grad=False):
        return torch.randn(*size, generator=g, device=device, dtype=dtype).requires_grad_(grad)

    q = randn(tokens, shape.query_heads, shape.head_dim, grad=True)
    k = randn(tokens, shape.kv_heads, shape.head_dim, grad=True)
    v = randn(tokens, shape.kv_heads, shape.head_dim, grad=True)
    index_q = randn(tokens, shape.kv_heads, shape.index_dim, grad=True)
    index_k = randn(tokens, 1, shape.index_dim, grad=True)
    return q, k, v, index_q, index_k


def measure_kl(tokens: int, shape: Shape = M3, device=None, dtype=torch.bfloat16, dense: bool = False,
               warmup: int = 2, iters: int = 5, rows: dict[str, float] | None = None,
               progress: Progress | None = None, documents: int = 1) -> dict[str, float]:
    """Median milliseconds of each row (see the module docstring) at `tokens` tokens, packed as
    `documents` equal documents (the dense rows take one document only).

    `rows`, when given, is filled in place as each row is timed (a caller holding it keeps the
    rows timed before an interruption) and returned; `progress` gets a step per row."""
    device = torch.device(device) if device is not None else pick_device(None)
    rows = {} if rows is None else rows
    if tokens % documents:
        raise ValueError(f"tokens ({tokens}) must be a multiple of documents ({documents})")
    if dense and documents != 1:
        raise ValueError(f"the dense rows take one document; got documents={documents}")
    _time_rows(tokens, shape, device, dtype, dense, warmup, iters, rows, progress, documents)
    free_memory(device)  # the rows' inputs died with _time_rows
    return rows


def _time_rows(tokens: int, shape: Shape, device, dtype, dense: bool, warmup: int, iters: int,
               results: dict[str, float], progress: Progress | None, documents: int) -> None:
    q, k, v, index_q, index_k = _inputs(tokens, shape, device, dtype)
    cu_seqlens = torch.arange(0, tokens + 1, tokens // documents, dtype=torch.int32, device=device)
    blocks = dict(topk=shape.topk, block_size=shape.block_size, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)
    grad_out = torch.randn_like(q)

    def timed(name, fn):
        if progress is not None:
            progress.start(name)
        results[name] = measure(fn, device, warmup, iters).median_ms
        if progress is not None:
            progress.advance()

    def attention_step():
        attn = torch_msa.msa_attention(q, k, v, index_q.detach(), index_k.detach(), **blocks, return_lse=True,
                                       return_block_indices=True)
        attn.out.backward(grad_out)
        return attn.lse, attn.block_indices

    timed("attention step", attention_step)
    lse, block_indices = attention_step()
    lse, block_indices = lse.detach(), block_indices

    def sparse_kl():
        torch_msa.indexer_kl_loss(q.detach(), k.detach(), lse, index_q, index_k, block_indices,
                                  block_size=shape.block_size, cu_seqlens_q=cu_seqlens,
                                  cu_seqlens_k=cu_seqlens).backward()

    def sparse_kl_forward():
        with torch.no_grad():
            torch_msa.indexer_kl_loss(q.detach(), k.detach(), lse, index_q, index_k, block_indices,
                                      block_size=shape.block_size, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)

    timed("sparse KL fwd+bwd", sparse_kl)
    timed("sparse KL fwd", sparse_kl_forward)

    def step_with_kl():
        attn = torch_msa.msa_attention(q, k, v, index_q, index_k, **blocks, index_loss=True)
        # The attention step's gradient for `out`, and 1 for the loss: the same graph as
        # `(task_loss + kl).backward()` without a task loss's own work and memory.
        torch.autograd.backward((attn.out, attn.kl), (grad_out, None))

    def plain_step():
        attention_step()

    if device.type == "cuda":
        _print_peak_memory(device, tokens, plain_step, progress, "attention step")
        _print_peak_memory(device, tokens, step_with_kl, progress, "step with KL")
    timed("step with KL", step_with_kl)
    torch.use_deterministic_algorithms(True)
    try:
        timed("step with KL, deterministic", step_with_kl)
    finally:
        torch.use_deterministic_algorithms(False)
    if dense:
        def dense_kl(teacher_lse=None):
            torch_msa.indexer_kl_loss_dense(q.detach(), k.detach(), index_q, index_k, lse=teacher_lse,
                                            block_size=shape.block_size).backward()

        def sdpa_step():
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            context = torch.nn.attention.sdpa_kernel(
                [torch.nn.attention.SDPBackend.CUDNN_ATTENTION, torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                 torch.nn.attention.SDPBackend.MATH])
            with context:
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            out.backward(grad_out.transpose(0, 1).unsqueeze(0))

        timed("dense SDPA fwd+bwd", sdpa_step)
        _print_peak_memory(device, tokens, dense_kl, progress)
        timed("dense KL fwd+bwd", dense_kl)
        # The dense causal attention's lse, as a training loop that has it would pass it.
        with torch.no_grad():
            _, dense_lse, *_ = torch.ops.msa.indexer_kl(
                q, k, None, index_q, index_k, None, *_one_document(tokens, device), shape.block_size,
                shape.head_dim**-0.5, shape.index_dim**-0.5)
        timed("dense KL fwd+bwd, lse given", lambda: dense_kl(dense_lse))


def _one_document(tokens: int, device) -> tuple:
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    return cu_seqlens, cu_seqlens, tokens, tokens


def _print_peak_memory(device, tokens: int, step, progress: Progress | None = None, name: str = "dense KL fwd+bwd") -> None:
    """Run `step` (named `name`) once and print the memory it added at its peak on stdout (CUDA only)."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    peak_mib = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    line = (f"T={tokens:>6}  {name}: {peak_mib:.0f} MiB peak added ({peak_mib * 1024 / tokens:.1f} KiB per token; "
            "outputs and gradients included)")
    if progress is None:
        print(line, flush=True)
    else:
        progress.write(line, file=sys.stdout)


def _meta(args, argv, device) -> dict:
    return {
        "command": "python -m benchmarks.kl " + " ".join(argv),
        "torch_msa": torch_msa.__version__,
        "git_commit": command.git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "backends": {op: torch_msa.resolve(op, device).name
                     for op in ("forward", "indexer_kl", "indexer_kl_backward", "backward_with_index_loss")},
        "shape": {"query_heads": M3.query_heads, "kv_heads": M3.kv_heads, "head_dim": M3.head_dim,
                  "index_dim": M3.index_dim, "block_size": M3.block_size, "topk": M3.topk, "dtype": "bfloat16"},
        "documents": args.documents, "dense": args.dense, "iters": args.iters, "statistic": "median",
    }


@command.exits_on_interrupt
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=command.at_least(1), nargs="+", default=[32768, 65536],
                        help="tokens (one document)")
    parser.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    parser.add_argument("--documents", type=command.at_least(1), default=1,
                        help="pack each length as this many equal documents (sparse rows only)")
    parser.add_argument("--dense", action="store_true", help="also time the dense warm-up loss against SDPA")
    parser.add_argument("--iters", type=command.at_least(1), default=10)
    parser.add_argument("--out", default="bench_out", help="directory of kl.json (default: bench_out)")
    args = parser.parse_args(argv)
    uneven = [tokens for tokens in args.seqlen if tokens % args.documents]
    if uneven:
        parser.error(f"argument --seqlen: expected multiples of --documents {args.documents}, got {uneven}")
    if args.dense and args.documents != 1:
        parser.error(f"argument --documents: expected 1 with --dense (the dense rows take one document), "
                     f"got {args.documents}")
    device = command.device(parser, args.device)
    command.output_directory(parser, args.out)
    meta = _meta(args, argv, device)
    print("backends:", meta["backends"])
    path = os.path.join(args.out, "kl.json")
    record: dict = {"status": RUNNING, "partial": True, "meta": meta, "lengths": []}
    names = SPARSE_ROWS + (DENSE_ROWS if args.dense else ())

    def run():
        for index, tokens in enumerate(args.seqlen, 1):
            rows: dict[str, float] = {}
            record["lengths"].append({"tokens": tokens, "documents": args.documents, "rows_ms": rows})
            with Progress(f"[{index}/{len(args.seqlen)}] T={tokens}", len(names)) as progress:
                measure_kl(tokens, device=device, dense=args.dense, iters=args.iters, rows=rows, progress=progress,
                           documents=args.documents)
            _print_rows(tokens, rows)
            write_record(path, record)  # after every length, so a run that is killed keeps what it measured

    code = run_recorded(path, record, run)
    if code == 0:
        print(f"wrote {path}")
    return code


def _print_rows(tokens: int, results: dict[str, float]) -> None:
    step, sdpa = results["attention step"], results.get("dense SDPA fwd+bwd")
    for name, ms in results.items():
        share = ""
        if name == "sparse KL fwd+bwd":
            share = f"  {100 * ms / step:5.1f}% of the attention step (target <= 20%)"
        elif name == "step with KL":
            share = f"  {ms / step:5.2f}x the attention step (target <= 1.15x)"
        elif name == "step with KL, deterministic":
            fused = results.get("step with KL")
            share = f"  {100 * fused / ms:5.1f}% of the default's speed (target >= 50%)" if fused else ""
        elif name.startswith("dense KL"):
            share = f"  {ms / sdpa:5.2f}x dense SDPA fwd+bwd (target <= 3x)"
        print(f"T={tokens:>6}  {name:<28} {ms:10.2f} ms{share}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
