"""How one measurement is timed.

On CUDA each timed call is bracketed by a pair of CUDA events recorded on the current stream, all
calls are queued back to back, and the device is synchronised once at the end: the times are
the device's, without host overhead between calls. A synchronised measurement instead starts each
call on an idle device and synchronises after it, as a loop that syncs every step sees it: the
host work the call cannot hide behind its kernels counts too. Elsewhere each call is timed with
`time.perf_counter`. The reported number is the median.
"""

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Timing:
    """The timed runs of one measurement (milliseconds); `capped` when the time budget cut the runs."""

    times_ms: tuple[float, ...]
    warmups: int
    capped: bool

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def runs(self) -> int:
        return len(self.times_ms)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, warmup: int, iters: int,
            budget_s: float | None = None, min_runs: int = 5, synchronised: bool = False) -> Timing:
    """Run `fn` `warmup` times untimed, then `iters` times timed (`synchronised`: each on an idle
    device, synchronised after it).

    `budget_s` bounds the timed part of a slow measurement: when the last warm-up call shows that
    `iters` calls would take longer, the runs are cut to what fits, but never below `min_runs`
    (the returned Timing is then `capped`). Warm-ups stop early, after two, once those after the
    first (which may compile or autotune) have used half the budget. `None` or 0 disables the
    budget.
    """
    if iters < 1:
        raise ValueError(f"iters: expected at least 1 timed run, got {iters}")
    call_s, spent, done = None, 0.0, 0
    for done in range(1, warmup + 1):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        call_s = time.perf_counter() - start
        spent += call_s if done > 1 else 0.0
        if budget_s and done >= 2 and spent > budget_s / 2:
            break
    runs = iters if call_s is None else runs_within_budget(call_s, iters, budget_s, min_runs)
    capped = runs < iters
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for begin, end in events:
            if synchronised:
                torch.cuda.synchronize(device)
            begin.record()
            fn()
            end.record()
            if synchronised:
                torch.cuda.synchronize(device)
        torch.cuda.synchronize(device)
        times = tuple(begin.elapsed_time(end) for begin, end in events)
    else:
        elapsed = []
        for _ in range(runs):
            start = time.perf_counter()
            fn()
            elapsed.append((time.perf_counter() - start) * 1e3)
        times = tuple(elapsed)
    return Timing(times, done, capped)


def runs_within_budget(call_s: float, iters: int, budget_s: float | None, min_runs: int) -> int:
    """How many of `iters` timed calls of `call_s` seconds each fit in `budget_s` seconds (None
    or 0: all of them), but at least `min_runs` (or `iters` if fewer)."""
    if not budget_s or call_s * iters <= budget_s:
        return iters
    return max(min(min_runs, iters), math.floor(budget_s / max(call_s, 1e-9)))


def is_out_of_memory(error: BaseException) -> bool:
    """A device allocation failure, also when a compiler wrapped it in its own exception."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def free_memory(device: torch.device) -> None:
    """Release what the last measurement left (call once its tensors are out of scope)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def capture_graph(fn: Callable[[], object], device: torch.device, warmups: int) -> "torch.cuda.CUDAGraph":
    """One call of `fn` captured in a CUDA graph, after `warmups` calls on a side stream (capture
    needs the first calls, which compile and allocate, done outside it)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_timer(fn: Callable[[], object], device: torch.device, warmups: int) -> Callable[[], float]:
    """Captures one call of `fn` in a CUDA graph (`capture_graph`, after `warmups` calls) and
    returns a function that replays it once and returns the replay's milliseconds, event-timed."""
    graph = capture_graph(fn, device, warmups)

    def timed() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        return begin.elapsed_time(end)

    return timed
