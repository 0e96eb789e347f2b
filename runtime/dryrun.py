"""Execute a Plan in simulated time with the runtime's blocking semantics.

Each (rank, stream) runs its tasks in order on its own clock. A SEND never blocks its sender
(the runtime posts `isend`); a RECV blocks until its message has arrived; a collective blocks
until every rank of its group reached it; a task whose `after` names tasks of another stream
of its rank waits for them (the runtime's events). With zero costs this is the deadlock
check; with cost-model durations it is the simulator's engine — the same Plan, the same
order, one more executor.
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
    """Run every stream of every rank to completion; return spans in completion order.

    `duration(rank, task)` is a task's busy time on its stream; `transfer(rank, send_task)` the
    time a message spends on the wire after its SEND is posted.
    """
    seqs = {(rp.rank, s): list(ts) for rp in plan.ranks for s, ts in rp.streams if ts}
    pos = dict.fromkeys(seqs, 0)
    clock = dict.fromkeys(seqs, 0.0)
    done: dict[tuple[int, str], float] = {}  # (rank, task name) -> end time
    arrived: dict[int, float] = {}  # P2P tag -> arrival time
    coll_count: dict[tuple[int, tuple[int, ...]], int] = {}
    waiting: dict[tuple[tuple[int, ...], int], dict[int, tuple[str, float]]] = {}
    spans: list[Span] = []
    total = sum(len(s) for s in seqs.values())

    def finish(key: tuple[int, str], t: Task, start: float, end: float) -> None:
        spans.append(Span(key[0], key[1], t, start, end))
        clock[key] = end
        pos[key] += 1
        done[(key[0], t.name)] = end

    while len(spans) < total:
        progress = False
        for key, seq in seqs.items():
            r = key[0]
            while pos[key] < len(seq):
                t = seq[pos[key]]
                if any((r, a) not in done for a in t.after):
                    break
                ready = max([clock[key], *(done[(r, a)] for a in t.after)])
                if t.kind is Kind.RECV:
                    if t.tag not in arrived:
                        break
                    finish(key, t, ready, max(ready, arrived[t.tag]))
                elif t.kind is Kind.SEND:
                    finish(key, t, ready, ready + duration(r, t))
                    arrived[t.tag] = clock[key] + transfer(r, t)
                elif t.group:
                    k = coll_count.get((r, t.group), 0)
                    w = waiting.setdefault((t.group, k), {})
                    if r in w:
                        break
                    w[r] = (key[1], ready)
                    if len(w) < len(t.group):
                        break
                    start = max(at for _, at in w.values())
                    for m, (stream, _) in w.items():
                        coll_count[(m, t.group)] = k + 1
                        mt = seqs[(m, stream)][pos[(m, stream)]]
                        finish((m, stream), mt, start, start + duration(m, mt))
                    del waiting[(t.group, k)]
                else:
                    finish(key, t, ready, ready + duration(r, t))
                progress = True
        if not progress:
            stuck = []
            for (r, s), seq in seqs.items():
                if pos[(r, s)] < len(seq):
                    t = seq[pos[(r, s)]]
                    why = f" (from rank {t.peer})" if t.kind is Kind.RECV else ""
                    where = f" on stream {s}" if len(plan.ranks[r].streams) > 1 else ""
                    stuck.append(f"rank {r} at {t.name}{why}{where}")
            raise DeadlockError("deadlock in plan: " + "; ".join(stuck))
    return spans
