"""Runs every implementation of every problem in one process and collects the rows.

Problems run one after another; each gets fresh inputs, and its tensors are freed before the
next. Inside a problem the subjects run in turn (dense baseline first), and each of their phases
is timed by `timing.measure`. Running out of memory, or any other failure, is recorded for the
phase (and for the phases of that subject that could then not run) and the run goes on.

On CUDA each phase is timed `iters` times in a row: CUDA events time the device, which the load
of the host barely moves. Elsewhere the clock is the host's, which other processes slow down by
turns, so the problem's phases are timed interleaved: `iters` rounds through every subject,
each phase timed once per round (the warm-ups in the first), and a row's median is over its
rounds. A change of load then falls on every phase alike, and the phases of a step add up to
the step; where they still do not (`ProblemResult.note_step_mismatch`), the problem says so.

Each problem is one stage of a `torch_msa._progress.Progress` on stderr, a step per phase and
round: on a terminal the live line and each row once its runs are done, elsewhere one line per
problem; error tracebacks are printed on every stream.
"""

import dataclasses
import statistics
import sys
import traceback

import torch

from torch_msa._progress import Progress
from torch_msa.contract import Shape

from . import msa, peers, trained_selection
from .devices import l2_bytes
from .problems import ProblemSpec, describe_sharing, make_inputs
from .report import format_rate
from .results import ERROR, OK, OOM, SKIPPED, ProblemResult, Row
from .subject import Measurement, Subject
from .timing import free_memory, is_out_of_memory, measure, runs_within_budget


@dataclasses.dataclass(frozen=True)
class Config:
    device: torch.device
    problems: tuple[ProblemSpec, ...]
    shape: Shape
    selection: str = "index"
    warmup: int = 5
    iters: int = 20
    budget_s: float | None = 20.0
    min_runs: int = 10
    skip_peers: bool = False
    query_outer: bool = False
    max_reference_tokens: int = 8192
    seed: int = 0

    @property
    def baseline(self) -> str:
        return "cudnn dense" if self.device.type == "cuda" else "math dense"

    @property
    def interleaved(self) -> bool:
        """Whether the phases are timed in rounds (see the module docstring): off CUDA."""
        return self.device.type != "cuda"

    @property
    def rounds(self) -> int:
        return self.iters if self.interleaved else 1


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


@dataclasses.dataclass
class _Runs:
    """The timed runs of one row so far, over the rounds, and how many it gets."""

    times_ms: list[float]
    wanted: int

    @property
    def done(self) -> bool:
        return len(self.times_ms) >= self.wanted


def _show(progress: Progress, result: ProblemResult, row: Row) -> None:
    """Show a finished row on a terminal."""
    head = f"{result.name:<20} {row.impl:<17} {row.phase:<15}"
    if row.status != OK:
        progress.log(f"{head} {row.status}{': ' + row.note if row.note else ''}")
    else:
        rate = f"{format_rate(row.tflops):>8} TF/s" if row.tflops is not None else " " * 13
        runs = f"{row.runs} runs" + (", capped by the time budget" if row.capped else "")
        progress.log(f"{head} {row.ms:11.3f} ms {rate}  ({runs})")


def _record(progress: Progress, result: ProblemResult, row: Row) -> None:
    """Append a finished `row` to the problem, show it and count its phase as done."""
    result.rows.append(row)
    _show(progress, result, row)
    progress.advance()


def _fail(row: Row, error: BaseException, progress: Progress, device: torch.device, prefix: str = "") -> None:
    """Record `error` on `row` (out of memory, or an error whose traceback is printed)."""
    status = OOM if is_out_of_memory(error) else ERROR
    if status == ERROR:
        progress.write("".join(traceback.format_exception(error)).rstrip())
    row.status, row.ms = status, None
    row.note = "; ".join(filter(None, [row.note, prefix + _describe(error)]))
    free_memory(device)


def _time(impl: str, measurement: Measurement, config: Config, progress: Progress) -> tuple[Row, _Runs | None]:
    """The row of a phase's first round, and its runs (None when it failed)."""
    row = Row(impl, measurement.phase, OK, flops=measurement.flops, note=measurement.note)
    device = config.device
    base = None
    if measurement.track_memory and device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    # Interleaved, this round times one run; the budget is applied here, to the rounds.
    iters, budget_s = (1, None) if config.interleaved else (config.iters, config.budget_s)
    try:
        timing = measure(measurement.fn, device, config.warmup, iters, budget_s, config.min_runs,
                         synchronised=measurement.synchronised)
    except Exception as error:  # noqa: BLE001  (recorded, and the run goes on)
        _fail(row, error, progress, device)
        return row, None
    wanted = timing.runs
    if config.interleaved:
        wanted = runs_within_budget(timing.times_ms[0] / 1e3, config.iters, config.budget_s, config.min_runs)
    runs = _Runs(list(timing.times_ms), wanted)
    row.ms, row.runs, row.warmups, row.capped = timing.median_ms, timing.runs, timing.warmups, wanted < config.iters
    if base is not None:
        row.extra_peak_bytes = torch.cuda.max_memory_allocated(device) - base
    return row, runs


def _time_again(row: Row, runs: _Runs, measurement: Measurement, config: Config, progress: Progress) -> None:
    """One more run of a row's phase (a later round); a failure ends the row as failed."""
    try:
        timing = measure(measurement.fn, config.device, 0, 1, synchronised=measurement.synchronised)
    except Exception as error:  # noqa: BLE001  (recorded, and the run goes on)
        _fail(row, error, progress, config.device, f"run {len(runs.times_ms) + 1}: ")
        runs.wanted = len(runs.times_ms)
        return
    runs.times_ms += timing.times_ms
    row.ms, row.runs = statistics.median(runs.times_ms), len(runs.times_ms)


def run_subject(subject: Subject, result: ProblemResult, config: Config, progress: Progress,
                runs: dict[tuple[str, str], _Runs] | None = None) -> None:
    """One round of `subject` (see the module docstring): in the first, each phase's row is
    added to `result`; in a later one (`runs` holds the earlier rounds' runs), each row that
    wants more runs gets one. `progress` advances a step per phase."""
    runs = {} if runs is None else runs
    if result.row(subject.impl, subject.phases[0]) is not None \
            and all(phase_runs.done for (impl, _), phase_runs in runs.items() if impl == subject.impl):
        progress.advance(len(subject.phases))  # a later round with nothing left to time: nothing is prepared
        return
    if subject.skip_reason:
        for phase in subject.phases:
            _record(progress, result, Row(subject.impl, phase, SKIPPED, note=subject.skip_reason))
        return
    pending = list(subject.phases)
    failure = None
    measurements = subject.measurements()
    try:
        for measurement in measurements:
            if measurement.phase in pending:
                pending.remove(measurement.phase)
            key = (subject.impl, measurement.phase)
            row = result.row(*key)
            if row is None:
                if measurement.fn is None:
                    row = Row(subject.impl, measurement.phase, SKIPPED, flops=measurement.flops, note=measurement.note)
                else:
                    progress.start(f"{subject.impl} {measurement.phase}" + (", run 1" if config.rounds > 1 else ""))
                    row, phase_runs = _time(subject.impl, measurement, config, progress)
                    if phase_runs is not None:
                        runs[key] = phase_runs
                result.rows.append(row)
            elif key in runs and not runs[key].done and row.status == OK:
                progress.start(f"{subject.impl} {measurement.phase}, run {len(runs[key].times_ms) + 1}")
                _time_again(row, runs[key], measurement, config, progress)
            else:
                progress.advance()
                continue
            if key not in runs or runs[key].done:
                _show(progress, result, row)
            progress.advance()
    except Exception as error:  # noqa: BLE001  (preparing a phase failed: recorded, the run goes on)
        failure = (OOM if is_out_of_memory(error) else ERROR, f"could not prepare: {_describe(error)}")
        if failure[0] == ERROR:
            progress.write("".join(traceback.format_exception(error)).rstrip())
    finally:
        measurements.close()
    del measurements  # drops the subject's tensors before the memory is released
    free_memory(config.device)
    for phase in pending:
        status, note = failure if failure else (ERROR, "not measured (the subject stopped early)")
        row = result.row(subject.impl, phase)
        if row is None:
            _record(progress, result, Row(subject.impl, phase, status, note=note))
            continue
        if (subject.impl, phase) in runs and not runs[subject.impl, phase].done:
            # A later round could not prepare the phase: its row keeps the runs it has.
            phase_runs = runs[subject.impl, phase]
            phase_runs.wanted = len(phase_runs.times_ms)
            row.note = "; ".join(filter(None, [row.note, f"{row.runs} of {config.iters} runs: {note}"]))
            _show(progress, result, row)
        progress.advance()


def subjects(inputs, config: Config) -> list[Subject]:
    """Dense baseline first, then the peers, then torch_msa (and with `query_outer`, its query-outer forward)."""
    if config.device.type != "cuda":
        found = [peers.dense_subject(inputs, "math")]
    else:
        found = [peers.dense_subject(inputs, "cudnn")]
        if not config.skip_peers:
            found.append(peers.dense_subject(inputs, "flash"))
    if not config.skip_peers:
        found += [peers.fla_subject(inputs), peers.flex_subject(inputs)]
        found += [peers.bsa_subject(inputs, 128), peers.bsa_subject(inputs, 64)]
    found.append(msa.msa_subject(inputs, config.max_reference_tokens))
    if config.query_outer:
        found.append(msa.query_outer_subject(inputs, config.max_reference_tokens))
    return found


def run_problem(spec: ProblemSpec, config: Config, result: ProblemResult | None = None, label: str | None = None,
                stream=None) -> ProblemResult:
    """Run every subject of one problem and return its result: `result` when given, filled in
    place (so a caller holding it keeps the rows recorded before an interruption). The progress
    goes to `stream` (default stderr) under `label` (default the problem's name)."""
    result = ProblemResult(spec, None, config.baseline) if result is None else result
    label = spec.name if label is None else label
    try:
        inputs = make_inputs(spec, config.shape, config.device, config.selection, config.seed)
    except Exception as error:  # noqa: BLE001
        status = OOM if is_out_of_memory(error) else ERROR
        result.notes.append(f"inputs could not be built: {status}: {_describe(error)}")
        print(f"{label}: inputs could not be built: {_describe(error)}", file=sys.stderr if stream is None else stream,
              flush=True)
        free_memory(config.device)
        return result
    result.work = inputs.work
    if config.selection == "trained":
        result.notes.append(trained_selection.describe(trained_selection.load(), spec.lengths, config.shape.kv_heads))
    result.notes.append(describe_sharing(inputs))
    input_bytes = sum(x.numel() * x.element_size() for x in (inputs.q, inputs.k, inputs.v))
    l2 = l2_bytes(config.device)
    if l2 is not None and input_bytes < 2 * l2:
        result.notes.append(f"q, k, v take {input_bytes / 2**20:.0f} MiB, under 2x the {l2 / 2**20:.0f} MiB L2, and "
                            "are not rotated between runs: times may be optimistic")
    found = subjects(inputs, config)
    runs: dict[tuple[str, str], _Runs] = {}
    steps = sum(len(subject.phases) for subject in found) * config.rounds
    with Progress(label, steps, stream=stream) as progress:
        for _ in range(config.rounds):
            for subject in found:
                run_subject(subject, result, config, progress, runs)
    result.add_sums()
    if config.interleaved:
        result.note_step_mismatch()
    del inputs, found
    free_memory(config.device)
    return result
