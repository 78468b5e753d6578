"""Training-step time and peak memory of HF's MiniMax-M3: its sdpa path against torch_msa.

A few-layer `MiniMaxM3VLForCausalLM` with M3 attention shapes (64 query heads, 4 KV heads, head
dim 128, index 4 x 128, block 128, top-16; sparse layers and one full-attention layer), random
weights, one sequence of each length, bf16, on one CUDA device. A step is forward + backward
(loss: the mean of the logits); each path is timed with CUDA events (median of `--steps` after
one warm-up). A path that runs out of memory is recorded as OOM.

    python examples/compare_hf_step.py                       # 8K, 32K, 64K tokens
    python examples/compare_hf_step.py --seqlens 8192 --layers 2 --json out.json

HF's sdpa path builds a dense `[B, 64, S, S]` mask and `[B, 4, S, S]` fp32 index scores in
every sparse layer, so its memory grows as S^2; torch_msa's stays O(S).
"""

import argparse
import copy
import json
import pathlib
import statistics
import sys

import torch

# The repository root, for the benchmark's `git_commit` (the `benchmarks` package is not installed).
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def build_model(layers: int, hidden: int, vocab: int):
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    config = MiniMaxM3VLTextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, layer_types=["minimax_m3_sparse"] * (layers - 1) + ["full_attention"],
        mlp_layer_types=["dense"] * layers, dense_intermediate_size=2 * hidden, index_n_heads=4, index_head_dim=128,
        index_block_size=128, index_topk_blocks=16, max_position_embeddings=1 << 20,
        attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None, use_cache=False,
    )
    torch.manual_seed(0)
    return MiniMaxM3VLForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def measure(model, seqlen: int, steps: int, vocab: int) -> dict:
    ids = torch.randint(0, vocab, (1, seqlen), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        model(ids).logits.float().mean().backward()

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, out_of_memory = [], False
    try:
        step()  # warm-up (compiles the kernels)
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    except torch.OutOfMemoryError:
        out_of_memory = True  # freed below, once the exception no longer holds the frames
    peak = torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    if out_of_memory:
        return {"status": "OOM", "peak_gib_before_oom": peak / 2**30}
    return {"status": "ok", "step_ms": statistics.median(times), "peak_gib": peak / 2**30}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768, 65536],
                        help="tokens per step, one case each (default: 8192 32768 65536)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers, the last one full attention (default 4)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case (default 3)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("compare_hf_step.py needs a CUDA device", file=sys.stderr)
        return 2

    import torch_msa
    from torch_msa.integrations.transformers import use_torch_msa

    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks.cli import git_commit

    hf = build_model(args.layers, args.hidden, args.vocab)
    paths = {"hf sdpa": hf, "torch_msa": use_torch_msa(copy.deepcopy(hf))}
    results = []
    print(f"{'tokens':>8} {'path':>10} {'step ms':>10} {'peak GiB':>9}")
    for seqlen in args.seqlens:
        for name, model in paths.items():
            row = {"seqlen": seqlen, "path": name, **measure(model, seqlen, args.steps, args.vocab)}
            results.append(row)
            if row["status"] == "ok":
                print(f"{seqlen:>8} {name:>10} {row['step_ms']:>10.1f} {row['peak_gib']:>9.2f}", flush=True)
            else:
                print(f"{seqlen:>8} {name:>10} {'OOM':>10} {'':>9}", flush=True)
    if args.json:
        meta = {"torch_msa": torch_msa.__version__, "git_commit": git_commit(), "torch": torch.__version__,
                "device": torch.cuda.get_device_name(),
                "layers": args.layers, "hidden": args.hidden}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
