"""The progress display of torch_msa's command-line tools: `python -m torch_msa` and the
repository's benchmarks (`python -m benchmarks`, `python -m benchmarks.kl`).

One `Progress` follows one stage of named steps: on a terminal one line redrawn in place
(`[2/5] T=32768: 7/23 done, torch_msa bwd, 0:41 elapsed, about 1:33 left`), elsewhere at most one
plain line when the stage ends. Standard library only.
"""

import math
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO


def format_duration(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` from an hour on (seconds rounded down)."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal (False for pipes, files, closed or odd streams)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _terminal_width(stream: TextIO) -> int:
    """Columns of the terminal behind `stream`; 80 when it does not say (a pseudo-terminal without a size)."""
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 80
    return columns if columns > 0 else 80


class Progress:
    """Steps done / total, the running step, the elapsed time and an estimate of the time left.

    Args:
        label: names the stage at the start of the line.
        total: the number of steps (>= 0).
        stream: where the display goes (default: `sys.stderr` when constructed).
        clock: seconds, monotonic (default `time.monotonic`); tests pass a fake one.
        rate_estimate: estimate steps without an `expected_s` from the mean time so far; False
            for stages whose steps differ too much.
        summary: off a terminal, print one line when the stage ends; False prints nothing.
        leave: on a terminal, keep the last line when the stage ends (False: clear it).

    Use it as a context manager, or call `close()`, also when the stage stops early.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, rate_estimate: bool = True, summary: bool = True,
                 leave: bool = True):
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"total: expected an int >= 0 steps, got {total!r}")
        self.label = label
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.interactive = is_terminal(self.stream)
        self.clock = clock
        self.rate_estimate = rate_estimate
        self.summary = summary
        self.leave = leave
        self.done = 0
        self.step = ""
        self._started = clock()
        self._step_started = self._started
        self._step_expected_s: float | None = None
        self._last_done_at = self._started  # when the latest step ended: the rate counts finished steps only
        self._drawn = 0  # characters of the line now on the terminal
        self._closed = False
        self._draw()

    def start(self, step: str, expected_s: float | None = None) -> None:
        """Step `step` begins; `expected_s`, when the caller knows it, is its expected duration."""
        self.step = step
        self._step_started = self.clock()
        self._step_expected_s = expected_s
        self._draw()

    def advance(self, steps: int = 1) -> None:
        """`steps` steps are done (the running one first)."""
        self.done = min(self.total, self.done + steps)
        self._last_done_at = self.clock()
        self.step, self._step_expected_s = "", None
        self._draw()

    def elapsed_s(self) -> float:
        return self.clock() - self._started

    def left_s(self) -> float | None:
        """Estimated seconds left, or None when unknown."""
        remaining = self.total - self.done
        if remaining <= 0:
            return 0.0
        now = self.clock()
        left = 0.0
        if self.step and self._step_expected_s is not None:
            left += max(0.0, self._step_expected_s - (now - self._step_started))
            remaining -= 1
        if remaining:
            if not self.rate_estimate or self.done == 0:
                return None
            left += remaining * (self._last_done_at - self._started) / self.done
        return left

    def line(self) -> str:
        """The display line for now (without the time left once every step is done)."""
        text = f"{self.label}: {self.done}/{self.total} done{f', {self.step}' if self.step else ''}, " \
               f"{format_duration(self.elapsed_s())} elapsed"
        if self.done >= self.total:
            return text
        left = self.left_s()
        return f"{text}, {'?' if left is None else f'about {format_duration(math.ceil(left))}'} left"

    def write(self, message: str, file: TextIO | None = None) -> None:
        """Print `message` as a line of its own to `file` (default: the display's stream) on
        every kind of stream; on a terminal the display is cleared first and redrawn below it."""
        self._clear()
        print(message, file=self.stream if file is None else file, flush=True)
        self._draw()

    def log(self, message: str) -> None:
        """Like `write` on a terminal; dropped on any other stream (detail that would flood a log)."""
        if self.interactive:
            self.write(message)

    def close(self) -> None:
        """End the stage (idempotent): on a terminal the last line stays (`leave`) or is cleared;
        elsewhere the summary line."""
        if self._closed:
            return
        if self.interactive:
            if self.leave:
                self._draw()
                self.stream.write("\n")
                self.stream.flush()
            else:
                self._clear()
        elif self.summary:
            elapsed = format_duration(self.elapsed_s())
            if self.done >= self.total:
                text = f"{self.label}: {self.done}/{self.total} in {elapsed}"
            else:
                text = f"{self.label}: stopped at {self.done}/{self.total} after {elapsed}"
            print(text, file=self.stream, flush=True)
        self._closed = True

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _draw(self) -> None:
        if not self.interactive or self._closed:
            return
        text = self.line()[: max(1, _terminal_width(self.stream) - 1)]
        self.stream.write("\r" + text + " " * max(0, self._drawn - len(text)))
        self.stream.flush()
        self._drawn = len(text)

    def _clear(self) -> None:
        if self.interactive and self._drawn and not self._closed:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.flush()
            self._drawn = 0
