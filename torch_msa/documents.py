"""Where each packed query token sits inside its document.

Packed (THD) tensors hold documents back to back, delimited by int32 `cu_seqlens_q` and
`cu_seqlens_k`. Inside a document with `Lq <= Lk` tokens the queries are the causal suffix of
the keys: local query `t` sits at key position `p(t) = Lk - Lq + t`.

With fragments (context parallelism), `cu_seqlens_q` `[F + 1]` delimits query *fragments* and
`cu_seqlens_k` `[B + 1]` the documents: fragment `f` belongs to document `fragment_documents[f]`
and its first query sits at the document-local position `fragment_starts[f]`, so its query `i`
sits at `fragment_starts[f] + i`. Several fragments may share one document's keys. The suffix
rule is the case `fragment_documents = [0, 1, ..., B - 1]`, `fragment_starts[b] = Lk - Lq`.

Below the op schemas (`torch_msa/_schemas.py`), the six document arguments travel as one
`Documents` value, built once per op call by `torch_msa/ops.py`.

Everything here is computed on the tensors' device with no host synchronisation, so it is safe
inside CUDA-graph capture.
"""

import dataclasses
from typing import NamedTuple

import torch

FRAGMENT_ARGUMENTS = ("fragment_documents", "fragment_starts")
"""The names of the optional fragment pair, the trailing arguments of every op."""

DOCUMENT_ARGUMENTS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", *FRAGMENT_ARGUMENTS)
"""The names of the ops' six document arguments, the fields of `Documents` in that order."""


class QueryDocuments(NamedTuple):
    """Per-query document facts, each `[Tq]` int64.

    `key_start`: packed row of the first key of the query's document.
    `position`: `p(t)`, the query's key position inside its document; `-1` for a token that no
    well-formed document covers (malformed `cu_seqlens`), which then sees no key at all.
    """

    key_start: torch.Tensor
    position: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Documents:
    """The documents of one op call: boundaries, their length bounds and the optional fragments.

    `cu_seqlens_q` int32 `[B + 1]` (`[F + 1]` with fragments) and `cu_seqlens_k` int32 `[B + 1]`
    delimit the packed queries and keys; `max_seqlen_q` / `max_seqlen_k` bound the documents'
    (or fragments') query and key counts; `fragment_documents` and `fragment_starts`, int32 `[F]`
    each or both None, describe query fragments (see the module docstring). The value holds the
    op's arguments as given: the op's checks (`torch_msa/validation.py`) vouch for them.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    fragment_documents: torch.Tensor | None = None
    fragment_starts: torch.Tensor | None = None

    @property
    def has_fragments(self) -> bool:
        """Whether fragments are given (either of the pair; the checks require both or neither)."""
        return self.fragment_documents is not None or self.fragment_starts is not None

    @property
    def fragments(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`(fragment_documents, fragment_starts)`."""
        return self.fragment_documents, self.fragment_starts

    @property
    def num_documents(self) -> int:
        """`B`, the documents of `cu_seqlens_k`."""
        return self.cu_seqlens_k.shape[0] - 1

    def as_arguments(self) -> dict:
        """The six values by argument name (`DOCUMENT_ARGUMENTS`), as the ops take them."""
        return {name: getattr(self, name) for name in DOCUMENT_ARGUMENTS}

    def map_tensors(self, function) -> "Documents":
        """The same documents with `function` applied to each tensor (`.cpu()`, `.contiguous()`)."""
        fragments = (None if x is None else function(x) for x in self.fragments)
        return Documents(function(self.cu_seqlens_q), function(self.cu_seqlens_k), self.max_seqlen_q,
                         self.max_seqlen_k, *fragments)

    def locate(self, num_queries: int, num_keys: int) -> QueryDocuments:
        """`locate_queries` of these documents: every query row's key offset and causal position."""
        return locate_queries(self.cu_seqlens_q, self.cu_seqlens_k, num_queries, num_keys, *self.fragments)

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
    """Map every packed query row to its document's key offset and causal position.

    Args:
        cu_seqlens_q: int32 `[B + 1]` document boundaries, or `[F + 1]` fragment boundaries.
        cu_seqlens_k: int32 `[B + 1]` document boundaries.
        num_queries: `Tq`, rows of the packed queries.
        num_keys: `Tk`, rows of the packed keys; positions that would fall outside them are
            marked `-1`, so malformed boundaries can never produce an out-of-range key row.
        fragment_documents, fragment_starts: int32 `[F]` each, or None (the suffix rule).
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

    Query `t` belongs to document `documents[t]` at the document-local position `starts[t]`,
    both from the same rule as `locate_queries`; a token no well-formed document covers gets
    document `-1` (out of range, so it sees no key). Any run of queries `[a, b)` is then described
    exactly by the fragments `documents[a:b]`, `starts[a:b]` over `cu_seqlens_q = arange(b - a + 1)`,
    which is how a forward is split into windows of queries (`torch_msa/query_windows.py`).
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
