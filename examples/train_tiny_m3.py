"""Train a tiny MiniMax-M3 (HF transformers, random weights, synthetic tokens) with torch_msa.

    pip install ".[hf]"                         # from a checkout of torch_msa
    python examples/train_tiny_m3.py            # CUDA when present, else CPU
    python examples/train_tiny_m3.py --device cpu --steps 5

    python examples/train_tiny_m3.py --packed   # padding-free: HF's DataCollatorWithFlattening

The model is HF's `MiniMaxM3VLForCausalLM` at a toy size: one sparse (MSA) layer and one
full-attention layer, head dim 64, blocks of 64 keys, top-2 blocks. `use_torch_msa` switches it to
torch_msa; the rest is an ordinary training loop over a right-padded batch, or with `--packed`
over one row of documents packed back to back by HF's `DataCollatorWithFlattening`, whose packed
kwargs (`cu_seq_lens_q/k`, `max_length_q/k`) keep the documents apart.
"""

import argparse

import torch
from transformers import DataCollatorWithFlattening, MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

from torch_msa.integrations.transformers import use_torch_msa


def tiny_config(vocab_size: int) -> MiniMaxM3VLTextConfig:
    return MiniMaxM3VLTextConfig(
        vocab_size=vocab_size, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "sparse"],
        dense_intermediate_size=256, intermediate_size=64, shared_intermediate_size=64, num_local_experts=4,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=64, index_block_size=64, index_topk_blocks=2,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, use_cache=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device to train on (default: cuda if available, else cpu)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps, one loss line each (default: 10)")
    parser.add_argument("--seqlen", type=int, default=512,
                        help="tokens of the longest sequence; sequence i has 100 * i fewer (default: 512)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default: 2)")
    parser.add_argument("--packed", action="store_true", help="pack the sequences into one padding-free row")
    args = parser.parse_args()
    if args.seqlen - 100 * (args.batch - 1) < 1:
        parser.error(f"argument --seqlen: expected more than 100 * (--batch - 1) = {100 * (args.batch - 1)} tokens, "
                     f"so that every sequence has one, got {args.seqlen}")
    vocab_size = 256
    torch.manual_seed(0)

    model = MiniMaxM3VLForCausalLM(tiny_config(vocab_size)).to(args.device)
    model = use_torch_msa(model)  # the drop-in: torch_msa's selection and sparse attention
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # Synthetic data: each sequence repeats a random motif, so the loss can fall; sequence `row` is
    # 100 * row tokens shorter than the first.
    motif = torch.randint(1, vocab_size, (args.batch, 48))
    ids = motif.repeat(1, args.seqlen // 48 + 1)[:, : args.seqlen]
    lengths = [args.seqlen - 100 * row for row in range(args.batch)]
    if args.packed:
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
            [{"input_ids": ids[row, :length].tolist()} for row, length in enumerate(lengths)])
    else:  # right-padded rows
        mask = (torch.arange(args.seqlen) < torch.tensor(lengths)[:, None]).long()
        batch = {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    batch = {name: x.to(args.device) if isinstance(x, torch.Tensor) else x for name, x in batch.items()}

    model.train()
    for step in range(args.steps):
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
