"""Which implementation serves each op on each device.

A backend is a named bundle of op implementations with the devices it serves. The op kernels in
`ops.py` ask `resolve(op, device)` at run time (never while tracing: the ops are opaque to
`torch.compile` and `torch.export`), so the choice follows `TORCH_MSA_BACKEND` and the devices
present without recompiling anything.

Resolution: if `TORCH_MSA_BACKEND` names a backend, that backend must serve the op on the device
(else `BackendError` lists the ones that can; a backend without a `plan` op gets another's plan); otherwise the highest-priority available backend
that serves it wins. The pure-PyTorch reference serves every op on every device at priority 0.
A backend may decline particular inputs by raising `UnsupportedInputs` before it launches
anything; the call then falls through to the next backend, with a warning printed once.
"""

import dataclasses
import os
import warnings
from collections.abc import Callable

import torch

from . import reference

BACKEND_ENV = "TORCH_MSA_BACKEND"
OPS = ("select_blocks", "plan", "forward", "backward")
# Ops whose output any backend's kernels accept: a forced backend that lacks one does not block
# the call, the op resolves as if nothing were forced.
SHARED_OPS = ("plan",)


class BackendError(RuntimeError):
    """No registered backend can serve a request (for example a forced backend on the wrong device)."""


class UnsupportedInputs(Exception):
    """Raised by a backend implementation, before any work, for inputs it cannot serve."""


class UnavailableError(ImportError):
    """An optional backend's dependencies are missing; the message names the install command."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """Op implementations sharing a name and a device gate.

    `ops` maps op names (`OPS`) to callables with the op's
    positional signature. `available(device)` is consulted lazily, so optional dependencies are
    imported only when a device first asks; `device_types=None` means any device.
    """

    name: str
    ops: dict[str, Callable]
    priority: int = 0
    device_types: tuple[str, ...] | None = None
    available: Callable[[torch.device], bool] = lambda device: True

    def serves(self, op: str, device: torch.device) -> bool:
        if op not in self.ops:
            return False
        if self.device_types is not None and device.type not in self.device_types:
            return False
        return self.available(device)


_BACKENDS: dict[str, Backend] = {}
_warned: set[tuple[str, str, str]] = set()


def register_backend(backend: Backend) -> None:
    """Add (or replace, by name) a backend."""
    unknown = set(backend.ops) - set(OPS)
    if unknown:
        raise ValueError(f"backend {backend.name!r}: unknown ops {sorted(unknown)}; expected a subset of {OPS}")
    _BACKENDS[backend.name] = backend


def unregister_backend(name: str) -> None:
    _BACKENDS.pop(name, None)


def registered_backends() -> list[str]:
    return sorted(_BACKENDS, key=lambda name: -_BACKENDS[name].priority)


def candidates(op: str, device: torch.device) -> list[Backend]:
    """Backends that may serve `op` on `device`, best first, honouring `TORCH_MSA_BACKEND`."""
    forced = os.environ.get(BACKEND_ENV, "").strip()
    if forced:
        backend = _BACKENDS.get(forced)
        if backend is None:
            raise BackendError(
                f"{BACKEND_ENV}={forced!r} names no backend; registered: {', '.join(registered_backends())}"
            )
        if op in SHARED_OPS and op not in backend.ops:
            return [b for b in _ordered() if b.serves(op, device)]
        if not backend.serves(op, device):
            able = [b.name for b in _ordered() if b.serves(op, device)]
            raise BackendError(
                f"{BACKEND_ENV}={forced!r} cannot serve msa::{op} on {device}; backends that can: {', '.join(able)}"
            )
        return [backend]
    return [b for b in _ordered() if b.serves(op, device)]


def resolve(op: str, device: torch.device) -> Backend:
    """The backend that would serve `op` on `device` for inputs it accepts."""
    found = candidates(op, device)
    if not found:
        raise BackendError(f"no backend serves msa::{op} on {device}")
    return found[0]


def call(op: str, device: torch.device, *args):
    """Run `op` on the best backend that accepts these inputs."""
    found = candidates(op, device)
    for backend in found:
        try:
            return backend.ops[op](*args)
        except UnsupportedInputs as why:
            if backend is found[-1]:
                raise BackendError(f"backend {backend.name!r} cannot serve these msa::{op} inputs: {why}") from why
            key = (backend.name, op, str(why))
            if key not in _warned:
                _warned.add(key)
                warnings.warn(
                    f"torch_msa: backend {backend.name!r} does not serve these msa::{op} inputs ({why}); "
                    f"falling back to {found[found.index(backend) + 1].name!r}",
                    stacklevel=2,
                )
    raise BackendError(f"no backend serves msa::{op} on {device}")


def _ordered() -> list[Backend]:
    return sorted(_BACKENDS.values(), key=lambda b: -b.priority)


register_backend(
    Backend(
        name="reference",
        ops={"select_blocks": reference.select_blocks, "plan": reference.plan, "forward": reference.forward,
             "backward": reference.backward},
        priority=0,
    )
)
