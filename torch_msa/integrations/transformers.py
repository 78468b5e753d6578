"""torch_msa in HF transformers' MiniMax-M3 (`transformers.models.minimax_m3_vl`).

`use_torch_msa(model)` makes the sparse layers' indexers select with `torch_msa.select_blocks`
and sets the attention implementation to `"torch_msa"` (`ATTENTION_NAME`): sparse layers run
`torch_msa.sparse_attention` on packed tokens, full-attention layers SDPA. Importing this module
registers `"torch_msa"` with HF's attention and mask interfaces, so
`attn_implementation="torch_msa"` alone works too, on HF's own indexer's `block_indices`.

Each padded row is two documents, its real tokens and its padding (`padded_cu_seqlens`); HF's
packed kwargs (`PACKED_KWARGS`) or restarting `position_ids` make each packed document one of its
own. Padding, packing, caches, switching back and training the indexer: docs/transformers.md.
"""

import warnings
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast, get_args

import torch

try:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
        MiniMaxM3VLIndexer,
        MiniMaxM3VLSparseStaticCacheLayer,
        MiniMaxM3VLTextModel,
        apply_rotary_pos_emb,
    )
except ImportError as error:  # transformers missing, or older than its MiniMax-M3 model
    raise ImportError(
        'torch_msa.integrations.transformers needs transformers with MiniMax-M3 (>= 5.17, < 6): '
        'install torch_msa with its hf extra (pip install ".[hf]" in a checkout)') from error

from .. import api
from ..contract import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS, compute_dtype
from ..diagnostics import TorchMSAWarning
from ..index_loss import attention_with_index_loss
from ..padding import padded_cu_seqlens

ATTENTION_NAME = "torch_msa"

# `use_torch_msa`'s `index_loss` values: the index loss on the selected blocks, or the dense warm-up's.
IndexLossSupport = Literal["sparse", "dense"]
INDEX_LOSS_SUPPORTS: tuple[str, ...] = get_args(IndexLossSupport)

__all__ = [
    "ATTENTION_NAME",
    "INDEX_LOSS_SUPPORTS",
    "IndexLossSupport",
    "PACKED_KWARGS",
    "PendingSelection",
    "TorchMSAIndexer",
    "attention_forward",
    "index_loss_values",
    "index_losses",
    "packed_kwargs_from_position_ids",
    "padding_mask",
    "use_torch_msa",
]


@dataclass
class PendingSelection:
    """The index branch's projected inputs, selected once the attention function knows the documents
    (the padding is known only there).

    Attributes:
        index_q: `[B, H_idx, Sq, Di]` index queries after the norm and RoPE.
        index_k: `[B, 1, Sk, Di]` index keys after the norm and RoPE (with the cached history).
        topk: blocks kept per query, the local one included.
        block_size: keys per block.
        index_loss_support: `use_torch_msa`'s `index_loss` (`"sparse"`, `"dense"`), or None.
    """

    index_q: torch.Tensor
    index_k: torch.Tensor
    topk: int
    block_size: int
    index_loss_support: IndexLossSupport | None = None

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The index inputs over the packed rows: `index_q [B * Sq, H_idx, Di]`, `index_k [B * Sk, 1, Di]`."""
        batch, heads, q_len, dim = self.index_q.shape
        index_q = self.index_q.transpose(1, 2).reshape(batch * q_len, heads, dim)
        index_k = self.index_k.transpose(1, 2).reshape(batch * self.index_k.shape[2], 1, dim)
        return index_q, index_k

    def select(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
               max_seqlen_k: int) -> torch.Tensor:
        """`torch_msa.select_blocks` over the packed `B * Sq` query and `B * Sk` key slots: int32
        `[H_idx, B * Sq, topk]`."""
        return api.select_blocks(*self.packed(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 topk=self.topk, block_size=self.block_size)

    def block_indices(self, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The selection in HF's layout, int64 `[B, H_idx, Sq, topk]`, ids relative to each row's
        first real token (`-1` after the valid ones), for a mask as `attention_forward` takes it;
        TypeError or ValueError for a mask of another type or shape."""
        batch, heads, q_len, _ = self.index_q.shape
        documents = _documents(attention_mask, batch, q_len, self.index_k.shape[2], self.index_q.device)
        blocks = self.select(*documents)
        return blocks.view(heads, batch, q_len, self.topk).permute(1, 0, 2, 3).long()


class _LatestIndexLoss:
    """A layer's latest index loss. Copies and pickles start without one: `copy.deepcopy` cannot
    copy the step's autograd graph it belongs to."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.known_value: torch.Tensor | None = None  # in training the backward writes it
        self.value_sink: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> "_LatestIndexLoss":
        return _LatestIndexLoss()

    def __reduce__(self):
        return _LatestIndexLoss, ()


class TorchMSAIndexer(MiniMaxM3VLIndexer):
    """HF's MiniMax-M3 indexer (same parameters) whose selection runs in `torch_msa.select_blocks`.

    `forward` returns a `PendingSelection` under `"torch_msa"` attention, HF's selection under any
    other implementation. `use_torch_msa` swaps existing indexers' class in place.

    Attributes (set by `use_torch_msa`):
        index_loss_support: `"sparse"`, `"dense"` or None.
        detach_index_inputs: whether it reads the hidden states detached from the trunk.
        index_loss: the 0-D index loss of its layer's latest forward, or None.
        index_loss_value: its value without autograd history, or None.
    """

    index_loss_support: IndexLossSupport | None = None
    detach_index_inputs: bool = True

    @property
    def index_loss(self) -> torch.Tensor | None:
        slot = self.__dict__.get("_latest_index_loss")
        return None if slot is None else slot.value

    @index_loss.setter
    def index_loss(self, value: torch.Tensor | None) -> None:
        """An index loss known in the forward, or None at the start of a forward."""
        if value is None:
            self.__dict__["_latest_index_loss"] = _LatestIndexLoss()
        else:
            self.store_index_loss(value, value.detach())

    @property
    def index_loss_value(self) -> torch.Tensor | None:
        slot = self.__dict__.get("_latest_index_loss")
        return None if slot is None else slot.known_value

    def store_index_loss(self, kl: torch.Tensor | None, kl_value: torch.Tensor | None) -> None:
        """Keep `kl` as `index_loss` and the tensor that holds (or will hold) its value."""
        slot = self.__dict__.setdefault("_latest_index_loss", _LatestIndexLoss())
        slot.value, slot.known_value = kl, kl_value

    def index_loss_sink(self, index_q: torch.Tensor) -> torch.Tensor | None:
        """The 0-D `index_loss_value` of this forward's sparse index loss, reused by a recomputation
        under gradient checkpointing; None where the loss is computed in the forward (compiled,
        where the compiled backward cannot write into it, or under torch.func)."""
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            return None
        slot = self.__dict__.setdefault("_latest_index_loss", _LatestIndexLoss())
        if slot.value_sink is None:
            slot.value_sink = torch.zeros((), dtype=compute_dtype(index_q.dtype), device=index_q.device)
        return slot.value_sink

    def forward(self, hidden_states, position_embeddings, past_key_values, position_ids) -> PendingSelection | torch.Tensor:
        """HF's indexer's projections, norms and RoPE; the selection is left to the attention.

        Returns a `PendingSelection` (HF's block ids under another attention implementation);
        a `DynamicCache` in `past_key_values` takes the index keys, a static one raises ValueError.
        """
        if self.config._attn_implementation != ATTENTION_NAME:
            return super().forward(hidden_states, position_embeddings, past_key_values, position_ids)
        if self.detach_index_inputs:  # the index loss's gradients stay out of the trunk
            hidden_states = hidden_states.detach()
        batch, q_len, _ = hidden_states.shape
        index_q = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        index_k = self.k_norm(self.k_proj(hidden_states).view(batch, q_len, 1, self.head_dim)).transpose(1, 2)
        cos, sin = position_embeddings
        index_q, index_k = apply_rotary_pos_emb(index_q, index_k, cos[..., : self.head_dim], sin[..., : self.head_dim])
        if past_key_values is not None:
            layer = past_key_values.layers[self.layer_idx]
            if isinstance(layer, MiniMaxM3VLSparseStaticCacheLayer):
                # A static cache fills a fixed buffer from the front; torch_msa's queries must be the
                # newest keys of their document.
                raise ValueError("past_key_values: torch_msa decodes from a DynamicCache; got a static cache "
                                 f"({type(layer).__name__})")
            index_k = layer.update_index(index_k)
        return PendingSelection(index_q, index_k, self.topk_blocks, self.block_size, self.index_loss_support)


def _real_keys_of_4d(attention_mask: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """`[B, Sk]` bool real-key mask of a causal padding mask `[B, 1 or H, Sq, Sk]` (bool keep, or additive 0 = keep)."""
    keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    if q_len == k_len:
        # A real token sees itself (robust to masks that also hide padding queries' rows).
        return keep[:, 0].diagonal(dim1=-2, dim2=-1)
    # Decoding: the last query is real and sees every real key.
    return keep[:, 0, -1]


@torch.library.custom_op("torch_msa_hf::slot_block_indices", mutates_args=())
def _slot_block_indices(block_indices: torch.Tensor, real_keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """HF's block ids `[B, H_idx, Sq, topk]` (int64, `-1` padded) as torch_msa's int32 `[H_idx, B * Sq, topk]`
    over the documents of `real_keys` (`[B, Sk]` bool, True at real tokens).

    HF counts blocks from the row's first slot, torch_msa from its first real token. Each real
    query's kept keys map to the document's blocks holding them, which is exact only when they are
    whole blocks (cut at the query); otherwise it raises `ValueError` (a device assert during
    CUDA-graph capture). An op of its own, so the check runs compiled too.
    """
    batch, heads, q_len, width = block_indices.shape
    k_len = real_keys.shape[1]
    device = block_indices.device
    real_count = real_keys.sum(dim=1)
    left_padded = ~real_keys[:, :1].all(dim=1)  # as padded_cu_seqlens: an all-padding row counts as left-padded
    real_start = torch.where(left_padded, k_len - real_count, 0)[:, None]  # [B, 1]
    padding_start = torch.where(left_padded, 0, real_count)[:, None]
    key_slots = torch.arange(k_len, device=device)[None]
    one_run = (real_keys == ((key_slots >= real_start) & (key_slots < real_start + real_count[:, None]))).all(dim=1)
    slots = torch.arange(k_len - q_len, k_len, device=device)[None]  # the queries are the row's last slots
    real_query = real_keys[:, k_len - q_len:]  # [B, Sq]
    position = (slots - real_start)[:, None, :, None]  # a real query's position in its document
    # HF's block b keeps the document positions [low, high) for its query.
    first_position = block_indices * block_size - real_start[:, :, None, None]
    low = first_position.clamp(min=0)
    high = torch.minimum(first_position + block_size, position + 1)
    kept = (block_indices >= 0) & (high > low)
    hf_keys = torch.where(kept, high - low, 0).sum(dim=-1)
    # Those positions lie in at most two of the document's blocks; keep each block once, ascending.
    none = -(-k_len // block_size) + 1  # past every block id: sorts after them
    touched = torch.cat([torch.where(kept, low // block_size, none), torch.where(kept, (high - 1) // block_size, none)], -1)
    touched = touched.sort(dim=-1).values
    repeated = torch.nn.functional.pad(touched[..., 1:] == touched[..., :-1], (1, 0))
    touched = touched.masked_fill(repeated, none).sort(dim=-1).values
    chosen = touched < none
    block_keys = torch.where(chosen, torch.minimum((touched + 1) * block_size, position + 1) - touched * block_size, 0)
    exact = (block_keys.sum(dim=-1) == hf_keys) & (hf_keys > 0) & (chosen.sum(dim=-1) <= width)
    unservable = real_query[:, None, :] & ~exact
    if real_keys.is_cuda and torch.cuda.is_current_stream_capturing():
        torch._assert_async(one_run.all() & ~unservable.any(),
                            "torch_msa: HF's indexer selected blocks that do not map to the documents")
    elif not bool(one_run.all()):
        row = int((~one_run).nonzero()[0])
        raise ValueError(
            f"attention_mask: row {row} is neither left- nor right-padded (its real tokens must be one run at the row's "
            f"start or end), got real slots {real_keys[row].nonzero().flatten().tolist()}")
    elif bool(unservable.any()):
        row, head, query = (int(i) for i in unservable.nonzero()[0])
        first_real = int(real_start[row])
        layout = f"is left-padded (its real tokens start at slot {first_real})" if first_real else "starts with its real tokens"
        raise ValueError(
            f"attention_mask: row {row} {layout}, and for its "
            f"query at slot {k_len - q_len + query} HF's indexer under attn_implementation={ATTENTION_NAME!r} kept "
            f"blocks {sorted(int(b) for b in block_indices[row, head, query] if b >= 0)} of {block_size} slots counted from "
            "the row's first slot, padding included, whose real keys are no union of whole blocks of the row's tokens, so "
            "torch_msa cannot attend to exactly those keys. Switch the model with "
            "torch_msa.integrations.transformers.use_torch_msa, whose indexer selects per document, or pad on the right")
    ids = torch.where(chosen[..., :width], touched[..., :width], -1)
    own_block = ((slots - padding_start) // block_size)[:, None, :, None]
    padding_ids = torch.where(torch.arange(width, device=device) == 0, own_block, -1)
    ids = torch.where(real_query[:, None, :, None], ids, padding_ids)
    return ids.permute(1, 0, 2, 3).reshape(heads, batch * q_len, width).to(torch.int32)


@_slot_block_indices.register_fake
def _(block_indices, real_keys, block_size):
    batch, heads, q_len, topk = block_indices.shape
    return block_indices.new_empty((heads, batch * q_len, topk), dtype=torch.int32)


def _hf_block_indices(block_indices: torch.Tensor, attention_mask, q_len: int, k_len: int, block_size: int) -> torch.Tensor:
    """HF's block ids in torch_msa's layout (`_slot_block_indices`) for a mask `_documents` accepted."""
    if attention_mask is None:  # every slot real: HF's grid is the document's
        batch, heads, _, topk = block_indices.shape
        return block_indices.permute(1, 0, 2, 3).reshape(heads, batch * q_len, topk).to(torch.int32)
    if attention_mask.dim() == 4:
        real_keys = _real_keys_of_4d(attention_mask, q_len, k_len)
    else:
        real_keys = attention_mask != 0
    return _slot_block_indices(block_indices, real_keys, block_size)


# HF's kwargs of packed rows (`DataCollatorWithFlattening(return_flash_attn_kwargs=True)`): int32
# boundaries over the `B * S` flattened slots and the longest document as host ints.
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _packed_documents(kwargs: dict, attention_mask, q_len: int, k_len: int, device):
    """`(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)` of HF's packed kwargs, or None."""
    given: dict[str, Any] = {name: kwargs.get(name) for name in PACKED_KWARGS}
    if all(value is None for value in given.values()):
        return None
    for name, value in given.items():
        if value is None:
            raise ValueError(f"{name}: expected it with the other packed-row arguments {PACKED_KWARGS}, got None")
    for name in PACKED_KWARGS[:2]:
        if not isinstance(given[name], torch.Tensor):
            raise TypeError(f"{name}: expected an int32 torch.Tensor [num_docs + 1], got {type(given[name]).__name__}")
    if attention_mask is not None:
        raise ValueError("attention_mask: expected None with packed rows (cu_seq_lens_q / cu_seq_lens_k), which have "
                         f"no padding; got a {attention_mask.dim()}-D mask")
    if q_len != k_len:
        raise ValueError(f"cu_seq_lens_q: torch_msa reads packed rows in training and prefill (as many queries as keys); "
                         f"got {q_len} queries over {k_len} keys (decoding from a cache)")
    cu_q, cu_k = (given[name].to(device=device, dtype=torch.int32) for name in PACKED_KWARGS[:2])
    return cu_q, cu_k, given["max_length_q"], given["max_length_k"]


def packed_kwargs_from_position_ids(position_ids: torch.Tensor, batch_size: int | None = None) -> dict | None:
    """HF's packed kwargs of rows whose `position_ids` restart at every document (one host sync).

    A document starts at each row's first slot and wherever a position is not its predecessor's
    plus one, as HF's `find_packed_sequence_indices` reads them.

    Args:
        position_ids: `[B, S]`, or `[1, S]` for every row alike.
        batch_size: the batch's `B`; None for `position_ids.shape[0]`.

    Returns:
        A dict of `PACKED_KWARGS` (the same int32 `[N + 1]` boundaries over the `B * S` slots,
        the longest document as host ints), or None when every row is one document.

    Raises:
        ValueError: `position_ids` is not 2-D, or has neither 1 nor `batch_size` rows.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids: expected a 2-D tensor [B, S] or [1, S], got {tuple(position_ids.shape)}")
    rows = position_ids.shape[0] if batch_size is None else batch_size
    if position_ids.shape[0] not in (1, rows):
        raise ValueError(f"position_ids: expected [{rows}, S] or [1, S], got {tuple(position_ids.shape)}")
    positions = position_ids.expand(rows, -1)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    bounds = starts.flatten().nonzero().flatten().tolist() + [positions.numel()]
    if len(bounds) <= rows + 1:
        return None
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=position_ids.device)
    longest = max(end - start for start, end in zip(bounds, bounds[1:]))
    return dict(zip(PACKED_KWARGS, (cu_seqlens, cu_seqlens, longest, longest)))


def _read_packed_position_ids(module, args, kwargs):
    """Text-model forward pre-hook: rows packed through `position_ids` alone become HF's packed
    kwargs. Packed rows take no cache: a given one raises, and none is made."""
    if module.config._attn_implementation != ATTENTION_NAME:  # switched back to HF's attention
        return None
    cache = kwargs.get("cache", kwargs.get("past_key_values", args[3] if len(args) > 3 else None))
    packed = None
    packed_by = "cu_seq_lens_q"
    if not any(kwargs.get(name) is not None for name in PACKED_KWARGS):
        position_ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
        attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        if (position_ids is None or attention_mask is not None or inputs is None or position_ids.dim() != 2
                or position_ids.shape[-1] < 2 or (cache is not None and cache.get_seq_length() > 0)):
            return None  # with history in the cache, positions continue their document (as HF reads them)
        packed = packed_kwargs_from_position_ids(position_ids, inputs.shape[0])
        if packed is None:
            return None
        packed_by = "position_ids"
    if cache is not None:
        raise ValueError(
            f"{packed_by}: packed rows (several documents in a row) cannot be decoded from a cache: generation "
            "continues one sequence per row. Give each document a row of its own (left-padded with an attention_mask "
            "for generate), or run the packed rows without a cache")
    if len(args) > 5:  # use_cache given by position
        return (*args[:5], False, *args[6:]), {**kwargs, **(packed or {})}
    return args, {**kwargs, **(packed or {}), "use_cache": False}


def _document_mask(cu_seqlens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Bool `[B, 1, S, S]`: causal inside each packed document of `cu_seqlens` (over `B * S` slots)."""
    slots = torch.arange(batch * length, device=cu_seqlens.device)
    document = torch.searchsorted(cu_seqlens[1:].contiguous(), slots, right=True).view(batch, length)
    causal = torch.ones(length, length, dtype=torch.bool, device=cu_seqlens.device).tril()
    return (causal & (document[:, :, None] == document[:, None, :]))[:, None]


def _documents(attention_mask, batch: int, q_len: int, k_len: int, device):
    """`(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)` of the packed rows `[B * Sq]`, `[B * Sk]`;
    with a mask each row is two documents, the queries being the row's last `Sq` slots."""
    if attention_mask is None:
        steps = torch.arange(batch + 1, dtype=torch.int32, device=device)
        return steps * q_len, steps * k_len, q_len, k_len
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError("attention_mask: expected None or a torch.Tensor [B, S] or [B, 1, Sq, Sk], "
                        f"got {type(attention_mask).__name__}")
    if attention_mask.dim() == 4:
        if attention_mask.shape[0] != batch or tuple(attention_mask.shape[-2:]) != (q_len, k_len):
            raise ValueError(
                f"attention_mask: expected a 4-D mask [{batch}, 1, {q_len}, {k_len}], got {tuple(attention_mask.shape)}")
        attention_mask = _real_keys_of_4d(attention_mask, q_len, k_len)
    elif attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, k_len):
        raise ValueError(
            f"attention_mask: expected [{batch}, {k_len}] or [{batch}, 1, {q_len}, {k_len}], got {tuple(attention_mask.shape)}")
    cu_seqlens_k, max_seqlen_k = padded_cu_seqlens(attention_mask)
    if q_len == k_len:
        return cu_seqlens_k, cu_seqlens_k, max_seqlen_k, max_seqlen_k
    first_k = cu_seqlens_k[1::2] - cu_seqlens_k[0:-1:2]
    first_q = (first_k - (k_len - q_len)).clamp(min=0)
    lengths_q = torch.stack([first_q, q_len - first_q], dim=1).flatten()
    cu_seqlens_q = torch.nn.functional.pad(torch.cumsum(lengths_q, dim=0, dtype=torch.int32), (1, 0))
    return cu_seqlens_q, cu_seqlens_k, q_len, max_seqlen_k


def _causal_padding_mask(padding: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """Bool `[B, 1, Sq, Sk]`: causal, padding keys hidden; a padding query sees itself, so no row is empty."""
    q_pos = torch.arange(q_len, device=padding.device) + (k_len - q_len)
    k_pos = torch.arange(k_len, device=padding.device)
    causal = k_pos[None, :] <= q_pos[:, None]
    visible = padding.bool()[:, None, None, :] | (k_pos[None, :] == q_pos[:, None])[None, None]
    return causal[None, None] & visible


def _full_attention(module, query, key, value, attention_mask, dropout, scaling, packed, **kwargs):
    if packed is not None:
        attention_mask = _document_mask(packed[0], query.shape[0], query.shape[2])
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        attention_mask = _causal_padding_mask(attention_mask, query.shape[2], key.shape[2])
    # Packing is in the mask now; output_attentions was answered by attention_forward's warning.
    kwargs = {name: value for name, value in kwargs.items() if name not in (*PACKED_KWARGS, "output_attentions")}
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


_warned_output_attentions = False


def _warn_no_attention_weights() -> None:
    global _warned_output_attentions
    if not _warned_output_attentions and not torch.compiler.is_compiling():
        _warned_output_attentions = True
        warnings.warn(f"{ATTENTION_NAME!r} attention does not return attention weights: output_attentions=True gives "
                      "None for its layers. Set the attention implementation to 'eager' for them.", TorchMSAWarning,
                      stacklevel=3)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    block_indices: torch.Tensor | PendingSelection | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention function registered as `"torch_msa"`.

    Args:
        module: the calling `MiniMaxM3VLAttention`.
        query: `[B, Hq, Sq, D]`; key, value: `[B, Hkv, Sk, D]` (D 64 or 128 for sparse layers).
        attention_mask: None, a 2-D padding mask `[B, Sk]` (nonzero at real tokens), or a 4-D
            causal padding mask `[B, 1, Sq, Sk]` (bool keep, or additive with 0 = keep).
        block_indices: HF's int64 `[B, H_idx, Sq, topk]` (`-1` padded, ids relative to the row
            start), a `PendingSelection` from `TorchMSAIndexer`, or None for a full-attention
            layer (SDPA). With an `index_loss_support` the index loss is stored in
            `module.indexer`; `"dense"` attends densely (SDPA), as the warm-up's teacher.
        kwargs: HF's packed-row arguments (`PACKED_KWARGS`), if any; the rest goes to SDPA.

    Returns:
        `(out [B, Sq, Hq, D], None)` in query's dtype: no attention weights are materialised.

    Raises:
        ValueError: attention dropout in a sparse layer; HF's `block_indices` of another shape,
            with packed rows, or not whole blocks of a left-padded row; a mask of another shape;
            incomplete packed-row arguments, or packed rows with a mask or a cache.
        TypeError: a mask or packed-row boundaries that are not tensors.
    """
    if kwargs.get("output_attentions"):
        _warn_no_attention_weights()
    packed = _packed_documents(kwargs, attention_mask, query.shape[2], key.shape[2], query.device)
    if block_indices is None:
        return _full_attention(module, query, key, value, attention_mask, dropout, scaling, packed, **kwargs)
    if dropout:
        raise ValueError(f"dropout: torch_msa's sparse attention has no attention dropout; expected 0.0, got {dropout}")
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    documents = _documents(attention_mask, batch, q_len, k_len, query.device) if packed is None else packed
    q = query.transpose(1, 2).reshape(batch * q_len, q_heads, head_dim)
    k = key.transpose(1, 2).reshape(batch * k_len, kv_heads, head_dim)
    student = None  # the packed index inputs, when the indexer asks for its index loss
    if isinstance(block_indices, PendingSelection):
        block_size = block_indices.block_size
        if block_indices.index_loss_support == "dense":
            cast(TorchMSAIndexer, module.indexer).index_loss = api.indexer_kl_loss_dense(
                q, k, *block_indices.packed(), *documents, block_size=block_size, softmax_scale=scaling)
            return _full_attention(module, query, key, value, attention_mask, dropout, scaling, packed, **kwargs)
        if block_indices.index_loss_support == "sparse":
            student = block_indices.packed()
        blocks = block_indices.select(*documents)
    elif packed is not None:
        raise ValueError(
            f"cu_seq_lens_q: packed rows under attn_implementation={ATTENTION_NAME!r} need torch_msa's indexer: HF's "
            "indexer scores every slot of the row against every earlier slot, across documents. Switch the model "
            "with torch_msa.integrations.transformers.use_torch_msa")
    else:
        if (not isinstance(block_indices, torch.Tensor) or block_indices.dim() != 4
                or block_indices.shape[:3] != (batch, kv_heads, q_len)):
            got = tuple(block_indices.shape) if isinstance(block_indices, torch.Tensor) else type(block_indices).__name__
            raise ValueError(f"block_indices: expected [{batch}, {kv_heads}, {q_len}, topk] (HF's layout), got {got}")
        block_size = cast(MiniMaxM3VLIndexer, module.indexer).block_size
        blocks = _hf_block_indices(block_indices, attention_mask, q_len, k_len, block_size)
    v = value.transpose(1, 2).reshape(batch * k_len, kv_heads, head_dim)
    if student is None:
        out = api.sparse_attention(q, k, v, blocks, *documents, block_size=block_size, softmax_scale=scaling)
    else:
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = documents
        docs = api._attention_document_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_size,
                                            None, scaling)
        plan = api._plan_for(q, k, blocks, docs, block_size, (None, None))
        indexer = cast(TorchMSAIndexer, module.indexer)
        out, _, kl, kl_value = attention_with_index_loss(
            q, k, v, *student, blocks, docs, block_size, api._scale(q, scaling), plan, (None, None),
            indexer.index_loss_sink(student[0]))
        indexer.store_index_loss(kl, kl_value)
    return out.view(batch, q_len, q_heads, head_dim), None


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """HF mask function registered as `"torch_msa"`: the padding mask as is (nothing `O(S^2)`).

    Returns HF's 2-D `attention_mask` (or None) right-padded to `kv_length + kv_offset` columns
    (`prepare_padding_mask`); the other mask-interface arguments are not read.
    """
    return prepare_padding_mask(attention_mask, kv_length, kv_offset)


def register() -> str:
    """Register `"torch_msa"` with HF's attention and mask interfaces (done on import); returns `ATTENTION_NAME`."""
    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, padding_mask)
    return ATTENTION_NAME


def _check_indexer_config(indexer: MiniMaxM3VLIndexer) -> None:
    """Refuse, naming the config field, what torch_msa's sparse layers cannot serve."""
    config = indexer.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: torch_msa's sparse attention serves head dims {SUPPORTED_HEAD_DIMS}; got {head_dim}")
    if config.index_block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"index_block_size: torch_msa serves blocks of {SUPPORTED_BLOCK_SIZES} keys; got {config.index_block_size}")
    if config.index_topk_blocks < 1:
        raise ValueError(f"index_topk_blocks: expected >= 1 (the local block counts), got {config.index_topk_blocks}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"num_attention_heads: expected a multiple of num_key_value_heads = {config.num_key_value_heads}, "
                         f"got {config.num_attention_heads}")
    if config.index_local_blocks != 1:
        raise ValueError(
            f"index_local_blocks: torch_msa keeps exactly the query's own block as the local block; expected 1, "
            f"got {config.index_local_blocks}")
    if config.index_n_heads != config.num_key_value_heads:
        raise ValueError(
            f"index_n_heads: torch_msa selects per KV head; expected num_key_value_heads = {config.num_key_value_heads}, "
            f"got {config.index_n_heads}")


_Model = TypeVar("_Model", bound=PreTrainedModel)

# The text model's attributes holding `use_torch_msa`'s forward pre-hooks, so each registers once.
_PACKING_HOOK = "_torch_msa_packing_hook"
_INDEX_LOSS_HOOK = "_torch_msa_index_loss_hook"


def _reset_index_losses(module, args, kwargs):
    """Text-model forward pre-hook: each forward starts without index losses."""
    for layer in module.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if isinstance(indexer, TorchMSAIndexer):
            indexer.index_loss = None


def _check_index_loss_args(index_loss, detach_index_inputs) -> None:
    if index_loss is not None and not isinstance(index_loss, str):
        raise TypeError(f"index_loss: expected None or one of {INDEX_LOSS_SUPPORTS}, "
                        f"got {type(index_loss).__name__} {index_loss!r}")
    if index_loss is not None and index_loss not in INDEX_LOSS_SUPPORTS:
        raise ValueError(f"index_loss: expected None or one of {INDEX_LOSS_SUPPORTS}, got {index_loss!r}")
    if not isinstance(detach_index_inputs, bool):
        raise TypeError(f"detach_index_inputs: expected a bool, got {type(detach_index_inputs).__name__}")
    if index_loss is None and not detach_index_inputs:
        raise ValueError("detach_index_inputs: only an index loss sends gradients through the indexer's inputs; "
                         "expected True (the default) with index_loss=None, got False")


def use_torch_msa(model: _Model, *, index_loss: IndexLossSupport | None = None,
                  detach_index_inputs: bool = True) -> _Model:
    """Switch a HF MiniMax-M3 model (causal LM, text model or vision-language; only the text model
    switches) to torch_msa, in place.

    The sparse layers' indexers become `TorchMSAIndexer` and the text model's attention
    implementation `"torch_msa"`; parameters and state-dict keys are unchanged. With `index_loss`,
    every forward of a sparse layer computes the index loss that `index_losses(model)` returns:
    `"sparse"` on the selected blocks (`torch_msa.indexer_kl_loss`), `"dense"` on every visible
    key (`torch_msa.indexer_kl_loss_dense`), the sparse layers then attending densely. Its mean
    runs over every query slot, padding slots included. Call again to change `index_loss`.

    Args:
        model: a HF MiniMax-M3 model with sparse layers.
        index_loss: None, `"sparse"` or `"dense"` (`INDEX_LOSS_SUPPORTS`).
        detach_index_inputs: the indexer reads detached hidden states (the default); False lets
            the index loss's gradients into the trunk too (only with an `index_loss`).

    Returns:
        `model` itself, switched.

    Raises (before anything is changed):
        TypeError: `index_loss` not None or a string, `detach_index_inputs` not a bool.
        ValueError: a config field torch_msa cannot serve (named), no MiniMax-M3 sparse layers,
            `index_loss` outside `INDEX_LOSS_SUPPORTS`, or `detach_index_inputs=False` without it.
    """
    _check_index_loss_args(index_loss, detach_index_inputs)
    register()
    indexers = [m for m in model.modules() if isinstance(m, MiniMaxM3VLIndexer)]
    if not indexers:
        raise ValueError("model: expected a MiniMax-M3 model with sparse layers (MiniMaxM3VLIndexer modules), "
                         f"got {type(model).__name__} with none")
    for indexer in indexers:
        _check_indexer_config(indexer)
    for indexer in indexers:
        indexer.__class__ = TorchMSAIndexer
        patched = cast(TorchMSAIndexer, indexer)
        patched.index_loss_support, patched.detach_index_inputs, patched.index_loss = index_loss, detach_index_inputs, None
    for text_model in (m for m in model.modules() if isinstance(m, MiniMaxM3VLTextModel)):
        if not hasattr(text_model, _PACKING_HOOK):
            setattr(text_model, _PACKING_HOOK, text_model.register_forward_pre_hook(
                _read_packed_position_ids, with_kwargs=True))
        if not hasattr(text_model, _INDEX_LOSS_HOOK):
            setattr(text_model, _INDEX_LOSS_HOOK, text_model.register_forward_pre_hook(
                _reset_index_losses, with_kwargs=True))
    if hasattr(model.config, "text_config"):
        model.set_attn_implementation({"text_config": ATTENTION_NAME})
    else:
        model.set_attn_implementation(ATTENTION_NAME)
    return model


def index_losses(model: PreTrainedModel) -> list[torch.Tensor]:
    """The sparse layers' index losses from the model's latest forward, to add to the loss linearly.

    In training with `index_loss="sparse"` they are placeholders of value 0 whose backward computes
    the loss (as `msa_attention(..., index_loss=True)`); `index_loss_values` gives the values.
    Read with grad enabled, losses without autograd history (reentrant checkpointing, no_grad) of
    indexers that require grad give a `TorchMSAWarning`.

    Args:
        model: a model switched with `use_torch_msa(model, index_loss=...)`.

    Returns:
        One 0-D tensor per sparse layer (fp32; fp64 for an fp64 model), in layer order,
        differentiable in the indexers' parameters (and the trunk's without detached inputs).

    Raises:
        ValueError: `model` was not switched with an `index_loss`, or a sparse layer has no index
            loss from the latest forward.
    """
    indexers = _indexers_with_losses(model)
    losses = [cast(torch.Tensor, indexer.index_loss) for indexer in indexers]
    if torch.is_grad_enabled():
        detached = [indexer.layer_idx for indexer, loss in zip(indexers, losses)
                    if not loss.requires_grad and any(p.requires_grad for p in indexer.parameters())]
        if detached:
            warnings.warn(
                f"index_losses: the KLs of layers {detached} have no autograd history, so they cannot train the "
                "indexers: their forward ran without autograd (under torch.no_grad, or in reentrant gradient "
                "checkpointing, which runs the first forward so; enable checkpointing with use_reentrant=False)",
                TorchMSAWarning, stacklevel=2)
    return losses


def index_loss_values(model: PreTrainedModel) -> list[torch.Tensor]:
    """The values of `index_losses(model)`, for logging: one 0-D tensor without autograd history
    per sparse layer, in layer order; in sparse training they hold the value once the backward of
    a loss using `index_losses(model)` has run.

    Raises:
        ValueError: as `index_losses`.
    """
    return [cast(torch.Tensor, indexer.index_loss_value) for indexer in _indexers_with_losses(model)]


def _indexers_with_losses(model: PreTrainedModel) -> list[TorchMSAIndexer]:
    indexers = [m for m in model.modules() if isinstance(m, TorchMSAIndexer)]
    if not indexers or any(indexer.index_loss_support is None for indexer in indexers):
        raise ValueError(f"model: expected a model switched with use_torch_msa(model, index_loss=...) with one of "
                         f"{INDEX_LOSS_SUPPORTS}, got {type(model).__name__} without an index loss")
    missing = [indexer.layer_idx for indexer in indexers if indexer.index_loss is None]
    if missing:
        raise ValueError(f"model: expected the KL of every sparse layer from the latest forward, got none for layers "
                         f"{missing}: run a forward under attn_implementation={ATTENTION_NAME!r} first")
    return indexers


register()
