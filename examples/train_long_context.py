"""Train a small MSA language model on real long documents: dense, sparse and a fixed-selection control.

    python examples/train_long_context.py --out run                  # H200: the documented run
    python examples/train_long_context.py --out run                  # again: continues where it stopped
    python examples/train_long_context.py --out run --report         # JSON summary and plot of a run
    python examples/train_long_context.py --out tiny --tiny --device cpu   # every arm, a few minutes on a CPU

The model is a byte-level decoder of our own, inside the kernels' contract: 16 query heads over one KV
head of dim 128 per layer, blocks of 128 keys, top-16, one index head per KV head (index_q and
index_k read the detached hidden states, as in MiniMax-M3). Three arms share the data order, the
seed, the optimizers and the schedule:

* `dense`: dense causal attention (cuDNN SDPA) throughout;
* `sparse`: steps 0..W dense attention, the trunk on the task loss and the index branch on
  `torch_msa.indexer_kl_loss_dense`; from W, `torch_msa.msa_attention(..., index_loss=True)`
  (the index branch's KL fused into the attention backward);
* `control`: the same sparse model from W on a fixed selection (block 0 and the newest blocks), no
  index branch.

Steps 0..W are run once and shared: the dense arm's trunk does not see the index branch (its
inputs are detached), so the arms branch at W from one checkpoint. Every `--eval-every` steps each
arm reports its held-out loss by position, and the sparse arm the index branch's recall: the share
of the dense attention mass (on sampled held-out queries) that falls in the selected blocks, next
to the control selection's recall on the same queries. At the end the sparse arm's selections on
the held-out documents are summarised (`torch_msa.selection_stats`) and saved for the benchmark's
`trained` regime (`python -m benchmarks.trained_selection OUT/selections.pt`).

A run keeps its state in `--out`: with `--time-budget` it stops cleanly before the budget runs out
(exit status 3) and the same command continues it.
"""

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from long_context_data import VOCAB_SIZE, Corpus, dataset_sources, folder_sources, load_hf_dataset, package_sources, split_corpus
from torch import nn

import torch_msa
from torch_msa.contract import M3, Shape
from torch_msa.selection_stats import POSITION_EDGES, position_bucket_names, selection_sharing
from torch_msa.testing import skewed_block_indices

ARMS = ("dense", "sparse", "control")
INCOMPLETE = 3  # exit status of a run stopped by --time-budget
LOG_EVERY = 5  # steps between synchronised progress lines


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The decoder: `layers` blocks of width `hidden`, each one MSA layer of `attention`'s shape
    (16 query heads over one KV head, M3's head dim, blocks and top-k) and a SwiGLU MLP."""

    hidden: int = 1024
    layers: int = 4
    mlp_hidden: int = 2816
    rope_base: float = 500_000.0
    attention: Shape = dataclasses.replace(M3, query_heads=16, kv_heads=1)


TINY = ModelConfig(hidden=64, layers=2, mlp_hidden=128,
                   attention=Shape(query_heads=16, kv_heads=1, head_dim=64, index_dim=32, block_size=64, topk=4))


@dataclasses.dataclass
class Batch:
    """Packed documents of one step: tokens int64 `[T]`, cu_seqlens int32 `[B + 1]`."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    position: torch.Tensor  # int64 [T], position inside the document
    targets: torch.Tensor  # int64 [T], the next token, -100 at each document's last token
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]]
    fixed_selection: torch.Tensor | None = None

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    def documents(self) -> tuple:
        return self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen


def make_batch(documents: list[torch.Tensor], config: ModelConfig, device: torch.device) -> Batch:
    tokens = torch.cat(documents).to(device=device, dtype=torch.int64, non_blocking=True)
    lengths = tuple(len(d) for d in documents)
    cu_seqlens = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    position = torch.cat([torch.arange(length) for length in lengths]).to(device)
    targets = torch.roll(tokens, -1).masked_fill(torch.roll(position, -1) == 0, -100)
    rope = {}
    for dim in {config.attention.head_dim, config.attention.index_dim}:
        inverse = config.rope_base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        angle = position.float()[:, None] * inverse[None, :]
        rope[dim] = (angle.cos()[:, None, :], angle.sin()[:, None, :])  # [T, 1, dim / 2]
    return Batch(tokens, cu_seqlens, lengths, position, targets, rope)


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """Causal SDPA per document (one batched call when the documents are equal), cuDNN on CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def heads_first(x):
        if len(set(lengths)) == 1:
            return [x.view(len(lengths), lengths[0], *x.shape[1:]).transpose(1, 2)]
        return [part.unsqueeze(0).transpose(1, 2) for part in x.split(list(lengths))]

    backends = [SDPBackend.CUDNN_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        outs = [F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                for qs, ks, vs in zip(heads_first(q), heads_first(k), heads_first(v))]
    return torch.cat([o.transpose(1, 2).reshape(-1, *q.shape[1:]) for o in outs])


class Layer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = self.config = config
        a = config.attention
        self.attention_norm = nn.RMSNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, (a.query_heads + 2 * a.kv_heads) * a.head_dim, bias=False)
        self.attention_out = nn.Linear(a.query_heads * a.head_dim, c.hidden, bias=False)
        self.index = nn.Linear(c.hidden, (a.kv_heads + 1) * a.index_dim, bias=False)  # index_q heads, one index_k
        self.mlp_norm = nn.RMSNorm(c.hidden)
        self.gate_up = nn.Linear(c.hidden, 2 * c.mlp_hidden, bias=False)
        self.down = nn.Linear(c.mlp_hidden, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, batch: Batch, mode: str, index_loss: str | None, record: dict) -> torch.Tensor:
        a = self.config.attention
        h = self.attention_norm(x)
        q, k, v = self.qkv(h).split([a.query_heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim], -1)
        q = rotate(q.view(-1, a.query_heads, a.head_dim), batch.rope[a.head_dim])
        k = rotate(k.view(-1, a.kv_heads, a.head_dim), batch.rope[a.head_dim])
        v = v.view(-1, a.kv_heads, a.head_dim)
        index_q = index_k = None
        if index_loss is not None or mode == "sparse" or "index" in record:
            iq, ik = self.index(h.detach()).split([a.kv_heads * a.index_dim, a.index_dim], -1)
            index_q = rotate(iq.view(-1, a.kv_heads, a.index_dim), batch.rope[a.index_dim])
            index_k = rotate(ik.view(-1, 1, a.index_dim), batch.rope[a.index_dim])
        if mode == "dense":
            out = dense_attention(q, k, v, batch.lengths)
            if index_loss == "dense":
                record["kl"].append(torch_msa.indexer_kl_loss_dense(q.detach(), k.detach(), index_q, index_k,
                                                                    *batch.documents(), block_size=a.block_size))
        elif mode == "sparse" and index_loss == "sparse":
            attention = torch_msa.msa_attention(q, k, v, index_q, index_k, *batch.documents(), topk=a.topk,
                                                block_size=a.block_size, index_loss=True)
            out = attention.out
            record["kl"].append(attention.kl)
            record["kl_values"].append(attention.kl_value)  # written by the backward
        elif mode == "sparse":
            out = torch_msa.msa_attention(q, k, v, index_q, index_k, *batch.documents(), topk=a.topk, block_size=a.block_size)
        elif mode == "control":
            out = torch_msa.sparse_attention(q, k, v, batch.fixed_selection, *batch.documents(), block_size=a.block_size)
        else:
            raise ValueError(f"mode: expected dense, sparse or control, got {mode!r}")
        if "index" in record:
            record["index"].append((q.detach(), k.detach(), index_q.detach(), index_k.detach()))
        x = x + self.attention_out(out.reshape(-1, a.query_heads * a.head_dim))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(VOCAB_SIZE, config.hidden)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.hidden)
        self.head = nn.Linear(config.hidden, VOCAB_SIZE, bias=False)
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2:
                std = 0.02 / math.sqrt(2 * config.layers) if name.endswith(("attention_out.weight", "down.weight")) else 0.02
                nn.init.normal_(parameter, std=std)

    def forward(self, batch: Batch, mode: str, index_loss: str | None = None, record: dict | None = None) -> torch.Tensor:
        record = {"kl": [], "kl_values": []} if record is None else record
        x = self.embedding(batch.tokens)
        for layer in self.layers:
            x = layer(x, batch, mode, index_loss, record)
        return self.head(self.norm(x)).float()

    def index_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if ".index." in name]

    def trunk_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if ".index." not in name]


@dataclasses.dataclass
class Settings:
    out: Path
    device: torch.device
    config: ModelConfig
    seqlen: int
    docs_per_step: int
    steps: int
    warmup_steps: int
    eval_every: int
    eval_documents: int
    recall_queries: int
    lr: float
    index_lr: float
    kl_coeff: float
    seed: int
    time_budget: float | None
    arms: tuple[str, ...]


def learning_rate(settings: Settings, step: int, peak: float) -> float:
    warm = max(1, settings.steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, settings.steps - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def data_order(corpus: Corpus, settings: Settings, step: int) -> list[torch.Tensor]:
    """The documents of `step`: one seeded shuffle per pass over the training documents, the same for every arm."""
    per_pass = len(corpus.train) // settings.docs_per_step
    if per_pass == 0:
        raise ValueError(f"--docs-per-step: expected at most {len(corpus.train)} (the training documents), "
                         f"got {settings.docs_per_step}")
    epoch, index = divmod(step, per_pass)
    order = torch.randperm(len(corpus.train), generator=torch.Generator().manual_seed(settings.seed + epoch))
    chosen = order[index * settings.docs_per_step:(index + 1) * settings.docs_per_step]
    return [corpus.train[i].tokens for i in chosen.tolist()]


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def token_losses(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    return F.cross_entropy(logits, batch.targets, ignore_index=-100, reduction="none")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Arm:
    """One arm's model, optimizers and history, saved to and resumed from `out/<name>.pt`."""

    def __init__(self, name: str, settings: Settings, state: dict | None = None):
        self.name, self.settings = name, settings
        torch.manual_seed(settings.seed)
        self.model = Model(settings.config).to(settings.device)
        self.trunk_optimizer = torch.optim.AdamW(self.model.trunk_parameters(), lr=settings.lr, betas=(0.9, 0.95),
                                                 weight_decay=0.1, fused=settings.device.type == "cuda")
        self.index_optimizer = torch.optim.AdamW(self.model.index_parameters(), lr=settings.index_lr, betas=(0.9, 0.95),
                                                 weight_decay=0.0)
        self.step, self.train_seconds, self.history, self.evals, self.notes = 0, 0.0, [], [], []
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.trunk_optimizer.load_state_dict(state["trunk_optimizer"])
            self.index_optimizer.load_state_dict(state["index_optimizer"])
            self.step, self.train_seconds = state["step"], state["train_seconds"]
            # Arms branch from one warm-up state: each takes its own copy of the records.
            self.history, self.evals, self.notes = (copy.deepcopy(state[key]) for key in ("history", "evals", "notes"))

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "trunk_optimizer": self.trunk_optimizer.state_dict(),
                "index_optimizer": self.index_optimizer.state_dict(), "step": self.step,
                "train_seconds": self.train_seconds, "history": self.history, "evals": self.evals, "notes": self.notes}

    def mode(self) -> tuple[str, str | None]:
        """(attention, index loss) of the next step."""
        if self.step < self.settings.warmup_steps:
            return "dense", "dense"
        return {"dense": ("dense", None), "sparse": ("sparse", "sparse"), "control": ("control", None)}[self.name]

    def train_step(self, batch: Batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        mode, index_loss = self.mode()
        for optimizer, peak in ((self.trunk_optimizer, self.settings.lr), (self.index_optimizer, self.settings.index_lr)):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(self.settings, self.step, peak)
        record = {"kl": [], "kl_values": []}
        with autocast(self.settings.device):
            logits = self.model(batch, mode, index_loss, record)
        losses = token_losses(logits, batch)
        loss = losses.sum() / (batch.targets >= 0).sum()
        total = loss + self.settings.kl_coeff * sum(record["kl"]) if record["kl"] else loss
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.model.trunk_parameters(), 1.0)
        self.trunk_optimizer.step()
        if index_loss is not None:
            self.index_optimizer.step()
        self.trunk_optimizer.zero_grad(set_to_none=True)
        self.index_optimizer.zero_grad(set_to_none=True)
        self.step += 1
        kl = record["kl_values"] if index_loss == "sparse" else [value.detach() for value in record["kl"]]
        return loss.detach(), kl


def evaluate(arm: Arm, corpus: Corpus, settings: Settings, final: bool) -> dict:
    """Held-out loss by position bucket; for arms with an index branch its recall (and at the end
    the selection statistics and the selections themselves)."""
    model, config, device = arm.model, settings.config, settings.device
    batch = make_batch([d.tokens for d in corpus.held_out], config, device)
    mode, _ = arm.mode()
    with_index = arm.name == "sparse" or arm.step <= settings.warmup_steps
    if mode == "control":
        batch.fixed_selection = fixed_selection(batch, config.attention)
    record = {"kl": [], "kl_values": []}
    if with_index:
        record["index"] = []
    model.eval()
    with torch.no_grad(), autocast(device):
        losses = token_losses(model(batch, mode, None, record), batch)
    model.train()
    counted = batch.targets >= 0
    edges = torch.tensor(POSITION_EDGES, device=device)
    bucket = torch.bucketize(batch.position, edges, right=True)
    names = position_bucket_names()
    result = {"step": arm.step, "held_out_loss": float(losses[counted].mean()),
              "by_position": {name: float(losses[counted & (bucket == i)].mean()) if (counted & (bucket == i)).any()
                              else None for i, name in enumerate(names)}}
    if with_index:
        selections = [select(batch, config.attention, index_q, index_k) for _, _, index_q, index_k in record["index"]]
        result["recall"] = recall(batch, config.attention, record["index"], selections, settings)
        if final:
            result["selection"] = [{"group_8": selection_sharing(s, batch.cu_seqlens, group_size=8,
                                                                 block_size=config.attention.block_size).as_dict(),
                                    "tile_128": selection_sharing(s, batch.cu_seqlens, group_size=128,
                                                                  block_size=config.attention.block_size).as_dict()}
                                   for s in selections]
            torch.save({"block_indices": torch.stack(selections).to(torch.int16).cpu(),
                        "cu_seqlens": batch.cu_seqlens.cpu(), "layers": config.layers, "block_size": config.attention.block_size,
                        "topk": config.attention.topk, "documents": corpus.manifest["held_out"], "step": arm.step},
                       settings.out / "selections.pt")
    return result


def select(batch: Batch, shape: Shape, index_q: torch.Tensor, index_k: torch.Tensor) -> torch.Tensor:
    return torch_msa.select_blocks(index_q, index_k, *batch.documents(), topk=shape.topk, block_size=shape.block_size)


def fixed_selection(batch: Batch, shape: Shape) -> torch.Tensor:
    """Block 0 and the newest blocks of every query: the control arm's selection."""
    return skewed_block_indices(batch.cu_seqlens, batch.cu_seqlens, shape.kv_heads, shape.topk, shape.block_size)


def recall(batch: Batch, shape: Shape, captured: list, selections: list[torch.Tensor], settings: Settings) -> dict:
    """Share of the dense attention mass in the selected blocks, on sampled queries past the dense
    prefix: per layer for the index selection, the control selection and the best `topk` blocks."""
    group = shape.group
    control = fixed_selection(batch, shape)
    generator = torch.Generator().manual_seed(settings.seed)
    sampled = []  # (document start, length, local positions of its sampled queries)
    for start, length in zip(batch.cu_seqlens[:-1].tolist(), batch.lengths):
        first = min(shape.topk * shape.block_size, length - 1)
        local = first + torch.randperm(length - first, generator=generator)[:settings.recall_queries]
        sampled.append((start, length, local.to(settings.device)))
    per_layer: dict[str, list[float]] = {"index": [], "control": [], "best": []}
    for (q, k, _, _), selection in zip(captured, selections):
        sums = dict.fromkeys(per_layer, 0.0)
        count = 0
        for start, length, local in sampled:
            keys = k[start:start + length].float()  # [L, Hkv, D]
            blocks = -(-length // shape.block_size)
            for chunk in local.split(16):
                rows = start + chunk
                scores = torch.einsum("nrgd,srd->nrgs", q[rows].float().view(len(chunk), shape.kv_heads, group, -1),
                                      keys) * shape.head_dim ** -0.5
                visible = torch.arange(length, device=keys.device)[None, :] <= chunk[:, None]
                mass = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1).mean(2)
                mass = F.pad(mass, (0, blocks * shape.block_size - length)).view(len(chunk), shape.kv_heads, blocks, -1).sum(-1)
                for name, chosen in (("index", selection[:, rows]), ("control", control[:, rows])):
                    ids = chosen.transpose(0, 1).long()  # [n, Hkv, topk]
                    sums[name] += float((torch.gather(mass, 2, ids.clamp(min=0)) * (ids >= 0)).sum())
                sums["best"] += float(mass.topk(min(shape.topk, blocks), dim=-1).values.sum())
                count += len(chunk) * shape.kv_heads
        for name in per_layer:
            per_layer[name].append(sums[name] / count)
    return {name: {"per_layer": values, "mean": sum(values) / len(values)} for name, values in per_layer.items()}


def log(settings: Settings, text: str) -> None:
    print(text, flush=True)
    with open(settings.out / "log.txt", "a") as file:
        file.write(text + "\n")


def served_backends(device: torch.device) -> dict[str, str]:
    served = {}
    for op in ("select_blocks", "plan", "forward", "backward", "backward_with_index_loss", "indexer_kl"):
        try:
            served[op] = torch_msa.resolve(op, device).name
        except torch_msa.BackendError as error:
            served[op] = f"none ({error})"
    return served


def run_arm(arm: Arm, corpus: Corpus, settings: Settings, deadline: float | None, stop_step: int) -> bool:
    """Train `arm` from its step to `stop_step`; False when the deadline stopped it first.

    Training seconds count from one synchronised point to the next (every `LOG_EVERY` steps), data
    loading included, evaluations excluded."""
    device = settings.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens_per_step = settings.seqlen * settings.docs_per_step
    pending: list = []
    step_seconds = None
    fixed = None
    start_step = arm.step
    if arm.step < stop_step:
        compile_kernels(arm, corpus, settings)
    synchronize(device)
    window = time.perf_counter()
    while arm.step < stop_step:
        if deadline is not None:
            # Room for a window of steps, its evaluation and the checkpoint, once a step has been timed.
            needed = 0.0 if step_seconds is None else (LOG_EVERY + 2) * step_seconds + 30
            if time.time() + needed > deadline:
                return False
        batch = make_batch(data_order(corpus, settings, arm.step), settings.config, device)
        if arm.mode()[0] == "control":
            fixed = fixed if fixed is not None else fixed_selection(batch, settings.config.attention)
            batch.fixed_selection = fixed
        loss, kl = arm.train_step(batch)
        pending.append((arm.step, loss, kl))
        evaluate_now = arm.step % settings.eval_every == 0 or arm.step == stop_step
        if not (evaluate_now or arm.step % LOG_EVERY == 0):
            continue
        synchronize(device)
        elapsed = time.perf_counter() - window
        arm.train_seconds += elapsed
        step_seconds = elapsed / len(pending)
        for step, loss_value, kl_values in pending:
            arm.history.append({"step": step, "tokens": step * tokens_per_step, "loss": float(loss_value),
                                "kl": [float(v) for v in kl_values], "seconds": arm.train_seconds})
        pending.clear()
        entry = arm.history[-1]
        rate = tokens_per_step / step_seconds
        kl_text = f"  kl {sum(entry['kl']):.4f}" if entry["kl"] else ""
        memory = f"  peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
        label = arm.name if arm.step > settings.warmup_steps else "warm-up"
        log(settings, f"[{label}] step {arm.step}/{stop_step}  loss {entry['loss']:.4f}{kl_text}  "
                      f"{rate / 1e3:.1f}K tokens/s  {arm.train_seconds:.0f} s trained, "
                      f"~{(stop_step - arm.step) * tokens_per_step / rate:.0f} s left{memory}")
        if evaluate_now:
            result = evaluate(arm, corpus, settings, final=arm.step == settings.steps and arm.name == "sparse")
            arm.evals.append(result)
            recall_text = (f"  recall {result['recall']['index']['mean']:.3f} (control {result['recall']['control']['mean']:.3f})"
                           if "recall" in result else "")
            log(settings, f"[{label}] eval at step {arm.step}: held-out loss {result['held_out_loss']:.4f} "
                          f"{result['by_position']}{recall_text}")
        synchronize(device)
        window = time.perf_counter()
    if device.type == "cuda":
        arm.notes.append({"steps": [start_step, stop_step], "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30})
    return True


def compile_kernels(arm: Arm, corpus: Corpus, settings: Settings) -> None:
    """One untimed forward and backward of the arm's next step, gradients dropped: the kernels'
    just-in-time compilation stays out of the training time."""
    batch = make_batch(data_order(corpus, settings, arm.step), settings.config, settings.device)
    mode, index_loss = arm.mode()
    if mode == "control":
        batch.fixed_selection = fixed_selection(batch, settings.config.attention)
    record = {"kl": [], "kl_values": []}
    with autocast(settings.device):
        logits = arm.model(batch, mode, index_loss, record)
    (token_losses(logits, batch).mean() + sum(record["kl"])).backward()
    arm.model.zero_grad(set_to_none=True)


def dense_attention_rate(arm: Arm, corpus: Corpus, settings: Settings) -> dict:
    """The dense arm's attention kernels in one training step's forward and backward, profiled: their
    time and TF/s (causal pairs, `4 Hq D` FLOPs a pair forward, 2.5x that backward, as the benchmark
    counts them). The gradients are dropped, so the arm's state does not change."""
    from torch.profiler import ProfilerActivity, profile

    config, device = settings.config, settings.device
    batch = make_batch(data_order(corpus, settings, arm.step), config, device)
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        with autocast(device):
            logits = arm.model(batch, "dense")
        token_losses(logits, batch).mean().backward()
        synchronize(device)
    arm.model.zero_grad(set_to_none=True)
    kernels = {event.key: event.device_time_total for event in profiler.key_averages()
               if "sdpa" in event.key.lower() or "fmha" in event.key.lower() or "flash" in event.key.lower()}
    pairs = sum(length * (length + 1) // 2 for length in batch.lengths) * config.layers
    flops = 3.5 * 4 * config.attention.query_heads * config.attention.head_dim * pairs
    seconds = sum(kernels.values()) / 1e6
    return {"kernels": sorted(kernels), "milliseconds": seconds * 1e3,
            "tflops_per_second": flops / seconds / 1e12 if seconds else None}


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def load_corpus(args, settings: Settings) -> Corpus:
    if args.corpus == "packages":
        sources = package_sources()
    elif args.corpus.startswith("hf:"):
        sources = dataset_sources(load_hf_dataset(args.corpus), args.corpus[3:], args.text_field)
    else:
        sources = folder_sources(args.corpus)
    return split_corpus(sources, settings.seqlen, settings.eval_documents)


def train(args, settings: Settings) -> int:
    settings.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + settings.time_budget if settings.time_budget else None
    corpus = load_corpus(args, settings)
    meta_path = settings.out / "meta.json"
    if not meta_path.exists():
        meta = {"git_sha": git_sha(), "torch": torch.__version__, "torch_msa": torch_msa.__version__,
                "python": platform.python_version(), "device": torch.cuda.get_device_name(settings.device)
                if settings.device.type == "cuda" else platform.processor() or "cpu",
                "config": dataclasses.asdict(settings.config),
                "settings": {k: str(v) if isinstance(v, (Path, torch.device)) else v
                             for k, v in dataclasses.asdict(settings).items() if k != "config"},
                "parameters": sum(p.numel() for p in Model(settings.config).parameters()),
                "served": served_backends(settings.device), "corpus": corpus.manifest}
        meta_path.write_text(json.dumps(meta, indent=1))
    torch.backends.cuda.matmul.allow_tf32 = True
    caught: list[str] = []
    default_showwarning = warnings.showwarning

    def record_warning(message, category, *rest):
        if issubclass(category, torch_msa.TorchMSAWarning) and str(message) not in caught:
            caught.append(str(message))
            log(settings, f"torch_msa warning: {message}")
        default_showwarning(message, category, *rest)

    warnings.showwarning = record_warning
    try:
        return _train(corpus, settings, deadline, caught)
    finally:
        warnings.showwarning = default_showwarning


def _train(corpus: Corpus, settings: Settings, deadline: float | None, caught: list[str]) -> int:
    log(settings, "backends: " + "  ".join(f"msa::{op}={name}" for op, name in served_backends(settings.device).items()))
    log(settings, f"corpus: {corpus.manifest['bytes'] / 1e6:.1f} MB in {len(corpus.manifest['sources'])} sources, "
                  f"{len(corpus.train)} training and {len(corpus.held_out)} held-out documents of {settings.seqlen} tokens")
    shared = settings.out / "warmup.pt"
    if shared.exists():
        warm = torch.load(shared, weights_only=False)
    else:
        arm = Arm("sparse", settings, torch.load(settings.out / "warmup_partial.pt", weights_only=False)
                  if (settings.out / "warmup_partial.pt").exists() else None)
        if not arm.evals:
            arm.evals.append(evaluate(arm, corpus, settings, final=False))
        complete = run_arm(arm, corpus, settings, deadline, settings.warmup_steps)
        torch.save(arm.state(), settings.out / ("warmup.pt" if complete else "warmup_partial.pt"))
        if not complete:
            log(settings, f"stopped before the time budget at warm-up step {arm.step}: run the same command to continue")
            return INCOMPLETE
        warm = arm.state()
    for name in settings.arms:
        path = settings.out / f"{name}.pt"
        result_path = settings.out / f"{name}.json"
        if result_path.exists() and json.loads(result_path.read_text()).get("complete"):
            continue
        arm = Arm(name, settings, torch.load(path, weights_only=False) if path.exists() else warm)
        log(settings, f"[{name}] from step {arm.step} to {settings.steps}")
        complete = run_arm(arm, corpus, settings, deadline, settings.steps)
        torch.save(arm.state(), path)
        result = {"arm": name, "complete": complete, "warmup_steps": settings.warmup_steps,
                  "warmup_seconds": warm["train_seconds"], "history": arm.history, "evals": arm.evals,
                  "notes": arm.notes, "warnings": caught}
        if complete and name == "dense" and settings.device.type == "cuda":
            result["attention_rate"] = dense_attention_rate(arm, corpus, settings)
            log(settings, f"[dense] attention kernels: {result['attention_rate']}")
        result_path.write_text(json.dumps(result))
        if not complete:
            log(settings, f"stopped before the time budget at {name} step {arm.step}: run the same command to continue")
            return INCOMPLETE
    log(settings, f"done: {settings.out}; summary: python {sys.argv[0]} --out {settings.out} --report")
    return 0


def report(out: Path) -> int:
    """Summarise a run's arms into out/summary.json and out/curves.png."""
    meta = json.loads((out / "meta.json").read_text())
    arms = {name: json.loads((out / f"{name}.json").read_text()) for name in ARMS if (out / f"{name}.json").exists()}
    tokens_per_step = meta["settings"]["seqlen"] * meta["settings"]["docs_per_step"]
    summary = {"meta": {k: v for k, v in meta.items() if k != "corpus"},
               "corpus": {k: v for k, v in meta["corpus"].items() if k != "sources"},
               "held_out_sources": [s for s in meta["corpus"]["sources"] if s["held_out"]],
               "training_sources": len([s for s in meta["corpus"]["sources"] if not s["held_out"]]), "arms": {}}
    for name, arm in arms.items():
        history, last = arm["history"], arm["evals"][-1]
        warmup, steps = arm["warmup_steps"], history[-1]["step"]
        after = [h for h in history if h["step"] > warmup]
        seconds_after = history[-1]["seconds"] - arm["warmup_seconds"]
        summary["arms"][name] = {
            "complete": arm["complete"], "steps": steps, "tokens": steps * tokens_per_step,
            "held_out_loss": last["held_out_loss"], "by_position": last["by_position"],
            "tokens_per_second_after_warmup": len(after) * tokens_per_step / seconds_after if seconds_after > 0 else None,
            "tokens_per_second_with_warmup": steps * tokens_per_step / history[-1]["seconds"],
            "peak_memory_gib": max((n["peak_memory_gib"] for n in arm["notes"] if n["steps"][0] >= warmup), default=None),
            "recall": last.get("recall"), "selection": last.get("selection"), "warnings": arm["warnings"],
            "attention_rate": arm.get("attention_rate"),
        }
    if "dense" in summary["arms"]:
        dense = summary["arms"]["dense"]
        for arm in summary["arms"].values():
            arm["gap_to_dense"] = arm["held_out_loss"] / dense["held_out_loss"] - 1
            arm["gap_to_dense_by_position"] = {k: (v / dense["by_position"][k] - 1) if v and dense["by_position"][k] else None
                                               for k, v in arm["by_position"].items()}
            if arm["tokens_per_second_after_warmup"] and dense["tokens_per_second_after_warmup"]:
                arm["speed_vs_dense"] = arm["tokens_per_second_after_warmup"] / dense["tokens_per_second_after_warmup"]
                arm["speed_vs_dense_with_warmup"] = arm["tokens_per_second_with_warmup"] / dense["tokens_per_second_with_warmup"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({name: {k: v for k, v in arm.items() if k not in ("selection",)} for name, arm in summary["arms"].items()},
                     indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return 0
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, arm in arms.items():
        steps = [e["step"] for e in arm["evals"]]
        seconds = {h["step"]: h["seconds"] for h in arm["history"]}
        axes[0].plot([h["step"] for h in arm["history"]], [h["loss"] for h in arm["history"]], label=f"{name} train", alpha=0.5)
        axes[0].plot(steps, [e["held_out_loss"] for e in arm["evals"]], "o-", label=f"{name} held-out")
        axes[1].plot([seconds.get(s, 0.0) for s in steps], [e["held_out_loss"] for e in arm["evals"]], "o-", label=name)
        if name == "sparse":
            recalls = [(e["step"], e["recall"]) for e in arm["evals"] if "recall" in e]
            axes[2].plot([s for s, _ in recalls], [r["index"]["mean"] for _, r in recalls], "o-", label="index branch")
            axes[2].plot([s for s, _ in recalls], [r["control"]["mean"] for _, r in recalls], "s--", label="control selection")
            axes[2].plot([s for s, _ in recalls], [r["best"]["mean"] for _, r in recalls], ":", label="best 16 blocks")
    axes[0].set(xlabel="step", ylabel="loss (nats per byte)", title="loss against steps")
    axes[1].set(xlabel="training seconds", ylabel="held-out loss", title="held-out loss against time")
    axes[2].set(xlabel="step", ylabel="share of dense attention mass", title="recall of the selection", ylim=(0, 1.02))
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    axes[2].axvline(meta["settings"]["warmup_steps"], color="gray", linestyle=":")
    figure.tight_layout()
    figure.savefig(out / "curves.png", dpi=90)
    print(f"wrote {out / 'summary.json'} and {out / 'curves.png'}")
    return 0


def parse_args(argv=None) -> tuple[argparse.Namespace, Settings]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--out", type=Path, required=True, help="the run's folder: state, log, JSON and plot")
    parser.add_argument("--report", action="store_true", help="summarise the run in --out (summary.json, curves.png)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="default: cuda when present")
    parser.add_argument("--tiny", action="store_true", help="a toy model and sizes for a CPU check (head dim 64, blocks of 64)")
    parser.add_argument("--corpus", default="packages",
                        help="packages (this Python's site-packages), a folder of text files, or hf:PATH_OR_NAME[:SPLIT]")
    parser.add_argument("--text-field", default="text", help="the text column of an hf: dataset")
    parser.add_argument("--seqlen", type=int, help="tokens per document (default 32768; 512 with --tiny)")
    parser.add_argument("--docs-per-step", type=int, default=4, help="documents packed into one step")
    parser.add_argument("--steps", type=int, help="steps per arm (default 160; 6 with --tiny)")
    parser.add_argument("--warmup-steps", type=int, help="shared dense warm-up steps W (default steps // 10, at least 1)")
    parser.add_argument("--eval-every", type=int, help="steps between evaluations (default 20; 2 with --tiny)")
    parser.add_argument("--eval-documents", type=int, default=4, help="held-out documents evaluated")
    parser.add_argument("--recall-queries", type=int, default=256, help="sampled queries per held-out document for the recall")
    parser.add_argument("--lr", type=float, default=1e-3, help="the trunk's peak learning rate (AdamW)")
    parser.add_argument("--index-lr", type=float, default=3e-3, help="the index branch's peak learning rate (AdamW)")
    parser.add_argument("--kl-coeff", type=float, default=1.0, help="the KL's weight in the loss")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    parser.add_argument("--time-budget", type=float, help="seconds: stop cleanly before this (exit 3), continue later")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms after the warm-up, of {ARMS}")
    args = parser.parse_args(argv)
    tiny = args.tiny
    arms = tuple(a.strip() for a in args.arms.split(",") if a.strip())
    if not arms or set(arms) - set(ARMS):
        parser.error(f"--arms: expected a comma-separated subset of {ARMS}, got {args.arms!r}")
    steps = args.steps if args.steps is not None else (6 if tiny else 160)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10)
    for name, value, low in (("--steps", steps, 1), ("--docs-per-step", args.docs_per_step, 1),
                             ("--eval-documents", args.eval_documents, 1), ("--recall-queries", args.recall_queries, 1)):
        if value < low:
            parser.error(f"{name}: expected >= {low}, got {value}")
    if not 0 <= warmup < steps:
        parser.error(f"--warmup-steps: expected 0 <= W < --steps ({steps}), got {warmup}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device: expected a device this machine has, got {args.device!r} (no CUDA device)")
    config = TINY if tiny else ModelConfig()
    seqlen = args.seqlen if args.seqlen is not None else (512 if tiny else 32768)
    if seqlen < config.attention.block_size:
        parser.error(f"--seqlen: expected >= {config.attention.block_size} (one block), got {seqlen}")
    settings = Settings(out=args.out, device=torch.device(args.device), config=config, seqlen=seqlen,
                        docs_per_step=args.docs_per_step, steps=steps, warmup_steps=warmup,
                        eval_every=args.eval_every if args.eval_every is not None else (2 if tiny else 20),
                        eval_documents=args.eval_documents, recall_queries=args.recall_queries, lr=args.lr,
                        index_lr=args.index_lr, kl_coeff=args.kl_coeff, seed=args.seed, time_budget=args.time_budget,
                        arms=arms)
    return args, settings


def main(argv=None) -> int:
    args, settings = parse_args(argv)
    if args.report:
        return report(settings.out)
    if settings.device.type == "cpu":
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    try:
        return train(args, settings)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
