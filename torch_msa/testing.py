"""Builders of valid MSA inputs for tests, examples and benchmarks."""

import dataclasses
from collections.abc import Sequence

import torch

from .documents import locate_queries


def pick_device(name: str | None) -> torch.device:
    """The device a command-line run asked for.

    Args:
        name: a device name (`"cpu"`, `"cuda"`, `"cuda:1"`), or None: CUDA when present, else CPU.

    Returns:
        The `torch.device`.

    Raises:
        ValueError: the name is not a device, or names CUDA on a host without it; the message
            names the `--device` argument.
    """
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise ValueError(f"argument --device: {error}") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"argument --device: {device} requested but CUDA is not available")
    return device


def cu_seqlens(
    q_lens: Sequence[int], k_lens: Sequence[int] | None = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The document boundaries of documents of these lengths.

    Args:
        q_lens: query tokens per document.
        k_lens: key tokens per document; defaults to `q_lens`.
        device: where the boundaries live.

    Returns:
        `(cu_seqlens_q, cu_seqlens_k)`, int32 `[B + 1]` each, on `device`.

    Raises:
        ValueError: `k_lens` has not one length per document of `q_lens`.
    """
    k_lens = q_lens if k_lens is None else k_lens
    if len(q_lens) != len(k_lens):
        raise ValueError(f"k_lens: expected {len(q_lens)} lengths (one per document, like q_lens), got {len(k_lens)}")
    bounds = []
    for lens in (q_lens, k_lens):
        steps = torch.tensor([0, *lens], dtype=torch.int64)
        bounds.append(steps.cumsum(0).to(device=device, dtype=torch.int32))
    return bounds[0], bounds[1]


@dataclasses.dataclass(frozen=True)
class Fragments:
    """Query fragments of a self-attention pack (`torch_msa/documents.py`), with where each
    fragment query sits in the pack.

    Attributes:
        cu_seqlens_q: int32 `[F + 1]` fragment boundaries; cu_seqlens_k: int32 `[B + 1]` documents.
        fragment_documents, fragment_starts: int32 `[F]`.
        rows: int64 `[Tq]`, the row of each fragment query among the pack's queries (the pack
            whose queries are its keys, `cu_seqlens_q == cu_seqlens_k`).
        max_seqlen_q: the longest fragment; max_seqlen_k: the longest document.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    fragment_documents: torch.Tensor
    fragment_starts: torch.Tensor
    rows: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def op_args(self) -> tuple:
        """`(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`, the ops' document arguments."""
        return self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(fragment_documents, fragment_starts)`, the ops' trailing arguments."""
        return self.fragment_documents, self.fragment_starts


def fragments(
    lengths: Sequence[int], pieces: Sequence[tuple[int, int, int]], device: torch.device | str = "cpu"
) -> Fragments:
    """Fragments of a self-attention pack of documents with `lengths` tokens.

    Args:
        lengths: tokens per document.
        pieces: `(document, start, length)` per fragment, in packed order: the fragment holds
            the document's queries at positions `start .. start + length - 1`.
        device: where the tensors live.

    Returns:
        The `Fragments` (int32 boundaries and fragment tensors, int64 rows) on `device`.
    """
    _, cu_k = cu_seqlens(lengths, lengths, device)
    doc_start = [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()]
    rows = [doc_start[doc] + start + i for doc, start, length in pieces for i in range(length)]
    fragment_lengths = [length for _, _, length in pieces]
    cu_q, _ = cu_seqlens(fragment_lengths, fragment_lengths, device)

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return Fragments(cu_q, cu_k, int32([doc for doc, _, _ in pieces]), int32([start for _, start, _ in pieces]),
                     torch.tensor(rows, dtype=torch.int64, device=device), max(fragment_lengths, default=0),
                     max(lengths, default=0))


def random_block_indices(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_kv_heads: int,
    topk: int,
    block_size: int,
    generator: torch.Generator | None = None,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """A random selection that honours the contract.

    Each row keeps `min(topk - 1, nvb - 1)` distinct random non-local visible blocks in random
    order, then the local block, then `-1`. Reads the boundaries on the host.

    Args:
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]` document boundaries (`[F + 1]` query
            fragments with the fragment arguments).
        num_kv_heads: `Hkv`.
        topk: slots per row.
        block_size: keys per block.
        generator: the CPU random generator to draw from (default: torch's global one).
        fragment_documents, fragment_starts: int32 `[F]` query fragments, or None.

    Returns:
        int32 `[Hkv, Tq, topk]` (head-major) on cu_seqlens_q's device.
    """
    num_queries = int(cu_seqlens_q[-1])
    num_keys = int(cu_seqlens_k[-1])
    fragments = ((None, None) if fragment_documents is None or fragment_starts is None
                 else (fragment_documents.cpu(), fragment_starts.cpu()))
    position = locate_queries(cu_seqlens_q.cpu(), cu_seqlens_k.cpu(), num_queries, num_keys, *fragments).position
    visible_blocks = position // block_size + 1  # [Tq]
    max_blocks = int(visible_blocks.max()) if num_queries else 1
    noise = torch.rand(num_kv_heads, num_queries, max(1, max_blocks), generator=generator)
    block_ids = torch.arange(noise.shape[-1])
    noise = noise.masked_fill(block_ids >= (visible_blocks - 1)[:, None], 2.0)  # non-candidates last
    order = noise.argsort(-1)
    if order.shape[-1] < topk:
        order = torch.nn.functional.pad(order, (0, topk - order.shape[-1]), value=-1)
    order = order[..., :topk]
    kept = (visible_blocks - 1).clamp(min=0, max=topk - 1)[None, :, None]
    slots = torch.arange(topk)
    local = torch.where(slots == kept, (visible_blocks - 1)[None, :, None], -1)
    return torch.where(slots < kept, order, local).to(torch.int32).to(cu_seqlens_q.device)


def skewed_block_indices(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_kv_heads: int, topk: int, block_size: int
) -> torch.Tensor:
    """The most lopsided valid selection.

    Every query keeps block 0 and its newest non-local blocks, then its local block, so block 0
    of each document is read by every query of it: the worst case for a KV-outer kernel's balance.

    Args:
        cu_seqlens_q, cu_seqlens_k: int32 `[B + 1]` document boundaries.
        num_kv_heads: `Hkv`.
        topk: slots per row.
        block_size: keys per block.

    Returns:
        int32 `[Hkv, Tq, topk]` (head-major) on the cu_seqlens' device.
    """
    num_queries, num_keys = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
    position = locate_queries(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys).position
    local = torch.where(position >= 0, position // block_size, -1)[:, None]  # nvb - 1
    kept = local.clamp(min=0, max=topk - 1)
    slots = torch.arange(topk, device=position.device)[None, :]
    newest = local - kept + slots  # slots 1 .. kept - 1 take the newest non-local blocks
    chosen = torch.where(slots == 0, 0, newest)
    chosen = torch.where(slots < kept, chosen, torch.where((slots == kept) & (local >= 0), local, -1))
    return chosen.to(torch.int32).expand(num_kv_heads, -1, -1).contiguous()
