"""Figures: a per-rank, per-stream Gantt chart of a timeline, and a search's Pareto plot.

matplotlib is imported inside the functions, so the CLI starts fast; figures are drawn on
`matplotlib.figure.Figure` without pyplot, so no global backend is chosen or changed (PNG
output goes through Agg).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from piper.dag import Kind
from planner.search import TrialRecord
from runtime.dryrun import Span
from runtime.plan import COMPUTE_STREAM

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#8172b3", "U": "#55a868",
           "comm": "#8c8c8c"}
"""One colour per task group: the chunk kinds, the update, and all communication."""


def task_group(kind: Kind) -> str:
    """F, B, I, W or U for compute tasks (their `Kind` letter), `comm` for the rest."""
    return kind.value if kind.is_compute else "comm"


def _time_unit(seconds: float) -> tuple[str, float]:
    for unit, scale in (("s", 1.0), ("ms", 1e3), ("µs", 1e6)):
        if seconds * scale >= 1:
            return unit, scale
    return "ns", 1e9


def write_timeline(spans: Iterable[Span], path: str | Path, *, title: str = "") -> None:
    """Gantt chart: one row per (rank, stream), one bar per task coloured by `task_group`.

    A RECV's span is its wait for the message, not work, so it is left blank like any idle.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    bars: dict[tuple[int, str], dict[str, list[tuple[float, float]]]] = {}
    end = 0.0
    for s in spans:
        row = bars.setdefault((s.rank, s.stream), {})
        end = max(end, s.end)
        if s.task.kind is not Kind.RECV and s.end > s.start:
            row.setdefault(task_group(s.task.kind), []).append((s.start, s.end - s.start))
    rows = sorted(bars, key=lambda k: (k[0], k[1] != COMPUTE_STREAM, k[1]))
    unit, scale = _time_unit(end)
    fig = Figure(figsize=(12, 1.2 + 0.4 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    for y, key in enumerate(rows):
        for group, xs in bars[key].items():
            ax.broken_barh([(a * scale, w * scale) for a, w in xs], (y - 0.4, 0.8),
                           facecolors=COLOURS[group], edgecolor="white", linewidth=0.3)
    many_streams = len(rows) > len({r for r, _ in rows})
    ax.set_yticks(range(len(rows)), [f"rank {r}" + (f" · {s}" if many_streams else "")
                                     for r, s in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top, as in traces
    ax.set_xlim(0, max(end * scale, 1e-12))
    ax.set_xlabel(f"time ({unit})")
    used = [g for g in COLOURS if any(g in bars[k] for k in rows)]
    fig.legend(handles=[Patch(color=COLOURS[g], label=g) for g in used],
               loc="outside lower center", ncol=len(used) or 1, frameon=False)
    ax.set_title(title or "simulated step")
    fig.savefig(path, format="png", dpi=100)


def write_pareto(records: Sequence[TrialRecord], path: str | Path, *,
                 memory_limit_bytes: int | None = None) -> None:
    """Step time against the largest per-rank peak memory of every feasible trial, the
    Pareto front drawn over them, labelled with each front strategy's shape. The device
    memory limit is drawn when it is near the points, and named in the title otherwise."""
    from matplotlib.figure import Figure

    from planner.report import GIB, fmt_bytes, pareto

    peaks = [max(r.predicted["peak_memory_bytes"]) for r in records if r.feasible]
    unit, size = ("GiB", GIB) if max(peaks, default=0) >= GIB else ("MiB", 1024**2)

    def point(r: TrialRecord) -> tuple[float, float]:
        return r.predicted["step_time_s"] * 1e3, max(r.predicted["peak_memory_bytes"]) / size

    feasible = [point(r) for r in records if r.feasible]
    front = pareto(records)
    fig = Figure(figsize=(8, 5.5), layout="constrained")
    ax = fig.add_subplot()
    if feasible:
        ax.scatter(*zip(*feasible, strict=True), s=18, color="#9aa5b1",
                   label=f"feasible trials ({len(feasible)})")
    if front:
        xs, ys = zip(*(point(r) for r in front), strict=True)
        ax.plot(xs, ys, "-o", color="#c44e52", markersize=6, label="Pareto front")
        for r, x, y in zip(front, xs, ys, strict=True):
            s = r.summary
            ax.annotate(f"pp{s['pp']} dp{s['dp']} z{s['zero']} {s['schedule']} m"
                        f"{s['microbatches']}", (x, y), textcoords="offset points",
                        xytext=(6, 4), fontsize=7)
    title = "search trials: step time against memory"
    if memory_limit_bytes is not None:
        if memory_limit_bytes <= 1.5 * max(peaks, default=0):
            ax.axhline(memory_limit_bytes / size, color="black", linestyle="--",
                       linewidth=0.8, label="device memory")
        else:
            title += f" (device memory {fmt_bytes(memory_limit_bytes)})"
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel(f"peak memory, largest rank ({unit})")
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right")
    fig.savefig(path, format="png", dpi=100)
