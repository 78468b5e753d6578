"""SM100 (Blackwell) kernels of torch_msa: the main backward kernel, and the device gate it needs.

The kernel module (`backward_sm100`) is CuTe DSL source; it calls `require_cute_dsl()` (from
`torch_msa.cute_dsl`, which also holds the I/O helpers and the architecture-neutral preprocess,
task and postprocess kernels it uses) before its first DSL import. `require_sm100(device)` is the
device twin of that gate: it runs before anything is compiled or launched.

Importing this package imports neither cutlass nor triton.
"""

import torch

from ...cute_dsl import INSTALL_COMMAND, require_cute_dsl, sm_capability, sm_count

__all__ = ["INSTALL_COMMAND", "SM100_CAPABILITY", "require_cute_dsl", "require_sm100", "sm_capability", "sm_count"]

SM100_CAPABILITY = (10, 0)


def require_sm100(device: torch.device | str | int) -> None:
    """Refuse, before compiling or launching anything, a device the SM100 kernels are not built for.

    Raises:
        NotImplementedError: unless `device` is a CUDA device of compute capability 10.0
            (B200 / GB200); the message names the device and what it is.
    """
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type != "cuda":
        raise NotImplementedError(
            f"the SM100 MSA kernels need a CUDA device of compute capability 10.0; got a {resolved.type} device ({resolved})"
        )
    capability = sm_capability(resolved)
    if capability != SM100_CAPABILITY:
        raise NotImplementedError(
            "the SM100 MSA kernels need compute capability 10.0 (they are built for sm_100a); "
            f"{resolved} has compute capability {capability[0]}.{capability[1]}"
        )
