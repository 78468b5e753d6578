"""`torch_msa.uninitialized`: `torch.empty` without deterministic mode's fill."""

import contextlib
import pathlib
import sys

import pytest
import torch
from torch.profiler import profile

import torch_msa
from tests.support.determinism import deterministic_algorithms
from tests.support.uninitialized import allocate_with
from torch_msa.uninitialized import uninitialized


@pytest.mark.parametrize("mode", ["default", "deterministic", "deterministic without the fill"])
@pytest.mark.parametrize("shape, expected", [((3, 5, 2), (3, 5, 2)), (7, (7,)), ((), ()), ((4, 0), (4, 0))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.int64])
def test_a_contiguous_writable_tensor_of_the_shape_and_dtype(mode, shape, expected, dtype, monkeypatch):
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", mode == "deterministic")
    with contextlib.nullcontext() if mode == "default" else deterministic_algorithms():
        x = uninitialized(shape, dtype=dtype, device="cpu")
    assert (x.shape, x.dtype, x.device.type) == (torch.Size(expected), dtype, "cpu")
    assert x.is_contiguous() and x.untyped_storage().nbytes() == x.numel() * dtype.itemsize
    assert x._base is None, "a view: in-place detach and autograd treat it unlike torch.empty's tensor"
    x.fill_(3)
    assert bool((x == 3).all())


def test_deterministic_mode_does_not_fill_it(monkeypatch):
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    with deterministic_algorithms(), profile(record_shapes=True) as trace:
        filled_by_torch = torch.empty(1000, dtype=torch.float32)
        ours = uninitialized(1000, dtype=torch.float32, device="cpu")
    fills = [event.input_shapes[0] for event in trace.events() if event.name == "aten::fill_"]
    # torch.empty's 1000 elements are filled (NaN); ours only allocates (an empty tensor's fill is no work).
    assert fills.count([1000]) == 1 and all(shape in ([1000], [0]) for shape in fills), fills
    assert bool(filled_by_torch.isnan().all()) and ours.shape == (1000,)


def test_the_test_allocator_reaches_every_module_that_allocates_through_it(monkeypatch):
    """`tests/support/uninitialized.allocate_with` (behind the junk fixture of `tests/conftest.py`)
    patches every package module that imports `uninitialized`, those the backends load on first
    use included, so that no kernel's buffers escape the junk."""
    package = pathlib.Path(torch_msa.__file__).parent
    users = sorted(".".join(("torch_msa", *path.relative_to(package).with_suffix("").parts))
                   for path in package.rglob("*.py") if "uninitialized import uninitialized" in path.read_text())
    assert len(users) >= 10  # the sm90, triton, stages, plan and index-loss allocation sites

    def allocate(shape, dtype, device):
        raise AssertionError("not called here")

    allocate_with(monkeypatch, allocate)
    assert [name for name in users if sys.modules[name].uninitialized is not allocate] == []
