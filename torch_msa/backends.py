"""Which implementation serves each op on each device.

The op kernels in `ops.py` call `resolve` / `call` at run time (never while tracing), so the
choice follows `TORCH_MSA_BACKEND` and the devices present without recompiling. A forced backend
serves every op it implements or raises `BackendError`; otherwise the highest-priority available
backend wins, opt-in ones (with an `opt_in_note`) serving only when forced. A backend may decline
inputs with `UnsupportedInputs` before writing anything: the call falls through to the next one,
with a one-time warning. The registry in detail: docs/backends.md.
"""

import dataclasses
import functools
import importlib
import os
import warnings
from collections.abc import Callable, Mapping

import torch

from . import reference, reference_index_loss
from ._schemas import SCHEMAS
from .diagnostics import TorchMSAWarning

BACKEND_ENV = "TORCH_MSA_BACKEND"
# `msa::forward_with_index_loss` runs the backend of `msa::forward` (its loss is computed by its
# backward), so no backend serves it; every other op is served.
COMPOSED_OPS = ("forward_with_index_loss",)
OPS = tuple(name for name in SCHEMAS if name not in COMPOSED_OPS)  # the ops backends serve
# Every backend with a backward serves the backward with the index loss: fused where it declares
# that op, composed of its backward and the loss's ops otherwise (`torch_msa.index_loss`).
SERVED_WITH = {"backward_with_index_loss": "backward"}
REFERENCE = "reference"
# The optional backends' packages, each defining `BACKEND`; imported when the registry is first asked.
BUILTIN_BACKENDS = ("torch_msa.triton", "torch_msa.sm90", "torch_msa.sm100")


class BackendError(RuntimeError):
    """No registered backend can serve a request (for example a forced backend on the wrong device)."""


class UnsupportedInputs(Exception):
    """Raised by a backend implementation, before any work, for inputs it cannot serve."""


class UnavailableError(ImportError):
    """An optional backend's dependencies are missing; the message names the install command."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """Op implementations sharing a name and a device gate.

    `ops` maps op names of `OPS` to callables taking the op's arguments with the six document
    arguments as one `Documents` (as `torch_msa.reference` does), or to a `"module:function"`
    path imported on first use. `available(device)` is asked lazily; `unavailable_reason(device)`
    says why not. A backend with `opt_in_note` serves only when `TORCH_MSA_BACKEND` names it; the
    note is printed once when default resolution passes it over.
    """

    name: str
    ops: Mapping[str, Callable | str]
    priority: int = 0
    device_types: tuple[str, ...] | None = None
    available: Callable[[torch.device], bool] = lambda device: True
    unavailable_reason: Callable[[torch.device], str | None] | None = None
    opt_in_note: Callable[[torch.device], str | None] | None = None

    def implements(self, op: str) -> bool:
        return op in self.ops or SERVED_WITH.get(op, op) in self.ops

    def implementation(self, op: str) -> Callable:
        """The callable serving `op` (an import path is imported now, once)."""
        found = self.ops[op]
        return found if callable(found) else _imported(found)

    def serves(self, op: str, device: torch.device) -> bool:
        if not self.implements(op):
            return False
        if self.device_types is not None and device.type not in self.device_types:
            return False
        return self.available(device)

    def why_not(self, op: str, device: torch.device) -> str:
        """Why this backend does not serve `op` on `device` (for a backend that does not)."""
        if not self.implements(op):
            return f"it does not implement msa::{op}"
        if self.device_types is not None and device.type not in self.device_types:
            return f"it serves {'/'.join(self.device_types)} devices only, not {device.type}"
        reason = self.unavailable_reason(device) if self.unavailable_reason is not None else None
        return reason or f"it is not available on {device}"


_BACKENDS: dict[str, Backend] = {}
_warned: set[tuple] = set()
_builtins_registered_in: dict | None = None  # the registry dict the built-ins were added to


@functools.cache
def _imported(path: str) -> Callable:
    # Cached: every op call resolves its implementation, and an import lookup costs microseconds.
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _register_builtins() -> None:
    """Register `BUILTIN_BACKENDS` once; a backend registered earlier under the same name stays."""
    global _builtins_registered_in
    # Keyed on the dict itself, so a registry swapped for another (tests do) gets them too.
    if _builtins_registered_in is not _BACKENDS:
        _builtins_registered_in = _BACKENDS
        for path in BUILTIN_BACKENDS:
            backend = importlib.import_module(path).BACKEND
            _BACKENDS.setdefault(backend.name, backend)


def register_backend(backend: Backend) -> None:
    """Add (or replace, by name) a backend.

    Args:
        backend: its `ops` keys must be op names of `OPS`.

    Raises:
        ValueError: `backend.ops` names an op that does not exist.
    """
    unknown = set(backend.ops) - set(OPS)
    if unknown:
        raise ValueError(f"backend {backend.name!r}: unknown ops {sorted(unknown)}; expected a subset of {OPS}")
    _BACKENDS[backend.name] = backend


def unregister_backend(name: str) -> None:
    _BACKENDS.pop(name, None)


def registered_backends() -> list[str]:
    _register_builtins()
    return sorted(_BACKENDS, key=lambda name: -_BACKENDS[name].priority)


# Resolutions by (op, device, forced name), each with the registry order it was made from: every op
# call asks, and asking each backend whether it serves the device costs microseconds. Bounded by the
# ops, devices and forced names a process uses; cleared by `forget_resolutions`.
_resolved: dict[tuple[str, torch.device, str], tuple[list[Backend], tuple[Backend, ...]]] = {}
_MOST_RESOLUTIONS = 256


def forget_resolutions() -> None:
    """Drop the cached resolutions, for a caller that changes what the backends see of a device
    (tests that fake device facts)."""
    _resolved.clear()


def candidates(op: str, device: torch.device) -> tuple[Backend, ...]:
    """Backends that may serve `op` on `device`, best first; a forced one first, the rest as fallbacks.

    The answer is cached until the registry changes (not for `cuda` without an index); an opt-in
    backend's note, printed once per process, is printed when the answer is first made."""
    ordered = _ordered()
    forced = os.environ.get(BACKEND_ENV, "").strip()
    key = (op, device, forced)
    cached = _resolved.get(key)
    if cached is not None and cached[0] is ordered:
        return cached[1]
    found = tuple(_candidates(op, device, forced))
    # A device without an index means the current one, which may change between calls.
    if device.index is not None or device.type != "cuda":
        if len(_resolved) >= _MOST_RESOLUTIONS:
            _resolved.clear()
        _resolved[key] = (ordered, found)
    return found


def _candidates(op: str, device: torch.device, forced: str) -> list[Backend]:
    """`candidates` made anew."""
    if forced:
        backend = _BACKENDS.get(forced)
        if backend is None:
            raise BackendError(
                f"{BACKEND_ENV}={forced!r} names no backend; registered: {', '.join(registered_backends())}"
            )
        if backend.implements(op):
            if not backend.serves(op, device):
                able = [b.name for b in _ordered() if b.serves(op, device)]
                raise BackendError(
                    f"{BACKEND_ENV}={forced!r} cannot serve msa::{op} on {device}: {backend.why_not(op, device)}; "
                    f"backends that can: {', '.join(able)}"
                )
            return [backend] + [b for b in _by_default(op, device, notes=False) if b is not backend]
    return _by_default(op, device, notes=not forced)


def _by_default(op: str, device: torch.device, notes: bool) -> list[Backend]:
    """The backends serving `op` on `device` without forcing, best first, opt-in ones passed over."""
    found = []
    for backend in _ordered():
        if backend.opt_in_note is not None:
            if notes and backend.implements(op) and (backend.device_types is None or device.type in backend.device_types):
                note = backend.opt_in_note(device)
                if note:
                    _warn_once(("opt-in", backend.name), f"torch_msa: {note}")
            continue
        if backend.serves(op, device):
            found.append(backend)
    return found


def resolve(op: str, device: torch.device) -> Backend:
    """The backend that would serve `op` on `device` for inputs it accepts.

    Args:
        op: an op name of `OPS` (`"forward"`, `"select_blocks"`, ...).
        device: the device of the op's tensors.

    Returns:
        The `Backend` chosen first; it may still decline particular inputs.

    Raises:
        torch_msa.BackendError: `TORCH_MSA_BACKEND` names no backend, or one that cannot serve
            the op on `device`, or no backend serves it.
    """
    found = candidates(op, device)
    if not found:
        raise BackendError(f"no backend serves msa::{op} on {device}")
    return found[0]


def call(op: str, device: torch.device, *args, implementation: Callable[[Backend], Callable] | None = None):
    """Run `op` on the best backend that accepts these inputs: `implementation(backend)`'s
    callable, by default the backend's own for `op`."""
    found = candidates(op, device)
    for position, backend in enumerate(found):
        serve = backend.implementation(op) if implementation is None else implementation(backend)
        try:
            result = serve(*args)
        except UnsupportedInputs as why:
            if backend is found[-1]:
                raise BackendError(f"backend {backend.name!r} cannot serve these msa::{op} inputs: {why}") from why
            following = found[position + 1].name
            slow = " (the slow path)" if following == REFERENCE and device.type == "cuda" else ""
            _warn_once(
                (backend.name, op, str(why)),
                f"torch_msa: backend {backend.name!r} does not serve these msa::{op} inputs ({why}); "
                f"falling back to {following!r}{slow}",
            )
            continue
        if backend.name == REFERENCE and len(found) == 1 and device.type == "cuda":
            _warn_once(
                (REFERENCE, op, device.type),
                f"torch_msa: msa::{op} on {device} runs on the reference backend, the slow path: {_no_fast_path(op, device)}",
            )
        return result
    raise BackendError(f"no backend serves msa::{op} on {device}")


def _no_fast_path(op: str, device: torch.device) -> str:
    """Why no backend other than the reference serves `op` on `device`."""
    reasons = [f"{b.name}: {b.why_not(op, device)}" for b in _ordered()
               if b.name != REFERENCE and b.implements(op) and b.opt_in_note is None]
    return "; ".join(reasons) or "no other backend is registered"


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, TorchMSAWarning, stacklevel=3)


# The registry dict and its backends when last sorted (held, so that no id is reused), and the sort.
_order: tuple[tuple, list[Backend]] = ((), [])


def _ordered() -> list[Backend]:
    """The registered backends, highest priority first; sorted again only when the registry changed
    (every op call asks)."""
    global _order
    _register_builtins()
    seen, ordered = _order
    current = (_BACKENDS, *_BACKENDS.values())
    if len(seen) != len(current) or any(a is not b for a, b in zip(seen, current)):
        ordered = sorted(_BACKENDS.values(), key=lambda b: -b.priority)
        _order = (current, ordered)
    return ordered


register_backend(
    Backend(
        name=REFERENCE,
        ops={op: getattr(reference_index_loss if op.startswith("indexer_kl") else reference, op)
             for op in OPS if op not in SERVED_WITH},
        priority=0,
    )
)
