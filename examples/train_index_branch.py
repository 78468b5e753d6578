"""Train both branches of a tiny MiniMax-M3 (HF transformers, random weights) with torch_msa's KL loss.

    pip install ".[hf]"                              # from a checkout of torch_msa
    python examples/train_index_branch.py            # CUDA when present, else CPU
    python examples/train_index_branch.py --device cpu --warmup-steps 5 --steps 5

The MSA recipe (spec section 6) in two stages, on the toy model of `train_tiny_m3.py`:

1. Dense warm-up: `use_torch_msa(model, index_loss="dense")`. The sparse layers attend densely,
   and each one's KL (`torch_msa.indexer_kl_loss_dense`) teaches its indexer the dense attention's
   distribution over every visible key. Only the indexers are optimised; the trunk is frozen.
2. Sparse training: `use_torch_msa(model, index_loss="sparse")`. The sparse layers attend to the
   blocks their indexers select, and the loss is `task_loss + kl_coeff * sum(index_losses(model))`,
   the KL taken on the selected blocks. The indexers read detached hidden states, so the task
   loss trains the trunk and the KL the indexers. In training each layer's KL is computed by its
   attention's backward (on Hopper inside the attention backward kernel), so its value is read
   after `backward()`, with `index_loss_values(model)`.
"""

import argparse

import torch
from train_tiny_m3 import tiny_config
from transformers import MiniMaxM3VLForCausalLM

from torch_msa.integrations.transformers import index_loss_values, index_losses, use_torch_msa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device to train on (default: cuda if available, else cpu)")
    parser.add_argument("--warmup-steps", type=int, default=10, help="stage 1: dense warm-up steps (default: 10)")
    parser.add_argument("--steps", type=int, default=10, help="stage 2: sparse training steps (default: 10)")
    parser.add_argument("--seqlen", type=int, default=512, help="tokens of each sequence (default: 512)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (default: 2)")
    parser.add_argument("--kl-coeff", type=float, default=1.0, help="the KL's weight in stage 2's loss (default: 1.0)")
    args = parser.parse_args()
    vocab_size = 256
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(tiny_config(vocab_size)).to(args.device).train()

    # Synthetic data: each sequence repeats a random motif, so the task loss can fall.
    motif = torch.randint(1, vocab_size, (args.batch, 48))
    ids = motif.repeat(1, args.seqlen // 48 + 1)[:, : args.seqlen].to(args.device)

    index_parameters = [p for name, p in model.named_parameters() if ".indexer." in name]
    trunk_parameters = [p for name, p in model.named_parameters() if ".indexer." not in name]
    index_optimizer = torch.optim.AdamW(index_parameters, lr=1e-2)

    # Stage 1: only the KL, only the indexers (the hidden states they read are detached, so the
    # trunk gets no gradient and needs no freezing beyond not being optimised).
    use_torch_msa(model, index_loss="dense")
    for step in range(args.warmup_steps):
        model(input_ids=ids)
        kl = sum(index_losses(model))  # one KL per sparse layer
        index_optimizer.zero_grad(set_to_none=True)
        kl.backward()
        index_optimizer.step()
        print(f"stage 1 (dense warm-up)  step {step:3d}  kl {kl.item():.4f}", flush=True)

    # Stage 2: the task loss trains the trunk, the KL on the selected blocks the indexers.
    use_torch_msa(model, index_loss="sparse")
    trunk_optimizer = torch.optim.AdamW(trunk_parameters, lr=3e-3)
    for step in range(args.steps):
        task_loss = model(input_ids=ids, labels=ids).loss
        kl = sum(index_losses(model))
        trunk_optimizer.zero_grad(set_to_none=True)
        index_optimizer.zero_grad(set_to_none=True)
        (task_loss + args.kl_coeff * kl).backward()
        trunk_optimizer.step()
        index_optimizer.step()
        kl_value = sum(index_loss_values(model)).item()  # written by the backward
        print(f"stage 2 (sparse)  step {step:3d}  loss {task_loss.item():.4f}  kl {kl_value:.4f}", flush=True)


if __name__ == "__main__":
    main()
