"""Junk in the buffers the kernels are promised to write in full (`torch_msa.uninitialized`), so
that a kernel reading an element it did not write fails its test in any mode.
"""

import sys

import torch


def junk_buffer(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """`uninitialized`'s buffer full of what deterministic mode writes into a `torch.empty` (NaN, an
    integer's largest value), in any mode, so that a kernel reading an element it did not write
    shows, even through a product with zero."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        return buffer.fill_(float("nan"))
    return buffer.fill_(True if dtype == torch.bool else torch.iinfo(dtype).max)


def allocate_with(monkeypatch, allocate) -> None:
    """Have every `torch_msa` module that allocates through `uninitialized` call `allocate`."""
    # The backends load their host modules on first use: load them all now, so none is missed.
    import torch_msa.sm90.interface  # noqa: F401
    import torch_msa.triton.interface  # noqa: F401

    for name, module in list(sys.modules.items()):
        # (The package's `uninitialized` is the module.)
        if name.startswith("torch_msa") and callable(getattr(module, "uninitialized", None)):
            monkeypatch.setattr(module, "uninitialized", allocate)
