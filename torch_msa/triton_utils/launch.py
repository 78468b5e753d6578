"""Launch configurations that fit the device's shared memory, and kernels launched without
Triton's per-call cache lookup (design: `torch_msa/triton/README.md`)."""

import collections
import contextlib
import dataclasses
import functools
import re
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence

import torch
from triton import knobs
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

from ..backends import UnsupportedInputs
from ..diagnostics import logger


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One way to launch a kernel.

    `num_stages`, `num_warps`: as Triton takes them; `rows`: query rows (tokens x heads) of a
    tile; `block_n`: keys of a backward program's key slice (0 where a kernel has no such tile).
    """

    num_stages: int
    num_warps: int = 8
    rows: int = 0
    block_n: int = 0

    @property
    def options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


_chosen: dict[tuple[str, Hashable], int] = {}
_pinned: dict[str, tuple[LaunchConfig, ...]] = {}
_lock = threading.Lock()


def _forget(kernel: str) -> None:
    with _lock:
        for memo in [memo for memo in _chosen if memo[0] == kernel]:
            del _chosen[memo]


@contextlib.contextmanager
def pinned(kernel: str, *candidates: LaunchConfig) -> Iterator[None]:
    """Launch `kernel` with `candidates` in place of its own list inside the block.

    The kernel's memo is cleared on entry and on exit, so the block chooses among `candidates`
    and the choice does not outlive it. For retuning (`benchmarks/deterministic.py --sweep`).

    Raises:
        ValueError: no candidate, or `kernel` is already pinned.
    """
    if not candidates:
        raise ValueError(f"pinned({kernel!r}): no launch configuration given")
    with _lock:
        if kernel in _pinned:
            raise ValueError(f"pinned({kernel!r}): the kernel is already pinned")
        _pinned[kernel] = candidates
    _forget(kernel)
    try:
        yield
    finally:
        with _lock:
            del _pinned[kernel]
        _forget(kernel)


def launch(kernel: str, key: Hashable, candidates: Sequence[LaunchConfig], launch_with: Callable[[LaunchConfig], None]) -> None:
    """Run `launch_with(config)` with the first of `candidates` that fits the device.

    Args:
        kernel: the kernel's name, for the memo and the error message.
        key: everything the shared memory depends on besides the configuration: the device and
            the kernel's shape constants (dtype, head dim, block size, head group).
        candidates: configurations, preferred first (replaced by `pinned`'s inside its block).
        launch_with: launches the kernel with one configuration.

    Raises:
        UnsupportedInputs: no configuration fits; nothing of this kernel has run.
    """
    if _pinned:
        candidates = _pinned.get(kernel, candidates)
    memo = (kernel, key)
    chosen = _chosen.get(memo)
    if chosen is not None:
        launch_with(candidates[chosen])
        return
    logger.info("compiling the Triton kernel %s for %s (once per process and shape)", kernel, key)
    refusals = []
    for index, config in enumerate(candidates):
        try:
            launch_with(config)
        except OutOfResources as error:
            refusals.append(str(error))
            continue
        with _lock:
            _chosen[memo] = index
        return
    raise UnsupportedInputs(
        f"no launch configuration of the Triton kernel {kernel} fits this device's shared memory ({refusals[-1]})"
    )


_MOST_LAUNCHERS = 256  # compiled variants kept per kernel, the least recently launched dropped first
_TRITON_RELEASES = ((3, 6), (3, 8))  # the first and last Triton whose launch internals are read here


class CachedLaunches:
    """A `@triton.jit` kernel whose launches skip Triton's per-call work past the argument binding.

    `kernel[grid](*args, **kwargs)` (grid: a tuple of 1 to 3 ints) binds the arguments with the
    kernel's own binder and the options Triton's launch adds (its debug and instrumentation
    knobs), so the specialisation is Triton's: dtypes, 16-byte alignment, integer divisibility,
    constexpr values. It keys a cache of compiled kernels on that specialisation, the launch
    options and the device; a hit launches the compiled kernel directly on torch's current stream.
    A miss, or any launch while a Triton launch hook, pipeline-stages hook or pre-run hook is
    installed, takes Triton's own path, which compiles (or raises `OutOfResources`) as usual. The
    cache holds `_MOST_LAUNCHERS` variants per kernel: sizes and pointers that the token count
    changes fall into a few specialisation classes each. Every other attribute is
    `jit_function`'s.

    Raises:
        TypeError: a grid that is not a tuple (Triton's callable grids are not served).
    """

    def __init__(self, jit_function: JITFunction):
        self.jit_function = jit_function
        self._compiled: collections.OrderedDict[Hashable, object] = collections.OrderedDict()

    def __getattr__(self, name):
        if name == "jit_function":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.jit_function, name)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]:
        if not isinstance(grid, tuple):
            raise TypeError(f"grid: expected a tuple of 1 to 3 ints, got {type(grid).__name__}")
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        jit_function = self.jit_function
        device = torch._C._cuda_getDevice()  # torch.cuda.current_device() without its Python checks
        caches = jit_function.device_caches.get(device)
        if caches is None or jit_function.pre_run_hooks or _hooked(knobs.runtime.launch_enter_hook) or _hooked(
                knobs.runtime.launch_exit_hook) or getattr(knobs.runtime, "add_stages_inspection_hook", None):
            return self._launch_through_triton(grid, args, kwargs, None)
        options = dict(kwargs, debug=kwargs.get("debug", jit_function.debug) or knobs.runtime.debug,
                       instrumentation_mode=knobs.compilation.instrumentation_mode)
        bound, specialization, options = caches[-1](*args, **options)
        # Unsorted: a call site passes its options in one order, and another order only adds an entry.
        key = (device, tuple(specialization), tuple(options.items()))
        with _lock:  # the recency order is shared by every thread that launches
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            return self._launch_through_triton(grid, args, kwargs, key)
        grid = (*grid, 1, 1)
        compiled.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *bound.values())
        return compiled

    def _launch_through_triton(self, grid, args, kwargs, key):
        compiled = self.jit_function[grid](*args, **kwargs)
        if key is not None:
            with _lock:
                self._compiled[key] = compiled
                if len(self._compiled) > _MOST_LAUNCHERS:
                    self._compiled.popitem(last=False)
        return compiled


def _hooked(hook) -> bool:
    """Whether a Triton launch hook (a function, or a chain of them) would call anything."""
    return hook is not None and bool(getattr(hook, "calls", True))


def cached_launches(kernel):
    """`CachedLaunches(kernel)` for a compiled `@triton.jit` kernel; under the Triton interpreter
    (`TRITON_INTERPRET=1`, no compiled kernel) or on a Triton release outside `_TRITON_RELEASES`
    (a one-time note), the kernel itself."""
    if not isinstance(kernel, JITFunction) or not _triton_has_the_launch_internals():
        return kernel
    return CachedLaunches(kernel)


@functools.cache
def _triton_has_the_launch_internals() -> bool:
    import triton

    numbers = re.match(r"(\d+)\.(\d+)", triton.__version__)
    found = numbers is not None and _TRITON_RELEASES[0] <= (int(numbers[1]), int(numbers[2])) <= _TRITON_RELEASES[1]
    if not found:
        logger.info("triton %s: its kernels launch through Triton's own path (torch_msa reads the launch internals "
                    "of triton %d.%d to %d.%d)", triton.__version__, *_TRITON_RELEASES[0], *_TRITON_RELEASES[1])
    return found
