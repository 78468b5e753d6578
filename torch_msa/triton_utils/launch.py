"""Launch configurations that fit the device's shared memory.

The shared memory a Triton kernel needs depends on the architecture it is compiled for (the
same tile takes 133 KB on sm_86 and 264 KB with three stages on sm_100) and the limit per block
differs too (163 KB on sm_80, 99 KB on sm_86/sm_89/sm_120, 227 KB on sm_90/sm_100). So every
kernel has a list of launch configurations, fastest first: the first is the one tuned on SM90,
the later ones trade pipelining stages and tile rows for shared memory.

The first launch of a kernel for a device and a shape tries the list in order. Triton compiles
each configuration for the device and raises `OutOfResources` before launching one that does
not fit, so a rejected configuration has run nothing; the first that launches is remembered for
that (kernel, device, shape). When none fits, `UnsupportedInputs` lets the registry fall back
to the reference with a one-time warning. `tests/triton/test_targets.py` compiles every kernel
for sm_80, sm_86, sm_89, sm_90, sm_100 and sm_120 on the CPU and checks that the M3
configuration finds a fitting entry on each.
"""

import dataclasses
import threading
from collections.abc import Callable, Hashable, Sequence

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


_chosen: dict[Hashable, int] = {}
_lock = threading.Lock()


def launch(kernel: str, key: Hashable, candidates: Sequence[LaunchConfig], launch_with: Callable[[LaunchConfig], None]) -> None:
    """Run `launch_with(config)` with the first of `candidates` that fits the device.

    Args:
        kernel: the kernel's name, for the memo and the error message.
        key: everything the shared memory depends on besides the configuration: the device and
            the kernel's shape constants (dtype, head dim, block size, head group).
        candidates: configurations, preferred first.
        launch_with: launches the kernel with one configuration.

    Raises:
        UnsupportedInputs: no configuration fits; nothing of this kernel has run.
    """
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
