"""`torch_msa.triton_utils.launch.CachedLaunches` without a GPU: the arguments it hands a compiled
kernel, and when it goes back to Triton's own path.

Triton's binder is built for an sm_90 target (no driver needed); Triton's own launch path and the
compiled kernel are stand-ins that record their calls. The GPU tests run the real path.
"""

import collections

import pytest
import torch

triton = pytest.importorskip("triton", reason="needs triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from torch_msa.plan import kernels as plan_kernels  # noqa: E402
from torch_msa.triton_utils.launch import CachedLaunches  # noqa: E402


class _Compiled:
    """A compiled kernel's stand-in: records the launches it is given."""

    function, packed_metadata = "function", "packed metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


@pytest.fixture
def kernel(monkeypatch):
    """`msa_plan_item_counts_kernel` with an sm_90 binder on device 0, Triton's own launch path
    recorded in `kernel.through_triton`."""
    kernel = plan_kernels.msa_plan_item_counts_kernel
    if not isinstance(kernel, CachedLaunches):
        pytest.skip("this Triton's kernels launch through its own path")
    jit_function = kernel.jit_function
    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(jit_function.signature, jit_function.params, backend)
    monkeypatch.setitem(jit_function.device_caches, 0, ({}, {}, None, backend, binder))
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    through_triton = []

    def run(*args, grid, warmup, **kwargs):
        through_triton.append((grid, args, kwargs))
        return _Compiled()

    monkeypatch.setattr(jit_function, "run", run)
    monkeypatch.setattr(kernel, "_compiled", collections.OrderedDict())
    monkeypatch.setattr(kernel, "through_triton", through_triton, raising=False)
    return kernel


def _arguments(num_buckets=32, offset=0):
    tables = torch.zeros(4, 80, dtype=torch.int32)
    bucket_start, bucket_end, items_per_bucket, item_ptr = (row[offset:offset + 64] for row in tables)
    return (bucket_start, bucket_end, items_per_bucket, item_ptr, num_buckets, 16), {"ROWS": 1024}


def test_a_cached_launch_hands_the_compiled_kernel_tritons_arguments_in_signature_order(kernel):
    args, constants = _arguments()
    first = kernel[(1,)](*args, **constants)
    assert len(kernel.through_triton) == 1 and not first.launches  # the first launch compiles
    again = kernel[(3, 2)](*args, **constants)
    assert again is first and len(kernel.through_triton) == 1
    (launch,) = first.launches
    # grid x, y, z; torch's current stream; the kernel; no launch metadata or hooks; then every
    # parameter of the signature in order, the constexpr too.
    assert launch[:9] == (3, 2, 1, 1234, "function", "packed metadata", None, None, None)
    expected = dict(zip(kernel.arg_names, (*args, constants["ROWS"]), strict=True))
    assert len(launch[9:]) == len(kernel.arg_names)
    for name, given in zip(kernel.arg_names, launch[9:], strict=True):
        assert given is expected[name], name


def test_a_launch_triton_would_specialise_differently_compiles_its_own_kernel(kernel):
    args, constants = _arguments(num_buckets=32)
    kernel[(1,)](*args, **constants)
    kernel[(1,)](*_arguments(num_buckets=48)[0], **constants)  # divisible by 16 too: the same kernel
    assert len(kernel.through_triton) == 1
    kernel[(1,)](*_arguments(num_buckets=33)[0], **constants)  # not divisible by 16
    kernel[(1,)](*_arguments(offset=1)[0], **constants)  # tables 4 bytes past a 16-byte boundary
    kernel[(1,)](*args, ROWS=512)  # another constexpr
    kernel[(1,)](*args, **constants, num_warps=8)  # another launch option
    assert len(kernel.through_triton) == 5
    kernel[(1,)](*_arguments(num_buckets=65)[0], **constants)  # as 33: found
    assert len(kernel.through_triton) == 5


def test_launch_hooks_take_tritons_path(kernel, monkeypatch):
    from triton import knobs

    args, constants = _arguments()
    kernel[(1,)](*args, **constants)
    kernel[(1,)](*args, **constants)
    assert len(kernel.through_triton) == 1  # Triton's empty hook chains call nothing
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", lambda metadata: None)  # a profiler's
    kernel[(1,)](*args, **constants)
    assert len(kernel.through_triton) == 2


def test_a_pre_run_hook_takes_tritons_path(kernel, monkeypatch):
    args, constants = _arguments()
    kernel[(1,)](*args, **constants)
    monkeypatch.setattr(kernel.jit_function, "pre_run_hooks", [lambda *args, **kwargs: None])
    kernel[(1,)](*args, **constants)
    assert len(kernel.through_triton) == 2


def test_the_first_launch_on_a_device_goes_through_triton_and_the_next_is_cached(kernel, monkeypatch):
    caches = kernel.jit_function.device_caches.pop(0)  # Triton has not launched on device 0 yet
    args, constants = _arguments()
    kernel[(1,)](*args, **constants)
    assert len(kernel.through_triton) == 1 and not kernel._compiled
    monkeypatch.setitem(kernel.jit_function.device_caches, 0, caches)  # what Triton's first launch leaves
    kernel[(1,)](*args, **constants)
    compiled = kernel[(1,)](*args, **constants)
    assert len(kernel.through_triton) == 2 and len(compiled.launches) == 1


def test_tritons_debug_knob_is_part_of_the_key(kernel, monkeypatch):
    from triton import knobs

    args, constants = _arguments()
    kernel[(1,)](*args, **constants)
    monkeypatch.setattr(knobs.runtime, "debug", True)
    kernel[(1,)](*args, **constants)
    assert len(kernel.through_triton) == 2


def test_the_cache_keeps_the_variants_launched_last(kernel, monkeypatch):
    from torch_msa.triton_utils import launch

    monkeypatch.setattr(launch, "_MOST_LAUNCHERS", 2)
    args, constants = _arguments()
    for rows in (256, 512, 256, 1024, 256):  # 512 is the least recently launched when 1024 comes
        kernel[(1,)](*args, ROWS=rows)
    assert len(kernel.through_triton) == 3
    kernel[(1,)](*args, ROWS=512)
    assert len(kernel.through_triton) == 4


def test_a_grid_that_is_not_a_tuple_is_refused(kernel):
    with pytest.raises(TypeError, match=r"grid: expected a tuple of 1 to 3 ints, got function"):
        kernel[lambda meta: (1,)]
