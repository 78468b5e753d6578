"""The exact MSA mask as a FlexAttention BlockMask, built from the block indices directly.

Layout ("heads folded into the query axis"): FlexAttention sees one head per KV head, and the
query rows of KV head `r` are `t * G + g` for token `t` and its query head `r * G + g`
(`G = Hq / Hkv`). A 128-row query tile is then `128 / G` consecutive tokens (8 for M3) with all
their heads, which share one selection, so a tile's KV blocks are the union of 8 selections.

`create_block_mask` would evaluate the mask densely (`T * G x T` points); here the tile x KV-block
structure is scattered from the `Hkv * T * topk` selected ids instead:

* a tile needs a KV block when any of its tokens selected a document-local block overlapping it
  (a document that does not start on a block boundary makes one local block straddle two);
* the block is *full* (no mask evaluation) when every token of the tile selected it, the
  document starts on a block boundary, and the whole block is causally visible to each token;
* every other needed block is *partial*: the `mask_mod` checks the exact membership of the key's
  local block in the token's selection (a bitset, 16 blocks per int32 word), causality, and the
  document.
"""

import dataclasses

import torch

from torch_msa.plan.schedule import valid_entries

TILE_ROWS = 128  # query rows of one FlexAttention block (the BlockMask's Q block size)
_BITS_PER_WORD = 16  # int32 words, bits 0..15: no sign bit involved when bits are summed


@dataclasses.dataclass(frozen=True)
class MaskStats:
    """Mean KV blocks per query tile of the BlockMask: `partial` (masked) and `full`; `tokens_per_tile`
    tokens share a tile. (The selection's own union statistics: `torch_msa.selection_stats`.)"""

    partial: float
    full: float
    tokens_per_tile: int

    def describe(self) -> str:
        return (f"BlockMask of {self.tokens_per_tile}-token tiles: {self.partial:.1f} masked and {self.full:.1f} "
                f"full KV blocks per {TILE_ROWS}-row tile")


def fold_query_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[T, Hq, D]` -> contiguous `[1, Hkv, T * G, D]`, row `t * G + g` = head `r * G + g` of token `t`."""
    tokens, query_heads, head_dim = x.shape
    return x.view(tokens, kv_heads, query_heads // kv_heads, head_dim).transpose(0, 1).reshape(1, kv_heads, -1, head_dim)


def kv_heads_first(x: torch.Tensor) -> torch.Tensor:
    """`[T, Hkv, D]` -> contiguous `[1, Hkv, T, D]`."""
    return x.transpose(0, 1).unsqueeze(0).contiguous()


def _ordered(needed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool `[1, H, tiles, kv_blocks]` -> (int32 counts `[1, H, tiles]`, int32 ids `[1, H, tiles, kv_blocks]`).

    The ids of each row start with its needed blocks in ascending order. The index tensor keeps the
    full `kv_blocks` width: older torch releases derive the number of KV blocks from it when they
    transpose the mask for the backward, and the CPU kernel requires it.
    """
    counts = needed.sum(-1, dtype=torch.int32)
    order = torch.argsort(needed.to(torch.uint8), dim=-1, descending=True, stable=True)
    return counts, order.to(torch.int32).contiguous()


def msa_block_mask(block_indices: torch.Tensor, key_start: torch.Tensor, position: torch.Tensor,
                   num_keys: int, group: int, block_size: int):
    """The BlockMask of MSA with folded heads, and its statistics.

    Args:
        block_indices: int32 `[Hkv, T, topk]` (document-local block ids, the op contract).
        key_start: int64 `[T]`, packed row of each token's first document key.
        position: int64 `[T]`, `p(t)`; `-1` sees nothing.
        num_keys: packed key rows (KV length).
        group: `G = Hq / Hkv`; must divide 128.
        block_size: keys per block (the BlockMask's KV block size).

    Returns:
        `(BlockMask, MaskStats)`; the statistics sync with the host.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if group < 1 or TILE_ROWS % group:
        raise ValueError(f"group: expected Hq / Hkv dividing {TILE_ROWS} (a query tile holds whole tokens), got {group}")
    kv_heads, tokens, topk = block_indices.shape
    device = block_indices.device
    tokens_per_tile = TILE_ROWS // group
    num_tiles = -(-tokens // tokens_per_tile)
    num_kv_blocks = -(-num_keys // block_size)

    ids = block_indices.to(torch.int64)
    start = key_start.view(1, -1, 1)
    pos = position.view(1, -1, 1)
    valid = valid_entries(block_indices, position, block_size)
    first_kv_block = (start + ids * block_size) // block_size
    last_kv_block = (start + torch.minimum(ids * block_size + block_size - 1, pos)) // block_size
    whole = valid & (start % block_size == 0) & (ids * block_size + block_size - 1 <= pos)

    head = torch.arange(kv_heads, device=device).view(-1, 1, 1)
    tile = (torch.arange(tokens, device=device) // tokens_per_tile).view(1, -1, 1)
    cell = (head * num_tiles + tile) * num_kv_blocks  # first (head, tile, kv block) cell of the row
    discard = kv_heads * num_tiles * num_kv_blocks  # one extra cell takes the invalid slots

    def count(mask, kv_block):
        counts = torch.zeros(discard + 1, dtype=torch.int32, device=device)
        cells = torch.where(mask, cell + kv_block, discard).view(-1)
        counts.scatter_add_(0, cells, torch.ones_like(cells, dtype=torch.int32))
        return counts[:discard].view(1, kv_heads, num_tiles, num_kv_blocks)

    touched = (count(valid, first_kv_block) + count(valid, last_kv_block)) > 0
    # A tile with fewer tokens (the ragged tail) never reaches the count, so it stays partial.
    full = count(whole, first_kv_block) == tokens_per_tile
    partial_counts, partial_ids = _ordered(touched & ~full)
    full_counts, full_ids = _ordered(full)

    words = -(-num_kv_blocks // _BITS_PER_WORD)
    bit_cell = (head * tokens + torch.arange(tokens, device=device).view(1, -1, 1)) * words
    bits_discard = kv_heads * tokens * words
    word_cells = torch.where(valid, bit_cell + ids.clamp(min=0) // _BITS_PER_WORD, bits_discard).view(-1)
    word_bits = torch.where(valid, 1 << (ids.clamp(min=0) % _BITS_PER_WORD), 0).to(torch.int32).view(-1)
    # Valid ids of a row are distinct, so summing their bits is the same as or-ing them.
    bits = torch.zeros(bits_discard + 1, dtype=torch.int32, device=device)
    bits.scatter_add_(0, word_cells, word_bits)
    bits = bits[:bits_discard].view(kv_heads, tokens, words)

    def mask_mod(batch, kv_head, q_idx, kv_idx):
        token = q_idx // group
        local = kv_idx - key_start[token]
        visible = (local >= 0) & (local <= position[token])
        block = torch.where(local >= 0, local, 0) // block_size
        word = bits[kv_head, token, block // _BITS_PER_WORD]
        return visible & (((word >> (block % _BITS_PER_WORD)) & 1) == 1)

    block_mask = BlockMask.from_kv_blocks(
        partial_counts, partial_ids, full_counts, full_ids,
        BLOCK_SIZE=(TILE_ROWS, block_size), mask_mod=mask_mod, seq_lengths=(tokens * group, num_keys),
    )
    stats = MaskStats(
        partial=partial_counts.double().mean().item(),
        full=full_counts.double().mean().item(),
        tokens_per_tile=tokens_per_tile,
    )
    return block_mask, stats
