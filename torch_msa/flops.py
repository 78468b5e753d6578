"""FLOPs of MSA work: the formulas of the performance notes, and their registration with
`torch.utils.flop_counter` so that `FlopCounterMode` (and MFU tools built on it) count the ops.

Per (query, key) pair: forward `4 * Hq * D`, backward `2 * (3D + 2D) * Hq`, index scoring
`2 * Di * Hi`. A registered formula sees shapes only, so it counts the nominal work (`topk *
block_size` keys per query, `max_seqlen_k` scored keys), an upper bound of the valid work. The
formulas are registered when `torch.utils.flop_counter` is first imported.
"""

import importlib.abc
import importlib.util
import sys
from typing import TypeVar

import torch

FLOP_COUNTER_MODULE = "torch.utils.flop_counter"

# Pair counts are ints for shapes (the registered formulas) and may be floats for averages (the
# benchmark); each formula returns the type it is given.
Pairs = TypeVar("Pairs", int, float)


def attention_forward(query_heads: int, head_dim: int, pairs: Pairs) -> Pairs:
    """`4 * Hq * D` per (query, key) pair: `S = Q K^T` and `O = P V`."""
    return 4 * query_heads * head_dim * pairs


def attention_backward(query_heads: int, head_dim: int, pairs: Pairs) -> Pairs:
    """`2 * (3D + 2D) * Hq` per pair: `S` recomputed, `dP`, `dV`, `dQ`, `dK` (2.5 x the forward)."""
    return 2 * (3 * head_dim + 2 * head_dim) * query_heads * pairs


def index_scoring(index_heads: int, index_dim: int, pairs: Pairs) -> Pairs:
    """`2 * Di * Hi` per (query, key) pair scored by the index branch."""
    return 2 * index_dim * index_heads * pairs


# Nominal formulas. FlopCounterMode calls them with the op's arguments, tensors replaced by
# their shapes, and the output's shape as `out_shape`.
def select_blocks_flops(index_q, index_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk, block_size,
                        fragment_documents=None, fragment_starts=None, out_shape=None) -> int:
    """`msa::select_blocks`: each of the `Tq` queries scores at most `min(max_seqlen_k, Tk)` keys per
    index head."""
    num_queries, index_heads, index_dim = index_q
    return index_scoring(index_heads, index_dim, num_queries * min(max_seqlen_k, index_k[0]))


def forward_flops(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size,
                  softmax_scale, plan=None, fragment_documents=None, fragment_starts=None, out_shape=None) -> int:
    """`msa::forward`: `Tq * topk * block_size` pairs per query head."""
    num_queries, query_heads, head_dim = q
    return attention_forward(query_heads, head_dim, num_queries * block_indices[2] * block_size)


def backward_flops(grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   block_size, softmax_scale, grad_lse=None, plan=None, fragment_documents=None, fragment_starts=None,
                   out_shape=None) -> int:
    """`msa::backward`: the forward's pairs at the backward's cost per pair."""
    num_queries, query_heads, head_dim = q
    return attention_backward(query_heads, head_dim, num_queries * block_indices[2] * block_size)


def forward_with_index_loss_flops(q, k, v, index_q, index_k, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, block_size, softmax_scale, index_softmax_scale, loss_value, plan=None,
                                  fragment_documents=None, fragment_starts=None, out_shape=None) -> int:
    """`msa::forward_with_index_loss`: the attention forward's (its loss is the backward's work)."""
    return forward_flops(q, k, v, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size,
                         softmax_scale)


def backward_with_index_loss_flops(grad_out, grad_loss, q, k, v, out, lse, index_q, index_k, block_indices, cu_seqlens_q,
                                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size, softmax_scale,
                                   index_softmax_scale, grad_lse=None, plan=None, fragment_documents=None,
                                   fragment_starts=None, out_shape=None) -> int:
    """`msa::backward_with_index_loss`: the attention backward's plus four index GEMMs per pair
    (the fused design's; a composed backend's extra teacher `Q K^T` is not counted)."""
    num_queries, index_heads, index_dim = index_q
    pairs = num_queries * block_indices[2] * block_size
    return (backward_flops(grad_out, q, k, v, out, lse, block_indices, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, block_size, softmax_scale)
            + 4 * index_scoring(index_heads, index_dim, pairs))


_FORMULAS = {"select_blocks": select_blocks_flops, "forward": forward_flops, "backward": backward_flops,
             "forward_with_index_loss": forward_with_index_loss_flops,
             "backward_with_index_loss": backward_with_index_loss_flops}


def _register(flop_counter) -> None:
    for name, formula in _FORMULAS.items():
        op = getattr(torch.ops.msa, name)
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op)(formula)


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `_register` right after `torch.utils.flop_counter` executes, the first time anything
    imports it; every other module is left to the finders after this one."""

    def find_spec(self, name, path=None, target=None):
        if name != FLOP_COUNTER_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _register(module)


def register() -> None:
    """Register the formulas with `torch.utils.flop_counter`, now if it is imported, else
    when it is. Idempotent."""
    module = sys.modules.get(FLOP_COUNTER_MODULE)
    if module is not None:
        _register(module)
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
