"""What an implementation hands the runner: its phases and, lazily, the calls to time.

A subject's `measurements()` is a generator: it prepares tensors, yields one `Measurement` per
phase, and prepares the next phase only when the runner asks for it (the backward of most
peers needs a forward with an autograd graph first). A failure while preparing, such as running
out of memory, is recorded for the phases not measured yet, and the runner goes on with the
next subject.
"""

import dataclasses
from collections.abc import Callable, Iterator
from typing import NamedTuple


class Measurement(NamedTuple):
    """One timed phase. `fn=None` records the phase as skipped, with `note` saying why."""

    phase: str
    fn: Callable[[], object] | None
    flops: float | None
    note: str = ""
    track_memory: bool = False  # record the peak device memory above what was allocated before
    synchronised: bool = False  # each call on an idle device, synchronised after it (`timing.measure`)


@dataclasses.dataclass(frozen=True)
class Subject:
    """An implementation of one problem: `impl` names it in tables and JSON."""

    impl: str
    phases: tuple[str, ...]
    measurements: Callable[[], Iterator[Measurement]] | None = None
    skip_reason: str = ""  # set: every phase is recorded as skipped, nothing runs
