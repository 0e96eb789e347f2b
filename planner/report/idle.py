"""Where a step's devices wait: the pipeline bubble and exposed communication, per rank.

A rank's step is split into time it computes (any compute task, on any stream), time it only
communicates (sends and collectives with no compute running: exposed communication) and
time it does neither (waiting for a message or a peer: the bubble). A RECV's span is its wait
for the message, so it counts as bubble, not as communication. The timeline marks both
(`planner.report.plots`) and the search warns when they leave devices idle (`planner.report.advice`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from piper.dag import Kind
from runtime.lowering.dryrun import Span

Interval = tuple[float, float]


@dataclass(frozen=True)
class Idle:
    """One rank's step: intervals, each sorted and disjoint."""

    step_s: float
    compute: tuple[Interval, ...]
    exposed: tuple[Interval, ...]  # communication with no compute running
    bubble: tuple[Interval, ...]  # neither

    @property
    def bubble_s(self) -> float:
        return _length(self.bubble)

    @property
    def exposed_s(self) -> float:
        return _length(self.exposed)


def idle_by_rank(spans: Iterable[Span]) -> dict[int, Idle]:
    """Every rank's compute, exposed communication and bubble over the step (from 0 to the
    last task of any rank)."""
    compute: dict[int, list[Interval]] = {}
    comm: dict[int, list[Interval]] = {}
    end = 0.0
    for s in spans:
        end = max(end, s.end)
        if s.end <= s.start:
            continue
        if s.task.kind.is_compute:
            compute.setdefault(s.rank, []).append((s.start, s.end))
        elif s.task.kind is not Kind.RECV:
            comm.setdefault(s.rank, []).append((s.start, s.end))
        else:
            compute.setdefault(s.rank, [])
    out = {}
    for rank in sorted(set(compute) | set(comm)):
        busy = union(compute.get(rank, []))
        exposed = minus(union(comm.get(rank, [])), busy)
        bubble = minus([(0.0, end)], union([*busy, *exposed]))
        out[rank] = Idle(end, tuple(busy), tuple(exposed), tuple(bubble))
    return out


def idle_share(idle: dict[int, Idle]) -> tuple[float, float]:
    """(bubble, exposed communication) as shares of every rank's step, averaged."""
    if not idle:
        return 0.0, 0.0
    total = sum(i.step_s for i in idle.values()) or 1.0
    return (sum(i.bubble_s for i in idle.values()) / total,
            sum(i.exposed_s for i in idle.values()) / total)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def minus(xs: Sequence[Interval], ys: Sequence[Interval]) -> list[Interval]:
    """`xs` without `ys` (both sorted and disjoint)."""
    out: list[Interval] = []
    j = 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k, start = j, a
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > start:
                out.append((start, ys[k][0]))
            start = max(start, ys[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def _length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)
