"""Runs every implementation of every problem in one process and collects the rows.

Problems run one after another; each gets fresh inputs, and its tensors are freed before the
next. Inside a problem the subjects run in turn (dense baseline first), and each of their phases
is timed by `timing.measure`. Running out of memory, or any other failure, is recorded for the
phase (and for the phases of that subject that could then not run) and the run goes on.

Each problem is one stage of a `torch_msa._progress.Progress` on stderr, a step per phase: on a
terminal the live line and each row as it is recorded, elsewhere one line per problem; error
tracebacks are printed on every stream.
"""

import dataclasses
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
from .timing import free_memory, is_out_of_memory, measure


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
    max_reference_tokens: int = 8192
    seed: int = 0

    @property
    def baseline(self) -> str:
        return "cudnn dense" if self.device.type == "cuda" else "math dense"


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def _record(progress: Progress, result: ProblemResult, row: Row) -> None:
    """Append `row` to the problem, show it on a terminal and count its phase as done."""
    result.rows.append(row)
    head = f"{result.name:<20} {row.impl:<17} {row.phase:<15}"
    if row.status != OK:
        progress.log(f"{head} {row.status}{': ' + row.note if row.note else ''}")
    else:
        rate = f"{format_rate(row.tflops):>8} TF/s" if row.tflops is not None else " " * 13
        runs = f"{row.runs} runs" + (", capped by the time budget" if row.capped else "")
        progress.log(f"{head} {row.ms:11.3f} ms {rate}  ({runs})")
    progress.advance()


def _time(impl: str, measurement: Measurement, config: Config, progress: Progress) -> Row:
    row = Row(impl, measurement.phase, OK, flops=measurement.flops, note=measurement.note)
    device = config.device
    base = None
    if measurement.track_memory and device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    failure = None
    try:
        timing = measure(measurement.fn, device, config.warmup, config.iters, config.budget_s, config.min_runs)
    except Exception as error:  # noqa: BLE001  (recorded, and the run goes on)
        failure = (OOM if is_out_of_memory(error) else ERROR, _describe(error))
        if failure[0] == ERROR:
            progress.write("".join(traceback.format_exception(error)).rstrip())
    if failure is not None:
        row.status, row.note = failure[0], "; ".join(filter(None, [row.note, failure[1]]))
        free_memory(device)
        return row
    row.ms, row.runs, row.warmups, row.capped = timing.median_ms, timing.runs, timing.warmups, timing.capped
    if base is not None:
        row.extra_peak_bytes = torch.cuda.max_memory_allocated(device) - base
    return row


def run_subject(subject: Subject, result: ProblemResult, config: Config, progress: Progress) -> None:
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
            if measurement.fn is None:
                row = Row(subject.impl, measurement.phase, SKIPPED, flops=measurement.flops, note=measurement.note)
            else:
                progress.start(f"{subject.impl} {measurement.phase}")
                row = _time(subject.impl, measurement, config, progress)
            _record(progress, result, row)
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
        _record(progress, result, Row(subject.impl, phase, status, note=note))


def subjects(inputs, config: Config) -> list[Subject]:
    """Dense baseline first, then the peers, then torch_msa."""
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
    with Progress(label, sum(len(subject.phases) for subject in found), stream=stream) as progress:
        for subject in found:
            run_subject(subject, result, config, progress)
    result.add_sums()
    del inputs, found
    free_memory(config.device)
    return result
