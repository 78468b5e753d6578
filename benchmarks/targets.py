"""The performance goals (the table in docs/performance.md), judged on a benchmark result:
reached, not reached (by how much), or not measured. They are set for one H200 at M3 shapes,
and judged only on a run on one (`why_not_judged`): elsewhere a verdict would say nothing
about them (a CPU reaches none, another GPU has other rates).

A target over all problems is reached when every problem that measured it reaches it; the line
lists each problem's value and, when missed, the worst one as a fraction of the target.
"""

import dataclasses
import re
from collections.abc import Callable

from .msa import SCORING_PHASE
from .report import format_rate
from .results import OK, STEP, BenchResult, ProblemResult

REACHED, NOT_REACHED, NOT_MEASURED = "reached", "not reached", "not measured"
MSA, CUDNN, FLA, BSA = "torch_msa", "cudnn dense", "fla parallel_nsa", "cuDNN BSA blk128"
# The device the goals are set for: its name (as CUDA reports it) and compute capability.
GOAL_DEVICE, GOAL_DEVICE_NAME, GOAL_CAPABILITY = "one H200 (compute capability 9.0)", r"\bH200\b", (9, 0)
# torch_msa's fwd+bwd within this factor of cuDNN BSA's time, on the selections both express.
BSA_TIME_FACTOR = 1.2
MEMORY_PROBLEMS = ("T=131072", "pack 8x16384")
# The rate goals of torch_msa's phases, TF/s.
RATE_GOALS = {"fwd": 420.0, "bwd": 320.0, "select": 400.0}


@dataclasses.dataclass(frozen=True)
class Outcome:
    label: str
    verdict: str
    detail: str
    values: dict[str, float]  # problem name -> measured value


def _rate(impl: str, phase: str) -> Callable[[ProblemResult], float | None]:
    def value(problem):
        row = problem.timed(impl, phase)
        return None if row is None else row.tflops
    return value


def _ratio(slow_impl: str, slow_phase: str, fast_phase: str) -> Callable[[ProblemResult], float | None]:
    """`slow_impl`'s time of `slow_phase` over torch_msa's time of `fast_phase`."""
    def value(problem):
        slow, fast = problem.timed(slow_impl, slow_phase), problem.timed(MSA, fast_phase)
        return None if slow is None or fast is None else slow.ms / fast.ms
    return value


def _judge(result: BenchResult, label: str, threshold: float, unit: str, value, only: str | None = None) -> Outcome:
    problems = [p for p in result.problems if only is None or p.name == only]
    values = {p.name: v for p in problems if (v := value(p)) is not None}
    if not values:
        where = f" at {only}" if only else ""
        return Outcome(label, NOT_MEASURED, f"no measurement{where}", {})
    listed = ", ".join(f"{name} {v:.2f}x" if unit == "x" else f"{name} {format_rate(v)} {unit}"
                       for name, v in values.items())
    worst_name = min(values, key=values.get)
    worst = values[worst_name]
    if worst >= threshold:
        return Outcome(label, REACHED, listed, values)
    missed = sum(v < threshold for v in values.values())
    gap = f"{threshold / worst:.1f}x short" if unit == "x" and worst > 0 else f"short by {threshold - worst:.1f} {unit}"
    detail = (f"{listed}; below at {missed} of {len(values)}; worst {worst_name}: "
              f"{worst / threshold:.0%} of the target ({gap})")
    return Outcome(label, NOT_REACHED, detail, values)


def _topk_share(result: BenchResult) -> Outcome:
    """The top-k's share of the selection, `1 - t(select, topk=2) / t(select)`: the fused kernel
    scores the same blocks either way, so the difference is what keeping `topk - 1` scored blocks
    costs beyond keeping one (a lower bound of the top-k's whole cost)."""
    label = "top-k under 10% of selection"
    values = {}
    for problem in result.problems:
        full, scoring = problem.timed(MSA, "select"), problem.timed(MSA, SCORING_PHASE)
        if full is not None and scoring is not None and full.ms:
            values[problem.name] = max(0.0, 1.0 - scoring.ms / full.ms)
    if not values:
        return Outcome(label, NOT_MEASURED, f"no select / {SCORING_PHASE} pair measured", {})
    listed = ", ".join(f"{name} {share:.0%}" for name, share in values.items())
    worst_name = max(values, key=values.get)
    if values[worst_name] <= 0.10:
        return Outcome(label, REACHED, listed, values)
    return Outcome(label, NOT_REACHED, f"{listed}; worst {worst_name}: {values[worst_name]:.0%} of the selection "
                   f"({values[worst_name] / 0.10:.1f}x the 10% budget)", values)


def _memory(result: BenchResult) -> Outcome:
    label = "memory: T=128K and a pack of 8 x 16K run select+fwd+bwd, O(T) extra memory"
    lines, values, verdicts = [], {}, []
    for name in MEMORY_PROBLEMS:
        problem = result.problem(name)
        row = None if problem is None else problem.row(MSA, STEP)
        if row is None or row.status == "skipped":
            lines.append(f"{name} not run")
            verdicts.append(NOT_MEASURED)
        elif row.status != OK:
            lines.append(f"{name} {row.status}")
            verdicts.append(NOT_REACHED)
        elif row.extra_peak_bytes is None:
            lines.append(f"{name} ran (peak memory not tracked on this device)")
            verdicts.append(REACHED)
        else:
            tokens = problem.spec.tokens
            values[name] = row.extra_peak_bytes / 2**30
            # One T x T fp32 score matrix per KV head is what an O(T^2) buffer would cost at least.
            square = 4 * tokens * tokens
            within = row.extra_peak_bytes < square
            lines.append(f"{name} ran, peak {values[name]:.2f} GiB above the inputs "
                         f"({row.extra_peak_bytes / tokens / 1024:.0f} KiB per token; one T x T fp32 buffer: "
                         f"{square / 2**30:.0f} GiB)")
            verdicts.append(REACHED if within else NOT_REACHED)
    if NOT_REACHED in verdicts:
        verdict = NOT_REACHED
    elif NOT_MEASURED in verdicts:
        verdict = NOT_MEASURED
    else:
        verdict = REACHED
    return Outcome(label, verdict, "; ".join(lines), values)


def evaluate(result: BenchResult) -> list[Outcome]:
    return [
        _judge(result, f"forward >= {RATE_GOALS['fwd']:.0f} TF/s", RATE_GOALS["fwd"], "TF/s", _rate(MSA, "fwd")),
        _judge(result, f"backward (dq, dk, dv) >= {RATE_GOALS['bwd']:.0f} TF/s", RATE_GOALS["bwd"], "TF/s",
               _rate(MSA, "bwd")),
        _judge(result, f"selection (index scoring + top-k) >= {RATE_GOALS['select']:.0f} TF/s", RATE_GOALS["select"],
               "TF/s", _rate(MSA, "select")),
        _topk_share(result),
        _judge(result, "select+fwd+bwd >= 10x cuDNN dense fwd+bwd at T=64K", 10.0, "x",
               _ratio(CUDNN, "fwd+bwd", STEP), only="T=65536"),
        _judge(result, "select+fwd+bwd >= 15x cuDNN dense fwd+bwd at T=128K", 15.0, "x",
               _ratio(CUDNN, "fwd+bwd", STEP), only="T=131072"),
        _judge(result, "forward >= 4x fla parallel_nsa (same indices)", 4.0, "x", _ratio(FLA, "fwd", "fwd")),
        _judge(result, "backward >= 3x fla parallel_nsa (same indices)", 3.0, "x", _ratio(FLA, "bwd", "bwd")),
        # Judged as a speedup, like the others: BSA's time over torch_msa's, at least 1 / factor.
        _judge(result, f"fwd+bwd within {BSA_TIME_FACTOR}x of {BSA}'s time (--selection tiled)", 1 / BSA_TIME_FACTOR,
               "x", _ratio(BSA, "fwd+bwd", "fwd+bwd")),
        _memory(result),
    ]


def why_not_judged(meta: dict) -> str | None:
    """Why the goals are not judged on the run described by `meta` (its `device_type`, `device`
    name and `capability`), or None when it ran on the device they are set for."""
    capability = tuple(meta.get("capability") or ())
    if meta.get("device_type") == "cuda" and capability == GOAL_CAPABILITY \
            and re.search(GOAL_DEVICE_NAME, meta.get("device", "")):
        return None
    found = meta.get("device", "an unknown device")
    if capability:
        found += f", compute capability {capability[0]}.{capability[1]}"
    return f"they are set for {GOAL_DEVICE} and this run is on {found}"


def rate_goals(result: BenchResult) -> dict[str, float]:
    """The TF/s goals per phase to draw against the run's bars: none unless the goals are judged
    on its device (`why_not_judged`)."""
    return {} if why_not_judged(result.meta) else dict(RATE_GOALS)


def format_outcomes(outcomes: list[Outcome], not_judged: str | None = None) -> str:
    """The goals' lines: one per outcome, or the one line saying why they are `not_judged`."""
    title = "performance goals (docs/performance.md; set for one H200, M3 shapes, bf16)"
    if not_judged:
        return f"{title}: not judged on this device: {not_judged}"
    lines = [f"{title}:"]
    for outcome in outcomes:
        lines.append(f"  [{outcome.verdict}] {outcome.label}: {outcome.detail}")
    return "\n".join(lines)
