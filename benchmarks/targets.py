"""The performance goals (the table in docs/performance.md), judged on a benchmark result:
reached, not reached (by how much), or not measured. The rate goals depend on the run's
selection regime (`--selection`); the others hold for every regime. They are set for one H200 at
M3 shapes, and judged only on a run on one (`why_not_judged`): elsewhere a verdict would say
nothing about them (a CPU reaches none, another GPU has other rates).

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


@dataclasses.dataclass(frozen=True)
class RateGoal:
    """torch_msa's `phase` at `tflops` TF/s or more, on the problems `at` (every problem when empty)."""

    phase: str
    tflops: float
    at: tuple[str, ...] = ()


# The rate goals of each selection regime (the run's `--selection`). Random `index` selections
# share little, so their forward is bound by its partials' bytes; the regimes whose neighbouring
# queries share their blocks can run them query-outer, at block-sparse rates.
RATE_GOALS = {
    "index": (RateGoal("fwd", 260.0), RateGoal("bwd", 320.0)),
    "skewed": (RateGoal("fwd", 420.0, ("T=32768", "T=131072")), RateGoal("bwd", 450.0, ("T=32768", "T=131072"))),
    "tiled": (RateGoal("fwd", 400.0),),
    "trained": (RateGoal("fwd", 350.0), RateGoal("bwd", 400.0)),
}
SELECT_GOAL = 400.0  # TF/s of the selection, on every regime (it scores the index inputs alike)
# torch_msa's fwd+bwd at most this factor of cuDNN BSA's time (`--selection tiled`, the one BSA
# expresses), at these problems.
BSA_TIME_FACTOR, BSA_PROBLEMS = 1.0, ("T=8192", "T=32768", "T=65536")
MEMORY_FROM_TOKENS = 131072
MEMORY_KIB_PER_TOKEN = 80  # above the inputs, select+fwd+bwd, from MEMORY_FROM_TOKENS tokens on


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


def _judge(result: BenchResult, label: str, threshold: float, unit: str, value,
           only: tuple[str, ...] = ()) -> Outcome:
    problems = [p for p in result.problems if not only or p.name in only]
    values = {p.name: v for p in problems if (v := value(p)) is not None}
    if not values:
        where = f" at {' or '.join(only)}" if only else ""
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
    label = (f"memory: select+fwd+bwd at most {MEMORY_KIB_PER_TOKEN} KiB per token above the inputs from "
             f"T={MEMORY_FROM_TOKENS} on, no T x T buffer")
    lines, values, verdicts = [], {}, []
    for problem in result.problems:
        tokens = problem.spec.tokens
        row = problem.row(MSA, STEP)
        if tokens < MEMORY_FROM_TOKENS or row is None or row.status == "skipped":
            continue
        if row.status != OK:
            lines.append(f"{problem.name} {row.status}")
            verdicts.append(NOT_REACHED)
        elif row.extra_peak_bytes is None:
            lines.append(f"{problem.name} ran (peak memory not tracked on this device)")
            verdicts.append(NOT_MEASURED)
        else:
            values[problem.name] = per_token = row.extra_peak_bytes / tokens / 1024
            lines.append(f"{problem.name} ran, peak {row.extra_peak_bytes / 2**30:.2f} GiB above the inputs "
                         f"({per_token:.0f} KiB per token)")
            verdicts.append(REACHED if per_token <= MEMORY_KIB_PER_TOKEN else NOT_REACHED)
    if not verdicts:
        return Outcome(label, NOT_MEASURED, f"no select+fwd+bwd from T={MEMORY_FROM_TOKENS} on", {})
    verdict = NOT_REACHED if NOT_REACHED in verdicts else NOT_MEASURED if NOT_MEASURED in verdicts else REACHED
    return Outcome(label, verdict, "; ".join(lines), values)


def selection_of(result: BenchResult) -> str:
    """The run's selection regime (`--selection`, recorded in its meta; `index` by default)."""
    return result.meta.get("selection") or "index"


def _rate_label(goal: RateGoal, selection: str) -> str:
    name = {"fwd": "forward", "bwd": "backward (dq, dk, dv)"}[goal.phase]
    where = f" at {' and '.join(goal.at)}" if goal.at else ""
    return f"{name} >= {goal.tflops:.0f} TF/s{where} (--selection {selection})"


def evaluate(result: BenchResult) -> list[Outcome]:
    """The goals of the run's selection regime (`selection_of`), then those of every regime."""
    selection = selection_of(result)
    outcomes = [_judge(result, _rate_label(goal, selection), goal.tflops, "TF/s", _rate(MSA, goal.phase), goal.at)
                for goal in RATE_GOALS[selection]]
    if selection == "index":
        outcomes += [
            _judge(result, "select+fwd+bwd >= 10x cuDNN dense fwd+bwd at T=64K (--selection index)", 10.0, "x",
                   _ratio(CUDNN, "fwd+bwd", STEP), only=("T=65536",)),
            _judge(result, "select+fwd+bwd >= 15x cuDNN dense fwd+bwd at T=128K (--selection index)", 15.0, "x",
                   _ratio(CUDNN, "fwd+bwd", STEP), only=("T=131072",)),
            _judge(result, "forward >= 4x fla parallel_nsa (--selection index)", 4.0, "x", _ratio(FLA, "fwd", "fwd")),
            _judge(result, "backward >= 3x fla parallel_nsa (--selection index)", 3.0, "x",
                   _ratio(FLA, "bwd", "bwd")),
        ]
    if selection == "tiled":
        # Judged as a speedup, like the others: BSA's time over torch_msa's, at least 1 / factor.
        outcomes.append(_judge(result, f"fwd+bwd at most {BSA_TIME_FACTOR:g}x {BSA}'s time at "
                                       f"{', '.join(BSA_PROBLEMS)} (--selection tiled)",
                               1 / BSA_TIME_FACTOR, "x", _ratio(BSA, "fwd+bwd", "fwd+bwd"), only=BSA_PROBLEMS))
    outcomes += [
        _judge(result, f"selection (index scoring + top-k) >= {SELECT_GOAL:.0f} TF/s", SELECT_GOAL, "TF/s",
               _rate(MSA, "select")),
        _topk_share(result),
        _memory(result),
    ]
    return outcomes


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
    """The TF/s goals per phase of the run's selection regime, to draw against its bars: none
    unless the goals are judged on its device (`why_not_judged`)."""
    if why_not_judged(result.meta):
        return {}
    return {goal.phase: goal.tflops for goal in RATE_GOALS[selection_of(result)]} | {"select": SELECT_GOAL}


def format_outcomes(outcomes: list[Outcome], not_judged: str | None = None) -> str:
    """The goals' lines: one per outcome, or the one line saying why they are `not_judged`."""
    title = "performance goals (docs/performance.md; set for one H200, M3 shapes, bf16)"
    if not_judged:
        return f"{title}: not judged on this device: {not_judged}"
    lines = [f"{title}:"]
    for outcome in outcomes:
        lines.append(f"  [{outcome.verdict}] {outcome.label}: {outcome.detail}")
    return "\n".join(lines)
