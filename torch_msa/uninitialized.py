"""Buffers the kernels write in full, allocated without PyTorch's deterministic-mode fill.

Under `torch.use_deterministic_algorithms(True)`, PyTorch fills every `torch.empty` with NaN (or
an integer's largest value) while `torch.utils.deterministic.fill_uninitialized_memory` is on, its
default: a guard against reading memory nobody wrote. The ops' outputs, partials and workspaces
are written by their kernels before anything reads them, so that fill is pure memory traffic, as
large as the forward's partials and the backward's workspaces together. There, storage taken
straight from the allocator skips it; elsewhere `torch.empty` serves, as it costs less host time.
"""

import contextlib
import math
from collections.abc import Sequence

import torch


def uninitialized(shape: int | Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A contiguous `shape` tensor of `dtype` on `device` whose contents are undefined, as
    `torch.empty`'s, but never filled by PyTorch's deterministic mode. For buffers that are
    written before any element is read."""
    # The setting is a module property, which the type stubs do not declare.
    fill = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
    if not (fill and torch.are_deterministic_algorithms_enabled()):
        return torch.empty(shape, dtype=dtype, device=device)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    device = torch.device(device)
    # The allocator serves the current device: make it `device`'s.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        storage = torch.UntypedStorage(math.prod(shape) * dtype.itemsize, device=device)
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    # The storage set in place, not viewed: the buffer is no view, as `torch.empty`'s is not.
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape, strides)
