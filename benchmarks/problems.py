"""The benchmark's problems: document layouts, their random inputs and their block selections.

A problem is a list of document lengths packed as THD tokens (self-attention, `Lq == Lk`): one
document (`T=65536`) or a varlen pack (`pack 8x16384`). Every implementation of a problem runs on
the same tensors and the same `block_indices`.
"""

import dataclasses
import re

import torch

import torch_msa
from torch_msa.contract import Shape
from torch_msa.documents import Documents, locate_queries
from torch_msa.selection_stats import QueryOuterWork, query_outer_work, selection_sharing
from torch_msa.testing import skewed_block_indices

from . import trained_selection
from .flops import Work, work

SELECTIONS = ("index", "skewed", "tiled", "trained")


@dataclasses.dataclass(frozen=True)
class ProblemSpec:
    """Document lengths of one problem; `name` is how tables and JSON refer to it."""

    lengths: tuple[int, ...]
    pack: bool = False

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def name(self) -> str:
        if not self.pack:
            return f"T={self.tokens}"
        runs, previous, count = [], None, 0
        for length in (*self.lengths, None):
            if length == previous:
                count += 1
                continue
            if previous is not None:
                runs.append(f"{count}x{previous}" if count > 1 else str(previous))
            previous, count = length, 1
        return "pack " + "+".join(runs)


def parse_length(text: str, argument: str) -> int:
    """`"8192"`, `"8K"` or `"8k"` -> 8192 (K = 1024), `"1M"` -> 1048576 (M = 1024K); a positive int."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if match is None:
        raise ValueError(f"{argument}: expected a token count such as 8192, 8K or 1M, got {text!r}")
    value = int(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"{argument}: expected a positive token count, got {text!r}")
    return value


def parse_seqlens(texts: list[str], argument: str = "--seqlens") -> list[int]:
    """`["8K,32K", "64K"]` -> `[8192, 32768, 65536]` (commas or separate arguments); an error
    names `argument`."""
    return [parse_length(item, argument) for text in texts for item in text.split(",") if item.strip()]


def parse_pack(text: str) -> tuple[int, ...] | None:
    """A varlen pack: comma-separated `NxL` or `L` items, e.g. `8x16K` or `2x4K,8K,1000`; `none` -> None."""
    if text.strip().lower() == "none":
        return None
    lengths: list[int] = []
    for item in text.split(","):
        count, _, length = item.strip().rpartition("x")
        if count and not count.strip().isdigit():
            raise ValueError(f"--pack: expected items such as 8x16K or 4096, got {item.strip()!r}")
        repeat = int(count) if count else 1
        if repeat < 1:
            raise ValueError(f"--pack: expected a positive document count in {item.strip()!r}, got {repeat}")
        lengths += [parse_length(length, "--pack")] * repeat
    if not lengths:
        raise ValueError(f"--pack: expected at least one document length, got {text!r}")
    return tuple(lengths)


@dataclasses.dataclass
class Inputs:
    """Random bf16 inputs of one problem on its device, and the selection every implementation uses.

    q, grad_out `[T, Hq, D]`; k, v `[T, Hkv, D]`; index_q `[T, Hkv, Di]`; index_k `[T, 1, Di]`;
    cu_seqlens (int32 `[B + 1]`, shared by queries and keys); block_indices int32
    `[Hkv, T, topk]`; key_start / position int64 `[T]` (packed row of the document's first key,
    and `p(t)`).
    """

    spec: ProblemSpec
    shape: Shape
    selection: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    index_q: torch.Tensor
    index_k: torch.Tensor
    cu_seqlens: torch.Tensor
    block_indices: torch.Tensor
    key_start: torch.Tensor
    position: torch.Tensor
    work: Work

    @property
    def max_seqlen(self) -> int:
        return max(self.spec.lengths)

    @property
    def document_args(self) -> tuple:
        """`(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)` as the msa ops take them."""
        return self.cu_seqlens, self.cu_seqlens, self.max_seqlen, self.max_seqlen

    def select(self, topk: int | None = None) -> torch.Tensor:
        """torch_msa's own selection of these index inputs (int32 `[Hkv, T, topk]`; the problem's
        topk unless given)."""
        return torch_msa.select_blocks(self.index_q, self.index_k, *self.document_args,
                                       topk=self.shape.topk if topk is None else topk,
                                       block_size=self.shape.block_size)


def tile_shared(block_indices: torch.Tensor, cu_seqlens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The selection in which every query tile (the `block_size` queries of one key block of a
    document) takes the row of its last query: int32 `[Hkv, T, topk]` like `block_indices`.

    Where a document's queries and keys align (`Lq = Lk`), that query sees every block of the
    tile's rows (none lies past its own), so the result is a valid selection, and it is what a
    block-sparse kernel with one list per query tile (cuDNN's BSA) can express.
    """
    tokens = block_indices.shape[1]
    token = torch.arange(tokens, device=block_indices.device)
    document = torch.searchsorted(cu_seqlens, token, right=True) - 1
    start, end = cu_seqlens[document].long(), cu_seqlens[document + 1].long()
    tile_last = start + ((token - start) // block_size + 1) * block_size - 1
    return block_indices[:, torch.minimum(tile_last, end - 1)].contiguous()


def make_inputs(spec: ProblemSpec, shape: Shape, device: torch.device, selection: str, seed: int) -> Inputs:
    """Random unit-normal bf16 inputs (drawn on `device`, seeded) and the chosen selection."""
    if selection not in SELECTIONS:
        raise ValueError(f"selection: expected one of {SELECTIONS}, got {selection!r}")
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = spec.tokens

    def normal(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=torch.bfloat16)

    cu_seqlens = torch.tensor([0, *spec.lengths], dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    docs = locate_queries(cu_seqlens, cu_seqlens, tokens, tokens)
    q = normal(tokens, shape.query_heads, shape.head_dim)
    k = normal(tokens, shape.kv_heads, shape.head_dim)
    v = normal(tokens, shape.kv_heads, shape.head_dim)
    grad_out = normal(tokens, shape.query_heads, shape.head_dim)
    index_q = normal(tokens, shape.kv_heads, shape.index_dim)
    index_k = normal(tokens, 1, shape.index_dim)
    if selection in ("index", "tiled"):
        block_indices = torch_msa.select_blocks(index_q, index_k, cu_seqlens, cu_seqlens, max(spec.lengths),
                                                max(spec.lengths), topk=shape.topk, block_size=shape.block_size)
        if selection == "tiled":
            block_indices = tile_shared(block_indices, cu_seqlens, shape.block_size)
    elif selection == "trained":
        block_indices = trained_selection.selection_for(trained_selection.load(), spec.lengths, shape.kv_heads,
                                                        shape.topk, shape.block_size).to(device)
    else:
        # Every token picks block 0 and its newest blocks: the load-imbalance case.
        block_indices = skewed_block_indices(cu_seqlens, cu_seqlens, shape.kv_heads, shape.topk, shape.block_size)
    return Inputs(
        spec=spec, shape=shape, selection=selection, q=q, k=k, v=v, grad_out=grad_out,
        index_q=index_q, index_k=index_k, cu_seqlens=cu_seqlens, block_indices=block_indices,
        key_start=docs.key_start, position=docs.position,
        work=work(shape, spec.lengths, block_indices, docs.position),
    )


QUERY_OUTER_BACKENDS = ("triton", "sm90")
"""The forwards with a query-outer part."""


def query_outer_bound(device: torch.device, shape: Shape) -> int | None:
    """The least queries of a document whose groups the forward `device` resolves to runs
    query-outer under the current `TORCH_MSA_QUERY_OUTER`
    (`torch_msa.stages.query_outer.segment_bound`); None where it runs none."""
    backend = torch_msa.resolve("forward", device).name
    if backend not in QUERY_OUTER_BACKENDS:
        return None
    from torch_msa.sm90.common import runs_query_outer_by_default
    from torch_msa.stages.query_outer import segment_bound  # imports triton

    return segment_bound(shape.query_heads, by_default=backend == "sm90" and runs_query_outer_by_default(device))


def query_outer(inputs: Inputs, min_segment_queries: int = 0) -> QueryOuterWork:
    """The work the plan's query-outer rule takes of the problem's selection (`torch_msa.selection_stats`),
    in documents of at least `min_segment_queries` queries."""
    documents = Documents(inputs.cu_seqlens, inputs.cu_seqlens, inputs.max_seqlen, inputs.max_seqlen)
    return query_outer_work(inputs.block_indices, documents, inputs.spec.tokens, inputs.shape.query_heads,
                            inputs.shape.block_size, min_segment_queries)


def describe_sharing(inputs: Inputs) -> str:
    """The selection's union statistics (`torch_msa.selection_stats`): blocks per 8-token group and
    per 128-token tile, the share of (token, slot) pairs in blocks the whole group selects, the
    work the plan's rule runs query-outer, and how much of it the forward runs so under the
    current `TORCH_MSA_QUERY_OUTER` (`query_outer_bound`)."""
    groups = {size: selection_sharing(inputs.block_indices, inputs.cu_seqlens, group_size=size,
                                      block_size=inputs.shape.block_size).overall for size in (8, 128)}
    parts = [f"{size}-token groups read {stats.union_mean:.1f} blocks (p90 {stats.union_p90:.0f}), "
             f"{stats.shared_pairs:.0%} of their (token, slot) pairs shared" for size, stats in groups.items()]
    q_outer = query_outer(inputs)
    bound = query_outer_bound(inputs.q.device, inputs.shape)
    # With the setting on (bound 0) the forward runs what the rule takes: no second build.
    ran = 0.0 if bound is None else q_outer.entries if bound == 0 else query_outer(inputs, bound).entries
    return (f"{inputs.selection} selection: " + "; ".join(parts)
            + f"; block 0 in {groups[8].block0:.0%} of the rows with a choice; the plan's query-outer rule takes "
            f"{q_outer.entries:.0%} of the pairs ({q_outer.group_size}-token tiles {q_outer.tile_fill:.0%} full, "
            f"{q_outer.rows_without_combine:.0%} of the rows left without a combine); as TORCH_MSA_QUERY_OUTER is "
            f"set, the forward runs {ran:.0%} of the pairs query-outer")
