"""The benchmark's outputs: the printed table, the JSON file and the PNG plot."""

import json
import math
import os

from .results import OK, BenchResult, ProblemResult, Row

PLOT_IMPLS = ("cudnn dense", "flash dense", "math dense", "fla parallel_nsa", "FlexAttention", "cuDNN BSA blk128",
              "torch_msa")


def format_rate(value: float | None) -> str:
    """TF/s with one decimal, or three significant digits below 10 (CPU runs)."""
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _describe_problem(problem: ProblemResult) -> str:
    spec, work = problem.spec, problem.work
    layout = f"{len(spec.lengths)} documents" if spec.pack else "1 document"
    if work is None:
        return f"{problem.name}: {layout}, {spec.tokens} tokens"
    per_token = work.attended_pairs / spec.tokens
    dense_per_token = work.causal_pairs / spec.tokens
    return (f"{problem.name}: {layout}, {spec.tokens} tokens; MSA reads {per_token:.0f} keys per token "
            f"(S = {work.attended_pairs:.4g}), dense causal {dense_per_token:.0f} "
            f"({per_token / dense_per_token:.1%})")


def format_table(result: BenchResult) -> str:
    """The table: per problem, one line per (implementation, phase)."""
    baseline = result.problems[0].baseline if result.problems else "baseline"
    peak = result.peak_tflops
    peak_column = f"% of {peak:.0f}" if peak else "% of peak"
    header = (f"  {'implementation':<17} {'phase':<15} {'ms':>11} {'runs':>5} {'TF/s':>8} "
              f"{peak_column:>8} {'vs ' + baseline.split()[0]:>9}  note")
    lines = []
    for problem in result.problems:
        lines += ["", _describe_problem(problem), header]
        for row in problem.rows:
            lines.append(_format_row(problem, row, peak))
        lines += [f"  note: {note}" for note in problem.notes]
    lines.append("")
    if peak:
        of_peak = f"% of the device's {peak:.0f} TF/s dense bf16 rate ({result.meta.get('peak_source', '')})"
    else:
        of_peak = "% of peak: no known dense bf16 rate for this device"
    lines.append(f"TF/s: valid (query, key) pairs only (docs/performance.md); {of_peak}; vs {baseline}: its time "
                 "for the same phase / this row's (select+fwd+bwd against its fwd+bwd).")
    return "\n".join(lines)


def _format_row(problem: ProblemResult, row: Row, peak_tflops: float | None) -> str:
    if row.status == OK:
        ms = f"{row.ms:11.3f}"
        runs = f"{row.runs}{'*' if row.capped else ''}"
    else:
        ms, runs = f"{row.status:>11}", ""
    speedup, fraction = problem.speedup(row), row.peak_fraction(peak_tflops)
    percent = "-" if fraction is None else f"{100 * fraction:.1f}%"
    ratio = "-" if speedup is None else f"{speedup:.2f}x"
    notes = ["* runs cut by the time budget" if row.capped else "", row.note]
    if row.extra_peak_bytes is not None:
        notes.append(f"peak +{row.extra_peak_bytes / 2**30:.2f} GiB")
    note = "; ".join(filter(None, notes))
    return (f"  {row.impl:<17} {row.phase:<15} {ms} {runs:>5} {format_rate(row.tflops):>8} "
            f"{percent:>8} {ratio:>9}  {note}").rstrip()


def write_json(result: BenchResult, outcomes, path: str, targets_not_judged: str | None = None) -> None:
    """The result, the goals' `outcomes` and, when they were not judged, why not (`targets.why_not_judged`)."""
    data = result.to_json()
    data["targets"] = [{"target": o.label, "verdict": o.verdict, "detail": o.detail, "values": o.values}
                       for o in outcomes]
    data["targets_not_judged"] = targets_not_judged
    with open(path, "w") as handle:
        json.dump(_finite(data), handle, indent=1, allow_nan=False)
        handle.write("\n")


def _finite(value):
    """JSON has no NaN or infinity: such floats become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_plot(result: BenchResult, path: str, goals: dict[str, float] | None = None) -> str | None:
    """Write the PNG; returns why it was not written (matplotlib missing, nothing timed) or None.

    `goals` maps a phase (`fwd`, `bwd`) to a TF/s goal drawn as a line on its panel
    (`targets.rate_goals`: none for a run that is not on the device the goals are set for)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"matplotlib is not importable ({error}); no plot written"
    figure = plot(result, goals or {})
    if figure is None:
        return "nothing was timed; no plot written"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def plot(result: BenchResult, goals: dict[str, float]):
    """The matplotlib figure of `write_plot` (needs matplotlib), or None when nothing was timed."""
    import matplotlib.pyplot as plt

    panels = [
        ("training step: fwd+bwd (torch_msa: select+fwd+bwd), ms, log scale", "fwd+bwd", "ms"),
        ("forward, effective TF/s", "fwd", "tflops"),
        ("backward, effective TF/s", "bwd", "tflops"),
    ]
    names = [p.name for p in result.problems]
    impls = [impl for impl in PLOT_IMPLS if any(p.timed(impl, "fwd") or p.timed(impl, "select+fwd+bwd")
                                                 for p in result.problems)]
    if not names or not impls:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8))
    width = 0.8 / len(impls)
    for axis, (title, phase, quantity) in zip(axes, panels):
        for index, impl in enumerate(impls):
            heights = []
            for problem in result.problems:
                row = problem.timed(impl, "select+fwd+bwd" if impl == "torch_msa" and quantity == "ms" else phase)
                value = None if row is None else (row.ms if quantity == "ms" else row.tflops)
                heights.append(math.nan if value is None else value)
            positions = [i + (index - (len(impls) - 1) / 2) * width for i in range(len(names))]
            axis.bar(positions, heights, width, label=impl)
        axis.set_xticks(range(len(names)), names, rotation=20)
        axis.set_title(title, fontsize=10)
        if quantity == "ms":
            axis.set_yscale("log")
            continue
        if result.peak_tflops:
            axis.axhline(result.peak_tflops, color="black", linestyle=":", linewidth=1,
                         label=f"device bf16 {result.peak_tflops:.0f}")
        if phase in goals:
            axis.axhline(goals[phase], color="red", linestyle="--", linewidth=1, label=f"H200 goal {goals[phase]:.0f}")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    device = result.meta.get("device", "")
    shapes = result.meta.get("shape_text", "")
    figure.suptitle(f"torch_msa benchmark on {device} ({result.meta.get('selection', '')} selection, {shapes})")
    figure.tight_layout()
    return figure
