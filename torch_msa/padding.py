"""Padded batches to packed documents and back.

torch_msa's ops take packed tokens: documents back to back, delimited by int32 `cu_seqlens`.
A padded batch `x [B, S, ...]` with an attention mask `[B, S]` (nonzero or True = a real token)
becomes packed tokens in one of two ways:

* `unpad_input` / `pad_input` remove the padding and put it back (the layout of flash-attn's
  `bert_padding`). The packed tensor holds only real tokens, at the price of one host sync (the
  token count and the longest row are read on the host). Any mask works: each row's real tokens,
  in order, form one document.
* `padded_cu_seqlens` keeps the padding in place: `x.reshape(B * S, ...)` is the packed tensor
  and each row is two documents, its real tokens and its padding. Nothing is read on the host and
  every shape is static, so a compiled model keeps one graph. The padding documents only see
  themselves, so they never touch a real token; their outputs are to be ignored. The mask must
  be left- or right-padded: each row's real tokens one contiguous run at its start or its end
  (what tokenizers produce); other masks are rejected with `TORCH_MSA_DEBUG=1` or
  `check_padding_mask`.

In both layouts a row's real tokens start at position 0 of their document, so left and right
padding give the same result as running each sequence alone.
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
    """Remove the padding of a batch.

    Reads the token count and `max_seqlen` on the host (one sync); use `padded_cu_seqlens` where
    a sync is not acceptable.

    Args:
        x: `[B, S, ...]`, any dtype.
        attention_mask: `[B, S]` bool or integer, nonzero at real tokens.

    Returns:
        `(packed [T, ...], indices [T] int64, cu_seqlens [B + 1] int32, max_seqlen)`: the real
        tokens in row-major order (x's dtype and device), their flat positions in
        `x.reshape(B * S, ...)` (for `pad_input`), one document per row, and the longest row as a
        host int. The tensors are on x's device.

    Raises:
        TypeError: `x` or `attention_mask` is not a tensor, or the mask is floating point or
            complex.
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
        `[B, S, ...]` with `packed`'s dtype and device, zeros at the padding. Differentiable in
        `packed`.

    Raises:
        TypeError: `packed` is not a tensor of at least 1 dim, or `indices` is not a 1-D int64
            tensor.
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
    """Documents of a left- or right-padded batch kept in place, computed on the device.

    No host sync and no data-dependent shape. With `TORCH_MSA_DEBUG=1` the mask's layout is
    checked (`check_padding_mask`, one sync).

    Args:
        attention_mask: `[B, S]` bool or integer, nonzero at real tokens; each row's real tokens
            must be one contiguous run at the row's start (right padding) or end (left padding).

    Returns:
        `(cu_seqlens [2B + 1] int32, max_seqlen = S)`, cu_seqlens on the mask's device: row `b` is
        documents `2b` and `2b + 1`, its real tokens and its padding in the order they lie (a
        right-padded row: real, then padding; a left-padded row: padding, then real; an
        unpadded row has an empty padding document). Use it with `x.reshape(B * S, ...)`;
        reshape the result back to `[B, S, ...]`.

    Raises:
        TypeError: `attention_mask` is not a tensor, or is floating point or complex.
        ValueError: the mask is not 2-D; with `TORCH_MSA_DEBUG=1`, a row that is neither left-
            nor right-padded.
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
    """Raise ValueError unless every row of `attention_mask [B, S]` is left- or right-padded.

    Reads the mask on the host (one sync): for debugging and input pipelines, not for the step.

    Args:
        attention_mask: `[B, S]` bool or integer, nonzero at real tokens.

    Returns:
        None: every row's real tokens are one contiguous run at its start or its end.

    Raises:
        TypeError: `attention_mask` is not a tensor, or is floating point or complex.
        ValueError: the mask is not 2-D, or a row (named in the message) changes between real
            and padding more than once.
    """
    _check_mask(attention_mask)
    mask = (attention_mask != 0).to(torch.int8)
    if mask.shape[1] < 2:
        return
    # A left- or right-padded row changes value at most once along the sequence.
    changes = (mask[:, 1:] != mask[:, :-1]).sum(dim=1)
    bad = torch.nonzero(changes > 1).flatten()
    if bad.numel():
        row = int(bad[0])
        raise ValueError(
            "attention_mask: expected every row to be left- or right-padded (its real tokens one contiguous run "
            f"at the start or the end), got row {row} with {int(changes[row])} changes between real and padding")
