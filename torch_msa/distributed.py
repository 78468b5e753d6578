"""Context parallelism: one packed batch of MSA over the ranks of a `torch.distributed` group.

Every rank holds a share of the tokens (`load_balanced_layout`), all-gathers K, V and the index
keys (a query may select any earlier block of its document, so a ring would not do), and selects
and attends for its own queries as fragments of the gathered documents. The gathers' backward
reduce-scatters the gradients to the owning ranks, so each rank's gradients are those of the sum
of the ranks' losses. Every call is a collective: all ranks make the same calls in the same order,
with the same `requires_grad` settings. Design, costs and backends: docs/context_parallelism.md.
"""

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Literal, overload

import torch
import torch.distributed as dist

from . import api
from .api import AttentionOutput, MSABlocksOutput, MSALseBlocksOutput, MSAResult
from .contract import DEFAULT_BLOCK_SIZE, DEFAULT_TOPK, INDEX_DTYPE

# Recent torch names the tensor collectives `*_single` and deprecates the old names, which older
# versions have alone.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True, eq=False)
class ContextParallelLayout:
    """One rank's share of a packed batch, from `load_balanced_layout`.

    Attributes:
        world_size, rank, num_tokens: the group, this rank's place in it, and `T`.
        padded_local_tokens: the largest local token count over the ranks (the collectives' rows).
        rows, positions: int64 `[Tl]`, the whole pack's row and the in-document position of each
            local token, in local order.
        cu_seqlens_q, fragment_documents, fragment_starts, max_seqlen_q: the local queries as
            `F = 2 x B` fragments on every rank (empty ones included).
        cu_seqlens_k, max_seqlen_k: the whole pack's documents (the gathered keys).
        gathered_rows: int64 `[T]`, each token's row in the rank-major gather
            (`world_size x padded_local_tokens` rows): the permutation back to packed order.
    """

    world_size: int
    rank: int
    num_tokens: int
    padded_local_tokens: int
    rows: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    fragment_documents: torch.Tensor
    fragment_starts: torch.Tensor
    max_seqlen_q: int
    cu_seqlens_k: torch.Tensor
    max_seqlen_k: int
    gathered_rows: torch.Tensor

    @property
    def num_local_tokens(self) -> int:
        """`Tl`, this rank's token count."""
        return self.rows.shape[0]

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's `Tl` rows along `dim` of a tensor with the whole pack's `T` (a copy).

        Raises:
            TypeError: `x` is not a tensor.
            ValueError: `x` has not `T` tokens along `dim`.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[dim] != self.num_tokens:
            raise ValueError(f"x: expected {self.num_tokens} tokens (the whole pack) along dim {dim}, "
                             f"got shape {tuple(x.shape)}")
        return x.index_select(dim, self.rows.to(x.device))

    def _documents(self):
        return self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k

    def _fragments(self):
        return dict(fragment_documents=self.fragment_documents, fragment_starts=self.fragment_starts)


def _host_boundaries(cu_seqlens) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex \
                or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens: expected a 1-D integer tensor [B + 1], got {cu_seqlens.dtype} "
                            f"of shape {tuple(cu_seqlens.shape)}")
        bounds = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, Sequence) and all(isinstance(b, int) and not isinstance(b, bool) for b in cu_seqlens):
        bounds = list(cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens: expected a sequence of ints or a 1-D integer tensor, got {type(cu_seqlens).__name__}")
    if len(bounds) < 1 or bounds[0] != 0:
        raise ValueError(f"cu_seqlens: expected boundaries [B + 1] starting at 0, got {bounds[:8]}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: expected non-decreasing boundaries, got {bounds[:16]}")
    if bounds[-1] > torch.iinfo(INDEX_DTYPE).max:
        raise ValueError(f"cu_seqlens: expected at most {torch.iinfo(INDEX_DTYPE).max} tokens, got {bounds[-1]}")
    return bounds


def _chunk_sizes(length: int, world_size: int, first_owner: int) -> list[int]:
    """Sizes of a document's `2 x world_size` chunks; the remainder tokens go to the ranks in turn
    from `first_owner` (late chunk first), so many documents' remainders spread over all ranks."""
    chunks = 2 * world_size
    sizes = [length // chunks] * chunks
    for turn in range(length % chunks):
        owner = (first_owner + turn) % world_size
        sizes[chunks - 1 - owner if turn < world_size else owner] += 1
    return sizes


def load_balanced_layout(cu_seqlens: torch.Tensor | Sequence[int], world_size: int, rank: int, *,
                         device: torch.device | str | None = None) -> ContextParallelLayout:
    """Split a pack of self-attention documents over `world_size` ranks; return `rank`'s share.

    Each document is cut into `2 x world_size` contiguous chunks (sizes differ by at most one) and
    rank `r` takes chunks `r` and `2 x world_size - 1 - r`, pairing early with late causal work.
    Host-side and deterministic: every rank builds its own layout without communication.

    Args:
        cu_seqlens: `[B + 1]` boundaries of the whole pack (host ints, or an integer tensor, read
            with one host sync), `Lq == Lk` per document.
        world_size: ranks in the context-parallel group; rank: this rank, `0 <= rank < world_size`.
        device: where the layout's tensors live; defaults to `cu_seqlens`'s (CPU for host ints).

    Returns:
        The `ContextParallelLayout` of `rank`.

    Raises:
        TypeError: `world_size` or `rank` is not an int, or `cu_seqlens` is neither a sequence of
            ints nor a 1-D integer tensor.
        ValueError: `world_size < 1`, `rank` outside `[0, world_size)`, or boundaries that do not
            start at 0, decrease, or exceed int32.
    """
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank}")
    bounds = _host_boundaries(cu_seqlens)
    if device is None:
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else torch.device("cpu")

    chunks = 2 * world_size
    # Per rank: (global start, length, document, document-local start) of its chunks, local order.
    segments: list[list[tuple[int, int, int, int]]] = [[] for _ in range(world_size)]
    first_owner = 0
    for document, (begin, end) in enumerate(zip(bounds, bounds[1:])):
        sizes = _chunk_sizes(end - begin, world_size, first_owner)
        first_owner = (first_owner + (end - begin) % chunks) % world_size
        starts = [0, *itertools.accumulate(sizes)]
        for owner in range(world_size):
            for chunk in (owner, chunks - 1 - owner):
                segments[owner].append((begin + starts[chunk], sizes[chunk], document, starts[chunk]))
    counts = [sum(length for _, length, _, _ in mine) for mine in segments]
    padded = max(counts)

    def expand(offsets, lengths):
        lengths = torch.tensor(lengths, dtype=torch.int64)
        offsets = torch.tensor(offsets, dtype=torch.int64)
        return torch.repeat_interleave(offsets, lengths) + torch.arange(int(lengths.sum()), dtype=torch.int64)

    # Segments in packed order tile [0, T); each maps to its place in the rank-major gather.
    placed = []
    for owner, mine in enumerate(segments):
        local = 0
        for start, length, _, _ in mine:
            placed.append((start, length, owner * padded + local))
            local += length
    placed.sort(key=lambda segment: segment[0])
    gathered_rows = expand([gather - start for start, _, gather in placed], [length for _, length, _ in placed])

    mine = segments[rank]
    lengths = [length for _, length, _, _ in mine]
    local_starts = [0, *itertools.accumulate(lengths)][:-1]
    rows = expand([start - local for (start, _, _, _), local in zip(mine, local_starts)], lengths)
    positions = expand([start - local for (_, _, _, start), local in zip(mine, local_starts)], lengths)

    def int32(values):
        return torch.tensor(values, dtype=INDEX_DTYPE, device=device)

    return ContextParallelLayout(
        world_size=world_size,
        rank=rank,
        num_tokens=bounds[-1],
        padded_local_tokens=padded,
        rows=rows.to(device),
        positions=positions.to(device),
        cu_seqlens_q=int32([0, *itertools.accumulate(lengths)]),
        fragment_documents=int32([document for _, _, document, _ in mine]),
        fragment_starts=int32([start for _, _, _, start in mine]),
        max_seqlen_q=max(lengths, default=0),
        cu_seqlens_k=int32(bounds),
        max_seqlen_k=max((b - a for a, b in zip(bounds, bounds[1:])), default=0),
        gathered_rows=gathered_rows.to(device),
    )


def _check_group(layout, group) -> None:
    if not isinstance(layout, ContextParallelLayout):
        raise TypeError(f"layout: expected a ContextParallelLayout (from load_balanced_layout), got {type(layout).__name__}")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (layout.world_size, layout.rank) != (world_size, rank):
        raise ValueError(f"layout: expected a layout for rank {rank} of {world_size} (this process in the group), "
                         f"got rank {layout.rank} of {layout.world_size}")


def _check_local(layout, dim=0, **tensors) -> None:
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[dim] != layout.num_local_tokens:
            raise ValueError(f"{name}: expected this rank's {layout.num_local_tokens} tokens along dim {dim} "
                             f"(layout.num_local_tokens), got shape {tuple(x.shape)}")


class _PendingGather:
    """An all-gather under way: the rank-major buffer it fills and the handle to wait on."""

    def __init__(self, local: torch.Tensor, layout: ContextParallelLayout, group):
        local = local.detach()
        padded = layout.padded_local_tokens
        if local.shape[0] < padded:
            local = torch.cat([local, local.new_zeros((padded - local.shape[0], *local.shape[1:]))])
        self._sent = local.contiguous()
        self.buffer = local.new_empty((layout.world_size * padded, *local.shape[1:]))
        # Shapes are equal on every rank, so every rank skips an empty gather alike.
        self._work = _all_gather_into(self.buffer, self._sent, group=group, async_op=True) if self.buffer.numel() else None

    def result(self, layout: ContextParallelLayout) -> torch.Tensor:
        """Wait, then return the gathered tokens in packed order `[T, ...]`."""
        if self._work is not None:
            self._work.wait()
        gathered = self.buffer.index_select(0, layout.gathered_rows)
        del self.buffer, self._sent, self._work  # free the rank-major copy now, not at the caller's return
        return gathered


class _GatheredTokens(torch.autograd.Function):
    """Finishes started all-gathers; the backward reduce-scatters the gradients to their owners."""

    @staticmethod
    def forward(ctx, layout, group, pending, *local):
        ctx.layout, ctx.group = layout, group
        return tuple(gather.result(layout) for gather in pending)

    @staticmethod
    def backward(ctx, *grads):
        layout, group = ctx.layout, ctx.group
        scatters = []
        for needed, grad in zip(ctx.needs_input_grad[3:], grads):
            if not needed:
                scatters.append(None)
                continue
            rank_major = grad.new_zeros((layout.world_size * layout.padded_local_tokens, *grad.shape[1:]))
            rank_major.index_copy_(0, layout.gathered_rows, grad)
            own = grad.new_empty((layout.padded_local_tokens, *grad.shape[1:]))
            work = (_reduce_scatter_into(own, rank_major, op=dist.ReduceOp.SUM, group=group, async_op=True)
                    if rank_major.numel() else None)
            scatters.append((work, own, rank_major))
        local_grads = []
        for scatter in scatters:
            if scatter is None:
                local_grads.append(None)
                continue
            work, own, _ = scatter
            if work is not None:
                work.wait()
            local_grads.append(own[: layout.num_local_tokens])
        return (None, None, None, *local_grads)


def _gather(layout, group, pending, *local):
    return _GatheredTokens.apply(layout, group, pending, *local)


def all_gather_tokens(x: torch.Tensor, layout: ContextParallelLayout, group: dist.ProcessGroup | None = None, *,
                      dim: int = 0) -> torch.Tensor:
    """Gather every rank's local tokens (`Tl` along `dim`) into the whole pack's order (`T`).

    The inverse of `layout.shard` across the group; differentiable (the backward sums the ranks'
    gradients and returns each rank its rows).

    Args:
        x: this rank's tensor, `layout.num_local_tokens` tokens along `dim`, any dtype, on the
            group's device (the same dtype and trailing shape on every rank).
        layout: this rank's `load_balanced_layout`, on x's device.
        group: the context-parallel process group (default: the world).
        dim: the token dimension.

    Returns:
        `T = layout.num_tokens` tokens along `dim`, x's dtype and device.

    Raises:
        TypeError: `layout` is not a `ContextParallelLayout` or `x` is not a tensor.
        ValueError: `layout` is not this rank's, or `x` has not `num_local_tokens` along `dim`.
    """
    _check_group(layout, group)
    _check_local(layout, dim, x=x)
    tokens_first = x.movedim(dim, 0)
    (gathered,) = _gather(layout, group, [_PendingGather(tokens_first, layout, group)], tokens_first)
    return gathered.movedim(0, dim)


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    layout: ContextParallelLayout, group: dist.ProcessGroup | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[False] = ..., return_block_indices: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    layout: ContextParallelLayout, group: dist.ProcessGroup | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[True], return_block_indices: Literal[False] = ...,
) -> AttentionOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    layout: ContextParallelLayout, group: dist.ProcessGroup | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[False] = ..., return_block_indices: Literal[True],
) -> MSABlocksOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    layout: ContextParallelLayout, group: dist.ProcessGroup | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: Literal[True], return_block_indices: Literal[True],
) -> MSALseBlocksOutput: ...


@overload
def msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index_q: torch.Tensor, index_k: torch.Tensor,
    layout: ContextParallelLayout, group: dist.ProcessGroup | None = ..., *,
    topk: int = ..., block_size: int = ..., softmax_scale: float | None = ...,
    return_lse: bool = ..., return_block_indices: bool = ...,
) -> torch.Tensor | AttentionOutput | MSABlocksOutput | MSALseBlocksOutput: ...


def msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    layout: ContextParallelLayout,
    group: dist.ProcessGroup | None = None,
    *,
    topk: int = DEFAULT_TOPK,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    return_block_indices: bool = False,
) -> torch.Tensor | MSAResult:
    """`torch_msa.msa_attention` for this rank's tokens, reading the keys of the whole group.

    The gathers of K and V overlap the selection over the gathered index keys; the backward
    reduce-scatters dK and dV to the ranks that own the keys.

    Args:
        q: `[Tl, Hq, D]`; k, v: `[Tl, Hkv, D]`; index_q: `[Tl, Hi, Di]`; index_k: `[Tl, 1, Di]`:
            this rank's tokens (`layout.shard`); dtypes as in `torch_msa.msa_attention`.
        layout: this rank's `load_balanced_layout`, on the device of the inputs.
        group: the context-parallel process group (default: the world).
        topk, block_size, softmax_scale, return_lse, return_block_indices: as in
            `torch_msa.msa_attention`.

    Returns:
        As `torch_msa.msa_attention` returns them, for the local tokens (`Tl` rows). `index_q`
        and `index_k` get no gradient: train them with `indexer_kl_loss`.

    Raises:
        TypeError, ValueError: `layout` is not this rank's `ContextParallelLayout`, an input has
            not `layout.num_local_tokens` rows, or breaks `torch_msa.msa_attention`'s contract.
    """
    _check_group(layout, group)
    _check_local(layout, q=q, k=k, v=v, index_q=index_q, index_k=index_k)
    index_keys = _PendingGather(index_k, layout, group).result(layout)
    keys_values = [_PendingGather(k, layout, group), _PendingGather(v, layout, group)]
    block_indices = api.select_blocks(index_q, index_keys, *layout._documents(), topk=topk, block_size=block_size,
                                      **layout._fragments())
    keys, values = _gather(layout, group, keys_values, k, v)
    out, lse = api.sparse_attention(q, keys, values, block_indices, *layout._documents(), block_size=block_size,
                                    softmax_scale=softmax_scale, return_lse=True, **layout._fragments())
    return api._msa_result(out, return_lse=return_lse, return_block_indices=return_block_indices, index_loss=False,
                           lse=lse, block_indices=block_indices)


def _share_of_the_mean(loss, layout):
    """Scaled by `Tl / T`, the ranks' local means sum to the mean over the whole pack."""
    return loss * (layout.num_local_tokens / layout.num_tokens) if layout.num_tokens else loss


def _gather_teacher_and_student_keys(k, index_k, layout, group):
    """The gathered keys (the teacher's, a constant) and index keys (differentiable)."""
    pending_keys = _PendingGather(k, layout, group)
    (index_keys,) = _gather(layout, group, [_PendingGather(index_k, layout, group)], index_k)
    return pending_keys.result(layout), index_keys


def indexer_kl_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    block_indices: torch.Tensor,
    layout: ContextParallelLayout,
    group: dist.ProcessGroup | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softmax_scale: float | None = None,
    index_softmax_scale: float | None = None,
) -> torch.Tensor:
    """This rank's share of `torch_msa.indexer_kl_loss` over the whole pack.

    Scaled by `Tl / T`, so the SUM of the ranks' losses is the single-process loss; all-reduce a
    detached copy to log it. It gathers K and the index keys itself.

    Args:
        q, k, lse, index_q, index_k, block_indices: this rank's tokens (`block_indices
            [Hkv, Tl, topk]`), as in `torch_msa.indexer_kl_loss`; `lse` and `block_indices` from
            this module's `msa_attention`.
        layout, group: as in `msa_attention`.
        block_size, softmax_scale, index_softmax_scale: as in `torch_msa.indexer_kl_loss`.

    Returns:
        A 0-D tensor (fp32; fp64 for fp64 index inputs), this rank's share. Gradients reach
        `index_q` and `index_k`.

    Raises:
        TypeError, ValueError: as `msa_attention` raises them, for `torch_msa.indexer_kl_loss`'s
            contract.
    """
    _check_group(layout, group)
    _check_local(layout, q=q, k=k, lse=lse, index_q=index_q, index_k=index_k)
    keys, index_keys = _gather_teacher_and_student_keys(k, index_k, layout, group)
    loss = api.indexer_kl_loss(q, keys, lse, index_q, index_keys, block_indices, *layout._documents(),
                               block_size=block_size, softmax_scale=softmax_scale,
                               index_softmax_scale=index_softmax_scale, **layout._fragments())
    return _share_of_the_mean(loss, layout)


def indexer_kl_loss_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    layout: ContextParallelLayout,
    group: dist.ProcessGroup | None = None,
    *,
    lse: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    softmax_scale: float | None = None,
    index_softmax_scale: float | None = None,
) -> torch.Tensor:
    """This rank's share of `torch_msa.indexer_kl_loss_dense` over the whole pack, as `indexer_kl_loss`.

    Args:
        q, k, index_q, index_k: this rank's tokens, as in `indexer_kl_loss`.
        layout, group: as in `msa_attention`.
        lse: the dense attention's `[Tl, Hq]` log-sum-exp of the local queries; computed when omitted.
        block_size, softmax_scale, index_softmax_scale: as in `torch_msa.indexer_kl_loss_dense`.

    Returns:
        A 0-D tensor as `indexer_kl_loss` returns it. Gradients reach `index_q` and `index_k`.

    Raises:
        TypeError, ValueError: as `indexer_kl_loss` raises them.
    """
    _check_group(layout, group)
    _check_local(layout, q=q, k=k, index_q=index_q, index_k=index_k)
    if lse is not None:
        _check_local(layout, lse=lse)
    keys, index_keys = _gather_teacher_and_student_keys(k, index_k, layout, group)
    loss = api.indexer_kl_loss_dense(q, keys, index_q, index_keys, *layout._documents(), lse=lse,
                                     block_size=block_size, softmax_scale=softmax_scale,
                                     index_softmax_scale=index_softmax_scale, **layout._fragments())
    return _share_of_the_mean(loss, layout)


__all__ = [
    "ContextParallelLayout",
    "all_gather_tokens",
    "indexer_kl_loss",
    "indexer_kl_loss_dense",
    "load_balanced_layout",
    "msa_attention",
]
