"""Builders of valid MSA inputs for tests, examples and benchmarks."""

import dataclasses
from collections.abc import Sequence

import torch

from .documents import locate_queries


def pick_device(name: str | None) -> torch.device:
    """The `--device` a command-line run asked for; None picks CUDA when present, else CPU.

    Raises:
        ValueError: not a device, or CUDA on a host without it.
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
    """`(cu_seqlens_q, cu_seqlens_k)`, int32 `[B + 1]` each, of documents of these lengths
    (`k_lens` defaults to `q_lens`); ValueError when their counts differ."""
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
    """Query fragments of a self-attention pack; `rows` (int64 `[Tq]`) places each fragment query
    among the pack's queries."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    fragment_documents: torch.Tensor
    fragment_starts: torch.Tensor
    rows: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def op_args(self) -> tuple:
        return self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fragment_documents, self.fragment_starts


def fragments(
    lengths: Sequence[int], pieces: Sequence[tuple[int, int, int]], device: torch.device | str = "cpu"
) -> Fragments:
    """Fragments of a self-attention pack of documents with `lengths` tokens; `pieces` are
    `(document, start, length)` per fragment, in packed order."""
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
    """A random valid selection, int32 `[Hkv, Tq, topk]` on cu_seqlens_q's device (reads the
    boundaries on the host): `min(topk - 1, nvb - 1)` distinct random non-local blocks, then the
    local block, then `-1`. `generator` is a CPU one."""
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
    """The most lopsided valid selection, int32 `[Hkv, Tq, topk]`: block 0, the newest non-local
    blocks, then the local one, so every query reads block 0 (worst balance for KV-outer kernels)."""
    num_queries, num_keys = int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])
    position = locate_queries(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys).position
    local = torch.where(position >= 0, position // block_size, -1)[:, None]  # nvb - 1
    kept = local.clamp(min=0, max=topk - 1)
    slots = torch.arange(topk, device=position.device)[None, :]
    newest = local - kept + slots  # slots 1 .. kept - 1 take the newest non-local blocks
    chosen = torch.where(slots == 0, 0, newest)
    chosen = torch.where(slots < kept, chosen, torch.where((slots == kept) & (local >= 0), local, -1))
    return chosen.to(torch.int32).expand(num_kv_heads, -1, -1).contiguous()
