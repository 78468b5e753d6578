"""Records of a benchmark run: one `Row` per (implementation, phase) of each problem.

A row's `status` is `ok` (timed), `OOM`, `skipped` (not run, `note` says why) or `error`.
Derived rows (`fwd+bwd` of every implementation that has both) add the two medians. The speed
ratio of a row compares it with the dense baseline of the same problem and phase: cuDNN on CUDA,
the math backend elsewhere; `select+fwd+bwd` compares with the baseline's `fwd+bwd`, and on CUDA
torch_msa's `synced step` with the baseline's `synced fwd+bwd` (both synchronised every call).
"""

import dataclasses
import json
import sys
from collections.abc import Callable

from .flops import Work, tflops
from .problems import ProblemSpec

OK, OOM, SKIPPED, ERROR = "ok", "OOM", "skipped", "error"
# A run's status: every problem ran; still running (the file is rewritten after every problem, so a
# run that was killed leaves this); stopped by Ctrl-C (KeyboardInterrupt), its last problem cut short.
COMPLETE, RUNNING, INTERRUPTED = "complete", "running", "interrupted"
# On CUDA, synchronised calls (`timing.measure`): torch_msa's training step (one `msa_attention`
# call and its backward) and the dense peers' forward + backward.
SYNCED_STEP, SYNCED_DENSE = "synced step", "synced fwd+bwd"
# The baseline phase each phase is compared with (phases absent here have no ratio).
BASELINE_PHASE = {"fwd": "fwd", "bwd": "bwd", "fwd+bwd": "fwd+bwd", "select+fwd+bwd": "fwd+bwd",
                  SYNCED_STEP: SYNCED_DENSE}
# torch_msa's training step and the phases it is made of, each also timed alone.
STEP, STEP_PARTS = "select+fwd+bwd", ("select", "fwd", "bwd")
# How far the step's median and the sum of its parts' medians may lie apart (as a ratio, either
# way) before the problem is noted as not adding up. They differ a little by construction (`fwd`
# and `bwd` each build the plan the step builds once; the step adds autograd's work): timed
# interleaved on one thread of a shared 2-core CPU (T=128, M3), the step took 0.93x the sum.
STEP_TOLERANCE = 1.5


@dataclasses.dataclass
class Row:
    impl: str
    phase: str
    status: str
    ms: float | None = None
    runs: int = 0
    warmups: int = 0
    capped: bool = False  # the time budget cut the timed runs below the requested count
    flops: float | None = None
    note: str = ""
    derived: bool = False
    extra_peak_bytes: int | None = None

    @property
    def tflops(self) -> float | None:
        return tflops(self.flops, self.ms) if self.status == OK else None

    def peak_fraction(self, peak_tflops: float | None) -> float | None:
        """This row's rate as a fraction of the device's dense bf16 rate (None when either is unknown)."""
        rate = self.tflops
        return None if rate is None or not peak_tflops else rate / peak_tflops


@dataclasses.dataclass
class ProblemResult:
    spec: ProblemSpec
    work: Work | None
    baseline: str  # impl name of the dense baseline
    rows: list[Row] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    def row(self, impl: str, phase: str) -> Row | None:
        return next((r for r in self.rows if r.impl == impl and r.phase == phase), None)

    def timed(self, impl: str, phase: str) -> Row | None:
        """The row if it was timed (`ok`), else None."""
        row = self.row(impl, phase)
        return row if row is not None and row.status == OK else None

    def speedup(self, row: Row) -> float | None:
        """Baseline time of the same phase / this row's time."""
        phase = BASELINE_PHASE.get(row.phase)
        base = self.timed(self.baseline, phase) if phase else None
        if base is None or row.status != OK or not row.ms:
            return None
        return base.ms / row.ms

    def add_sums(self) -> None:
        """Add a derived `fwd+bwd` row, after the `bwd` row, for every implementation with timed `fwd` and `bwd`."""
        for impl in dict.fromkeys(r.impl for r in self.rows):
            forward, backward = self.timed(impl, "fwd"), self.timed(impl, "bwd")
            if forward is None or backward is None or self.row(impl, "fwd+bwd") is not None:
                continue
            flops = None if forward.flops is None or backward.flops is None else forward.flops + backward.flops
            total = Row(impl, "fwd+bwd", OK, forward.ms + backward.ms, min(forward.runs, backward.runs),
                        flops=flops, note="sum of the fwd and bwd medians", derived=True,
                        capped=forward.capped or backward.capped)
            self.rows.insert(self.rows.index(backward) + 1, total)

    def note_step_mismatch(self, impl: str = "torch_msa") -> None:
        """Add a note when `impl`'s step and the sum of its parts (`STEP_PARTS`), all timed, lie
        more than `STEP_TOLERANCE` apart: the machine's load changed while they ran, so its rows
        do not compare with each other as they should."""
        step, parts = self.timed(impl, STEP), [self.timed(impl, phase) for phase in STEP_PARTS]
        if step is None or None in parts:
            return
        total = sum(part.ms for part in parts)
        ratio = step.ms / total
        if 1 / STEP_TOLERANCE <= ratio <= STEP_TOLERANCE:
            return
        self.notes.append(
            f"the phases do not add up: {impl}'s {STEP} took {step.ms:.3f} ms, {ratio:.2f}x the "
            f"{' + '.join(STEP_PARTS)} of {total:.3f} ms (expected within {STEP_TOLERANCE}x): the machine's load "
            "changed while they ran, so compare this problem's rows with care (more --iters give steadier medians)")


@dataclasses.dataclass
class BenchResult:
    meta: dict
    problems: list[ProblemResult]
    notes: list[str] = dataclasses.field(default_factory=list)
    status: str = COMPLETE  # COMPLETE, RUNNING or INTERRUPTED: anything but COMPLETE is a partial result

    @property
    def peak_tflops(self) -> float | None:
        """The device's dense bf16 rate (`devices.device_peak`), recorded in the metadata."""
        return self.meta.get("peak_tflops")

    def problem(self, name: str) -> ProblemResult | None:
        return next((p for p in self.problems if p.name == name), None)

    def to_json(self) -> dict:
        """Plain data: the status, then every row with its derived TF/s, fraction of peak and speedup."""
        problems = []
        for problem in self.problems:
            rows = []
            for row in problem.rows:
                entry = dataclasses.asdict(row)
                entry.update(tflops=row.tflops, peak_fraction=row.peak_fraction(self.peak_tflops),
                             speedup_vs_baseline=problem.speedup(row))
                rows.append(entry)
            problems.append({
                "name": problem.name,
                "lengths": list(problem.spec.lengths),
                "pack": problem.spec.pack,
                "tokens": problem.spec.tokens,
                "baseline": problem.baseline,
                "work": None if problem.work is None else dataclasses.asdict(problem.work),
                "rows": rows,
                "notes": problem.notes,
            })
        return {"status": self.status, "partial": self.status != COMPLETE, "meta": self.meta, "notes": self.notes,
                "problems": problems}


def write_record(path: str, record: dict) -> None:
    """Write the JSON record of a run whose results are a plain dict (the KL and long-context
    benchmarks), replacing the file."""
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1)
        handle.write("\n")


def run_recorded(path: str, record: dict, body: Callable[[], None]) -> int:
    """Run `body`, which fills `record` and rewrites it with `write_record` after each part, with
    the record's `status` running. Then write it complete and return 0; on Ctrl-C write it
    interrupted (still `partial`), say where it is on stderr and return 130, the shell's code for
    a command stopped by SIGINT."""
    record.update(status=RUNNING, partial=True)
    try:
        body()
    except KeyboardInterrupt:
        record["status"] = INTERRUPTED
        write_record(path, record)
        print(f"interrupted: the partial results are in {path}", file=sys.stderr, flush=True)
        return 130
    record.update(status=COMPLETE, partial=False)
    write_record(path, record)
    return 0
