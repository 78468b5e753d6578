"""Padded batches `[B, S, ...]` with a mask `[B, S]` (nonzero = real) to packed documents and back.

`unpad_input` / `pad_input` drop the padding and restore it (flash-attn's `bert_padding` layout;
one host sync, any mask). `padded_cu_seqlens` keeps it in place, each row being two documents, its
real tokens and its padding (no sync, static shapes; left- or right-padded masks only). Either way
a row's real tokens start at position 0 of their document, as if run alone.
"""

import torch

from .validation import debug_enabled


def _check_mask(attention_mask: torch.Tensor, batch_size: int | None = None, seqlen: int | None = None) -> None:
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a torch.Tensor [B, S], got {type(attention_mask).__name__}")
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: expected a 2-D tensor [B, S], got shape {tuple(attention_mask.shape)}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(f"attention_mask: expected a bool or integer tensor (nonzero = real token), got {attention_mask.dtype}")
    if batch_size is not None and tuple(attention_mask.shape) != (batch_size, seqlen):
        raise ValueError(
            f"attention_mask: expected shape {(batch_size, seqlen)} to match the input's [B, S], "
            f"got {tuple(attention_mask.shape)}")


def _check_padded(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor [B, S, ...], got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{name}: expected a tensor [B, S, ...], got shape {tuple(x.shape)}")


def unpad_input(
    x: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Remove the padding of a batch (one host sync).

    Args:
        x: `[B, S, ...]`, any dtype.
        attention_mask: `[B, S]` bool or integer, nonzero at real tokens.

    Returns:
        `(packed [T, ...], indices [T] int64, cu_seqlens [B + 1] int32, max_seqlen)` on x's
        device: the real tokens in row-major order, their flat positions in `x.reshape(B * S,
        ...)`, one document per row, and the longest row as a host int.

    Raises:
        TypeError: `x` or `attention_mask` is not a tensor, or the mask is a float or complex one.
        ValueError: `x` has fewer than 2 dims, or the mask is not `[B, S]` of x's first two dims.
    """
    _check_padded("x", x)
    _check_mask(attention_mask, x.shape[0], x.shape[1])
    mask = attention_mask.to(device=x.device) != 0
    seqlens = mask.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    packed = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).index_select(0, indices)
    return packed, indices, cu_seqlens, max_seqlen


def pad_input(packed: torch.Tensor, indices: torch.Tensor, batch_size: int, seqlen: int) -> torch.Tensor:
    """Scatter packed tokens back into a zero-padded batch: the inverse of `unpad_input`.

    Args:
        packed: `[T, ...]`, any dtype.
        indices: `[T]` int64, the flat positions `unpad_input` returned, on packed's device.
        batch_size, seqlen: `B` and `S` of the padded batch (host ints).

    Returns:
        `[B, S, ...]`, packed's dtype and device, zeros at the padding; differentiable in `packed`.

    Raises:
        TypeError: `packed` is not a tensor of >= 1 dim, or `indices` not a 1-D int64 tensor.
        ValueError: `indices` has not `T` entries.
    """
    if not isinstance(packed, torch.Tensor) or packed.dim() < 1:
        raise TypeError(f"packed: expected a torch.Tensor [T, ...], got {type(packed).__name__}")
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype != torch.int64:
        got = f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise TypeError(f"indices: expected an int64 tensor [T], got {got}")
    if indices.shape[0] != packed.shape[0]:
        raise ValueError(f"indices: expected {packed.shape[0]} entries (packed's T), got {indices.shape[0]}")
    out = packed.new_zeros(batch_size * seqlen, *packed.shape[1:])
    out = out.index_put((indices,), packed)
    return out.view(batch_size, seqlen, *packed.shape[1:])


def padded_cu_seqlens(attention_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Documents of a left- or right-padded batch kept in place (no host sync but with `TORCH_MSA_DEBUG=1`).

    Args:
        attention_mask: `[B, S]` bool or integer, nonzero at real tokens, each row left- or
            right-padded.

    Returns:
        `(cu_seqlens [2B + 1] int32, max_seqlen = S)`, for `x.reshape(B * S, ...)`: row `b` is
        documents `2b` and `2b + 1`, its real tokens and its padding in the order they lie.

    Raises:
        TypeError: `attention_mask` is not a tensor, or is a float or complex one.
        ValueError: the mask is not 2-D; with `TORCH_MSA_DEBUG=1`, a row neither left- nor
            right-padded.
    """
    _check_mask(attention_mask)
    if debug_enabled():
        check_padding_mask(attention_mask)
    batch_size, seqlen = attention_mask.shape
    mask = attention_mask != 0
    real = mask.sum(dim=1, dtype=torch.int32)
    # A row whose first token is padding is left-padded (an all-padding row counts as left-padded).
    left_padded = ~mask[:, 0] if seqlen > 0 else torch.zeros_like(real, dtype=torch.bool)
    first = torch.where(left_padded, seqlen - real, real)
    lengths = torch.stack([first, seqlen - first], dim=1).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    return cu_seqlens, seqlen


def check_padding_mask(attention_mask: torch.Tensor) -> None:
    """Raise ValueError unless every row of `attention_mask [B, S]` (bool or integer, nonzero at
    real tokens) is left- or right-padded. One host sync: for debugging and input pipelines.

    Raises:
        TypeError: `attention_mask` is not a tensor, or is floating point or complex.
        ValueError: the mask is not 2-D, or a row (named in the message) changes between real
            and padding more than once.
    """
    _check_mask(attention_mask)
    mask = (attention_mask != 0).to(torch.int8)
    if mask.shape[1] < 2:
        return
    changes = (mask[:, 1:] != mask[:, :-1]).sum(dim=1)
    bad = torch.nonzero(changes > 1).flatten()
    if bad.numel():
        row = int(bad[0])
        raise ValueError(
            "attention_mask: expected every row to be left- or right-padded (its real tokens one contiguous run "
            f"at the start or the end), got row {row} with {int(changes[row])} changes between real and padding")
