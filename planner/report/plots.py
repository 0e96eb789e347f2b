"""Figures: a per-rank, per-stream Gantt chart of a timeline, and a search's Pareto plot.

matplotlib is imported inside the functions, so the CLI starts fast; figures are drawn on
`matplotlib.figure.Figure` without pyplot, so no global backend is chosen or changed (PNG
output goes through Agg).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from piper.dag import Kind
from planner.search.loop import TrialRecord
from runtime.lowering.dryrun import Span
from runtime.lowering.plan import COMPUTE_STREAM

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


def write_timeline(spans: Iterable[Span], path: str | Path, *, title: str = "",
                   stands_for: Mapping[int, Sequence[int]] | None = None) -> None:
    """Gantt chart: one row per group of ranks and stream, one bar per task coloured by
    `task_group`, with the bubble and exposed communication marked on each compute row.

    Ranks that run the same tasks at the same times (data-parallel replicas, most often)
    are one group, labelled with every rank it stands for (`stands_for`: a simulated rank
    -> the processes it represents, `planner.search.replicas.stands_for`); ranks that differ keep
    rows of their own. A RECV's span is its wait for the message, not work, so it is left
    blank like any idle; blank stretches of a compute row are hatched as bubble, and
    communication running with no compute is hatched as exposed.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from planner.report.idle import idle_by_rank

    spans = list(spans)
    groups = _same_ranks(spans)
    first = {g[0]: g for g in groups}
    bars: dict[tuple[int, str], dict[str, list[tuple[float, float]]]] = {}
    end = 0.0
    for s in spans:
        end = max(end, s.end)
        if s.rank not in first:
            continue  # drawn by the first rank of its group
        row = bars.setdefault((s.rank, s.stream), {})
        if s.task.kind is not Kind.RECV and s.end > s.start:
            row.setdefault(task_group(s.task.kind), []).append((s.start, s.end - s.start))
    idle = idle_by_rank(s for s in spans if s.rank in first)
    rows = sorted(bars, key=lambda k: (k[0], k[1] != COMPUTE_STREAM, k[1]))
    unit, scale = _time_unit(end)
    fig = Figure(figsize=(12, 1.4 + 0.45 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    marked = set()
    for y, key in enumerate(rows):
        for group, xs in bars[key].items():
            ax.broken_barh([(a * scale, w * scale) for a, w in xs], (y - 0.4, 0.8),
                           facecolors=COLOURS[group], edgecolor="white", linewidth=0.3)
        rank, stream = key
        if stream == COMPUTE_STREAM or (rank, COMPUTE_STREAM) not in bars:
            i = idle.get(rank)
            for what, xs, style in (("bubble", i.bubble if i else (), BUBBLE),
                                    ("exposed", i.exposed if i else (), EXPOSED)):
                if xs:
                    ax.broken_barh([(a * scale, (b - a) * scale) for a, b in xs],
                                   (y - 0.4, 0.8), **style)
                    marked.add(what)
    many_streams = len(rows) > len({r for r, _ in rows})
    labels = [_ranks_label(first[r], stands_for) + (f" · {st}" if many_streams else "")
              for r, st in rows]
    ax.set_yticks(range(len(rows)), labels)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top, as in traces
    ax.set_xlim(0, max(end * scale, 1e-12))
    ax.set_xlabel(f"time ({unit})")
    used = [g for g in COLOURS if any(g in bars[k] for k in rows)]
    handles = [Patch(color=COLOURS[g], label=g) for g in used]
    handles += [Patch(label=MARK_LABELS[m], **MARKS[m]) for m in ("bubble", "exposed")
                if m in marked]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles) or 1,
               frameon=False)
    ax.set_title(title or "simulated step")
    fig.savefig(path, format="png", dpi=100)


MARKS = {"bubble": {"facecolor": "none", "edgecolor": "#9aa5b1", "hatch": "///"},
         "exposed": {"facecolor": "none", "edgecolor": "#c44e52", "hatch": "xxx"}}
"""Hatching over a compute row: where it waits (bubble), where only communication runs."""
BUBBLE, EXPOSED = ({"facecolors": "none", "edgecolor": m["edgecolor"], "hatch": m["hatch"],
                    "linewidth": 0} for m in MARKS.values())
MARK_LABELS = {"bubble": "bubble (idle)", "exposed": "exposed communication"}


def _same_ranks(spans: list[Span]) -> list[tuple[int, ...]]:
    """Ranks grouped by the tasks they run and when (to the nanosecond), in rank order."""
    sig: dict[int, list[tuple]] = {}
    for s in spans:
        sig.setdefault(s.rank, []).append((s.stream, s.task.name, round(s.start, 9),
                                           round(s.end, 9)))
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(sig):
        groups.setdefault(tuple(sorted(sig[rank])), []).append(rank)
    return sorted(tuple(g) for g in groups.values())


def _ranks_label(group: Sequence[int], stands_for: Mapping[int, Sequence[int]] | None) -> str:
    ranks = sorted({p for r in group for p in (stands_for or {}).get(r, (r,))})
    return ranks_text(ranks)


def ranks_text(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 0-15', 'ranks 0, 4, ..., 60 (16)', 'ranks 1, 2, 5'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    steps = {b - a for a, b in itertools.pairwise(ranks)}
    if steps == {1}:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    if len(steps) == 1 and len(ranks) > 3:
        return f"ranks {ranks[0]}, {ranks[1]}, ..., {ranks[-1]} ({len(ranks)})"
    if len(ranks) <= 4:
        return "ranks " + ", ".join(map(str, ranks))
    return f"ranks {', '.join(map(str, ranks[:3]))}, ... ({len(ranks)})"


def write_pareto(records: Sequence[TrialRecord], path: str | Path, *,
                 memory_limit_bytes: int | None = None) -> list[tuple[float, ...]]:
    """Step time against the largest per-rank peak memory of every feasible trial, the
    Pareto front drawn over them, labelled with each front strategy's shape (labels moved
    apart where they would overlap). The device memory limit is drawn when it is near the
    points, and named in the title otherwise. Returns the labels' boxes (x0, y0, x1, y1 in
    pixels)."""
    from matplotlib.figure import Figure

    from planner.report.tables import GIB, fmt_bytes, pareto

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
    labels = []
    if front:
        xs, ys = zip(*(point(r) for r in front), strict=True)
        ax.plot(xs, ys, "-o", color="#c44e52", markersize=6, label="Pareto front")
        for r, x, y in zip(front, xs, ys, strict=True):
            labels.append(ax.annotate(_shape(r.summary), (x, y), textcoords="offset points",
                                      xytext=(6, 4), fontsize=7))
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
    boxes = _apart(fig, labels)
    fig.savefig(path, format="png", dpi=100)
    return boxes


def _shape(s: dict) -> str:
    """A front point's label: its degrees, and its schedule where there is a pipeline."""
    parts = [f"dp{s['dp']}", f"pp{s['pp']}"] + [f"{k}{s[k]}" for k in ("tp", "ep") if s[k] > 1]
    parts.append(f"z{s['zero']}")
    if s["pp"] > 1:
        parts.append(s["schedule"] + (f" v{s['virtual_stages']}"
                                      if s["virtual_stages"] > 1 else ""))
    rc = s.get("recompute")
    parts.append(f"m{s['microbatches']}" + (" rc" if rc is True else f" rc:{rc}" if rc else ""))
    return " ".join(parts)


def _apart(fig: Any, labels: list) -> list[tuple[float, ...]]:
    """Move each label, in order, to the first offset beside its point (right, then left;
    nearest first) where its box stays inside the axes and overlaps neither the legend nor
    a label placed before it (failing that, the first clear of the others); boxes in
    pixels. Labels take no part in the layout, so placing them moves nothing else."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not labels:
        return []
    for label in labels:
        label.set_in_layout(False)
    FigureCanvasAgg(fig)
    fig.draw_without_rendering()  # the constrained layout settles the axes first
    renderer = fig.canvas.get_renderer()
    ax = labels[0].axes
    frame = ax.get_window_extent(renderer)
    legend = ax.get_legend()
    placed: list = []
    taken = [legend.get_window_extent(renderer)] if legend else []
    tries = [(dx, dy, ha) for k in range(12) for dy in (4 + 11 * k, -11 - 11 * k)
             for dx, ha in ((6, "left"), (-6, "right"))]
    for label in labels:
        fallback = None
        for dx, dy, ha in tries:
            label.xyann = (dx, dy)
            label.set_horizontalalignment(ha)
            box = label.get_window_extent(renderer)
            if any(box.overlaps(p) for p in placed):
                continue
            fallback = fallback or (dx, dy, ha)
            inside = (frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0
                      and box.y1 <= frame.y1)
            if inside and not any(box.overlaps(t) for t in taken):
                break
        else:
            if fallback:
                label.xyann = fallback[:2]
                label.set_horizontalalignment(fallback[2])
        placed.append(label.get_window_extent(renderer))
    return [tuple(b.extents) for b in placed]
