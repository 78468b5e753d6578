"""Where each packed query token sits inside its document.

Inside a document with `Lq <= Lk` tokens the queries are the causal suffix of the keys: local
query `t` sits at key position `p(t) = Lk - Lq + t`. With fragments, query `i` of fragment `f`
sits at `fragment_starts[f] + i` of document `fragment_documents[f]`; the suffix rule is the case
`fragment_documents = [0, ..., B - 1]`, `fragment_starts[b] = Lk - Lq`. No host sync, so it is
safe inside CUDA-graph capture.
"""

import dataclasses
from typing import NamedTuple

import torch

FRAGMENT_ARGUMENTS = ("fragment_documents", "fragment_starts")
"""The names of the optional fragment pair, the trailing arguments of every op."""

DOCUMENT_ARGUMENTS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", *FRAGMENT_ARGUMENTS)
"""The names of the ops' six document arguments, the fields of `Documents` in that order."""


class QueryDocuments(NamedTuple):
    """Per query, int64 `[Tq]`: `key_start`, the packed row of its document's first key, and
    `position`, `p(t)`, or `-1` (sees no key) where no well-formed document covers it."""

    key_start: torch.Tensor
    position: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Documents:
    """The six document arguments of one op call, as given (the op's checks vouch for them).

    `cu_seqlens_q` int32 `[B + 1]` (`[F + 1]` with fragments), `cu_seqlens_k` int32 `[B + 1]`,
    host-int bounds `max_seqlen_q` / `max_seqlen_k`, and int32 `[F]` fragments (both or None).
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    fragment_documents: torch.Tensor | None = None
    fragment_starts: torch.Tensor | None = None

    @property
    def has_fragments(self) -> bool:
        """Whether fragments are given (the checks require both or neither)."""
        return self.fragment_documents is not None or self.fragment_starts is not None

    @property
    def fragments(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            return self.fragment_documents, self.fragment_starts

    @property
    def num_documents(self) -> int:
        """`B`, the documents of `cu_seqlens_k`."""
        return self.cu_seqlens_k.shape[0] - 1

    def map_tensors(self, function) -> "Documents":
        """The same documents with `function` applied to each tensor (`.cpu()`, `.contiguous()`)."""
        fragments = (None if x is None else function(x) for x in self.fragments)
        return Documents(function(self.cu_seqlens_q), function(self.cu_seqlens_k), self.max_seqlen_q,
                         self.max_seqlen_k, *fragments)

    def locate(self, num_queries: int, num_keys: int) -> QueryDocuments:
        """`locate_queries` of these documents: every query row's key offset and causal position."""
        return locate_queries(self.cu_seqlens_q, self.cu_seqlens_k, num_queries, num_keys, *self.fragments)

    def locate_with_documents(self, num_queries: int, num_keys: int) -> tuple[torch.Tensor, QueryDocuments]:
        """`(document, located)`: `locate` of these documents, and each query's document of
        `cu_seqlens_k` (int64 `[Tq]`, 0 where `located.position` is -1), from one lookup."""
        document, key_start, position, valid = _locate(self.cu_seqlens_q, self.cu_seqlens_k, num_queries, num_keys,
                                                       *self.fragments)
        return torch.where(valid, document, 0), QueryDocuments(torch.where(valid, key_start, 0),
                                                                torch.where(valid, position, -1))

    def token_fragments(self, num_queries: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`token_fragments` of these documents: every query as a one-token fragment."""
        return token_fragments(self.cu_seqlens_q, self.cu_seqlens_k, num_queries, num_keys, *self.fragments)


def locate_queries(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_queries: int,
    num_keys: int,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> QueryDocuments:
    """Every packed query row's document key offset and causal position.

    Positions that would fall outside the `num_keys` rows are `-1`, so malformed boundaries never
    produce an out-of-range key row. Fragments: int32 `[F]` each, or None (the suffix rule).
    """
    _, key_start, position, valid = _locate(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys,
                                            fragment_documents, fragment_starts)
    return QueryDocuments(torch.where(valid, key_start, 0), torch.where(valid, position, -1))


def token_fragments(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    num_queries: int,
    num_keys: int,
    fragment_documents: torch.Tensor | None = None,
    fragment_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query token as a fragment of its own: int32 `(documents [Tq], starts [Tq])`.

    Placed by `locate_queries`'s rule; a token no well-formed document covers gets document `-1`.
    Any run `[a, b)` is then exactly the fragments `documents[a:b]`, `starts[a:b]` over
    `cu_seqlens_q = arange(b - a + 1)` (how `torch_msa/query_windows.py` splits a forward).
    """
    document, _, position, valid = _locate(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys,
                                           fragment_documents, fragment_starts)
    return (torch.where(valid, document, -1).to(torch.int32), torch.where(valid, position, 0).to(torch.int32))


def _locate(cu_seqlens_q, cu_seqlens_k, num_queries, num_keys, fragment_documents, fragment_starts):
    """`(document, key_start, position, valid)` per query, int64 `[Tq]` each (`valid` bool)."""
    device = cu_seqlens_q.device
    cu_q = cu_seqlens_q.to(torch.int64)
    cu_k = cu_seqlens_k.to(torch.int64)
    num_segments = cu_q.numel() - 1
    tokens = torch.arange(num_queries, device=device, dtype=torch.int64)
    if num_segments < 1 or cu_k.numel() < 2:
        zeros = torch.zeros_like(tokens)
        return zeros, zeros, zeros, torch.zeros_like(tokens, dtype=torch.bool)
    # right=True skips empty documents (repeated boundaries).
    segment = torch.searchsorted(cu_q[1:].contiguous(), tokens, right=True)
    in_range = segment < num_segments
    segment = segment.clamp(max=num_segments - 1)
    q_start, q_end = cu_q[segment], cu_q[segment + 1]
    if fragment_documents is None or fragment_starts is None:
        doc = segment
        k_start, k_end = cu_k[doc], cu_k[doc + 1]
        position = (k_end - k_start) - (q_end - q_start) + (tokens - q_start)
    else:
        # A document id out of range marks the fragment's queries invisible instead of reading
        # another document's boundaries.
        num_key_docs = cu_k.numel() - 1
        doc = fragment_documents.to(torch.int64)[segment]
        in_range &= (doc >= 0) & (doc < num_key_docs)
        doc = doc.clamp(0, num_key_docs - 1)
        k_start, k_end = cu_k[doc], cu_k[doc + 1]
        position = fragment_starts.to(torch.int64)[segment] + (tokens - q_start)
    valid = (
        in_range
        & (tokens >= q_start)
        & (position >= 0)
        & (k_start >= 0)
        & (k_start + position < k_end)
        & (k_start + position < num_keys)
    )
    return doc, k_start, position, valid
