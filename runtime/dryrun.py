"""Execute a Plan in simulated time with the runtime's blocking semantics.

A SEND never blocks its sender (the runtime posts `isend`); a RECV blocks until its message has
arrived; a collective blocks until every rank of its group reached it. With zero costs this is
the deadlock check; with cost-model durations it is the simulator's engine — the same Plan,
the same order, one more executor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from piper.dag import Kind
from piper.errors import PiperError
from runtime.plan import Plan, Task


class DeadlockError(PiperError):
    """The Plan cannot finish: each named rank waits on something that never happens."""


@dataclass(frozen=True, slots=True)
class Span:
    rank: int
    stream: str
    task: Task
    start: float
    end: float


def _unit(_rank: int, _task: Task) -> float:
    return 0.0


def dry_run(plan: Plan, duration: Callable[[int, Task], float] = _unit,
            transfer: Callable[[int, Task], float] = _unit) -> list[Span]:
    """Run every rank's streams to completion; return the spans in completion order.

    `duration(rank, task)` is a task's busy time on its stream; `transfer(rank, send_task)` the
    time a message spends on the wire after its SEND is posted.
    """
    seqs = {rp.rank: [(s, t) for s, ts in rp.streams for t in ts] for rp in plan.ranks}
    # TODO(issue 3): one clock per stream; the skeleton has one stream per rank.
    pos = {r: 0 for r in seqs}
    clock = {r: 0.0 for r in seqs}
    arrived: dict[int, float] = {}  # P2P tag -> arrival time
    coll_count: dict[tuple[int, tuple[int, ...]], int] = {}
    waiting: dict[tuple[tuple[int, ...], int], dict[int, float]] = {}
    spans: list[Span] = []
    done = 0
    total = sum(len(s) for s in seqs.values())

    def finish(r: int, stream: str, t: Task, start: float, end: float) -> None:
        nonlocal done
        spans.append(Span(r, stream, t, start, end))
        clock[r] = end
        pos[r] += 1
        done += 1

    while done < total:
        progress = False
        for r, seq in seqs.items():
            while pos[r] < len(seq):
                stream, t = seq[pos[r]]
                if t.kind is Kind.RECV:
                    if t.tag not in arrived:
                        break
                    finish(r, stream, t, clock[r], max(clock[r], arrived[t.tag]))
                elif t.kind is Kind.SEND:
                    start = clock[r]
                    finish(r, stream, t, start, start + duration(r, t))
                    arrived[t.tag] = clock[r] + transfer(r, t)
                elif t.group:
                    k = coll_count.get((r, t.group), 0)
                    key = (t.group, k)
                    w = waiting.setdefault(key, {})
                    if r in w:
                        break
                    w[r] = clock[r]
                    if len(w) < len(t.group):
                        break
                    start = max(w.values())
                    for m in t.group:
                        coll_count[(m, t.group)] = k + 1
                        ms, mt = seqs[m][pos[m]]
                        finish(m, ms, mt, start, start + duration(m, mt))
                    del waiting[key]
                else:
                    finish(r, stream, t, clock[r], clock[r] + duration(r, t))
                progress = True
        if not progress:
            stuck = [f"rank {r} at {seqs[r][pos[r]][1].name}"
                     + (f" (from rank {seqs[r][pos[r]][1].peer})"
                        if seqs[r][pos[r]][1].kind is Kind.RECV else "")
                     for r in seqs if pos[r] < len(seqs[r])]
            raise DeadlockError("deadlock in plan: " + "; ".join(stuck))
    return spans
