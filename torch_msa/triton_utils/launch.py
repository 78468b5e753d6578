"""Launch configurations that fit the device's shared memory (design: `torch_msa/triton/README.md`)."""

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence

from triton.runtime.errors import OutOfResources

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
