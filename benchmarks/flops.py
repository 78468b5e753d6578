"""FLOP accounting of the benchmark: the per-pair costs of `torch_msa.flops`, valid elements only.

Every number counts only the (query, key) pairs a kernel must compute, so sparse and dense rows
are comparable (the formulas registered with `torch.utils.flop_counter` count nominal pairs, an
upper bound of these):

* MSA attention reads `S = sum_t keys(t)` pairs per query head group, where `keys(t)` is the
  number of keys query `t` really sees through its selected blocks (causal inside the local
  block). `S` is counted from the actual block indices, averaged over the KV heads (for a
  contract-valid selection every head sees the same count).
* MSA forward `4 * Hq * D * S`; backward `2 * (3D + 2D) * Hq * S` (2.5 x the forward).
* Index scoring `2 * Di * Hi * P` and dense causal attention `4 * Hq * D * P` (backward 2.5 x),
  with `P = sum over documents of L (L + 1) / 2` causal pairs.
"""

import dataclasses

import torch

from torch_msa import flops
from torch_msa.contract import Shape
from torch_msa.plan.schedule import valid_entries


def keys_per_token(position: torch.Tensor, block_size: int, topk: int) -> torch.Tensor:
    """Keys a query at document position `p` reads under any contract-valid selection.

    The local block contributes `p mod block_size + 1` keys and each of the
    `min(topk - 1, p // block_size)` earlier blocks a full block; for M3 this is
    `(t mod 128) + 1 + 128 * min(15, t // 128)`. `position` is int64 `[Tq]`; `-1` (no document)
    gives 0.
    """
    position = position.to(torch.int64)
    earlier = torch.clamp(position // block_size, max=topk - 1)
    keys = position % block_size + 1 + block_size * earlier
    return torch.where(position >= 0, keys, 0)


def selected_key_counts(block_indices: torch.Tensor, position: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 `[Hkv, Tq]`: keys each (KV head, query) reads through `block_indices [Hkv, Tq, topk]`."""
    ids = block_indices.to(torch.int64)
    last_visible = position.view(1, -1, 1) - ids * block_size  # offset of p(t) inside the block
    keys = torch.clamp(last_visible + 1, min=0, max=block_size)
    return torch.where(valid_entries(block_indices, position, block_size), keys, 0).sum(-1)


def causal_pairs(lengths) -> int:
    """`sum L (L + 1) / 2` over documents of these lengths: the pairs of dense causal attention."""
    return sum(length * (length + 1) // 2 for length in lengths)


@dataclasses.dataclass(frozen=True)
class Work:
    """FLOPs of one problem (floats, so JSON keeps them exact enough and large)."""

    attended_pairs: float  # S, averaged over KV heads
    causal_pairs: int  # P
    msa_forward: float
    msa_backward: float
    index_scoring: float
    dense_forward: float
    dense_backward: float

    @property
    def msa_step(self) -> float:
        """select + forward + backward."""
        return self.index_scoring + self.msa_forward + self.msa_backward


def work(shape: Shape, lengths, block_indices: torch.Tensor, position: torch.Tensor) -> Work:
    """FLOPs of a problem of documents `lengths` (self-attention, `Lq == Lk`) with this selection."""
    pairs_per_head = selected_key_counts(block_indices, position, shape.block_size).sum().item()
    attended = pairs_per_head / block_indices.shape[0]
    dense_pairs = causal_pairs(lengths)
    dense_forward = float(flops.attention_forward(shape.query_heads, shape.head_dim, dense_pairs))
    return Work(
        attended_pairs=attended,
        causal_pairs=dense_pairs,
        msa_forward=float(flops.attention_forward(shape.query_heads, shape.head_dim, attended)),
        msa_backward=float(flops.attention_backward(shape.query_heads, shape.head_dim, attended)),
        index_scoring=float(flops.index_scoring(shape.kv_heads, shape.index_dim, dense_pairs)),
        dense_forward=dense_forward,
        dense_backward=float(flops.attention_backward(shape.query_heads, shape.head_dim, dense_pairs)),
    )


def tflops(flops: float | None, milliseconds: float | None) -> float | None:
    """Effective TFLOP/s, or None when either is unknown."""
    if flops is None or not milliseconds:
        return None
    return flops / (milliseconds * 1e-3) / 1e12
