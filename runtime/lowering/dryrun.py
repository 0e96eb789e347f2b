"""Execute a Plan in simulated time with the runtime's blocking semantics.

Each (rank, stream) runs its tasks in order on its own clock. A SEND never blocks its sender
(the runtime posts `isend`); a RECV blocks until its message has arrived; a collective blocks
until every rank of its group reached it; a task whose `after` names tasks of another stream
of its rank waits for them (the runtime's events). With zero costs this is the deadlock
check; with cost-model durations it is the simulator's engine — the same Plan, the same
order, one more executor.

The engine is event driven: a stream runs until it blocks, then waits on exactly one thing
(a task of another stream, a message, a collective meeting) and is woken when that thing
happens. Every task is visited a bounded number of times, so a step of N tasks costs O(N)
however the streams interleave; times do not depend on the order streams are visited in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from piper.dag import Kind
from piper.errors import PiperError
from runtime.lowering.plan import Plan, Task


class DeadlockError(PiperError):
    """The Plan cannot finish: each named rank waits on something that never happens."""


@dataclass(frozen=True, slots=True)
class Span:
    rank: int
    stream: str
    task: Task
    start: float
    end: float


# A frozen dataclass's __init__ goes through object.__setattr__ per field; a simulated step
# makes one Span per task, so build them through the slot descriptors directly (3x faster).
_SET_RANK, _SET_STREAM, _SET_TASK, _SET_START, _SET_END = (
    Span.__dict__[f].__set__ for f in ("rank", "stream", "task", "start", "end"))


def _span(rank: int, stream: str, task: Task, start: float, end: float) -> Span:
    s = object.__new__(Span)
    _SET_RANK(s, rank)
    _SET_STREAM(s, stream)
    _SET_TASK(s, task)
    _SET_START(s, start)
    _SET_END(s, end)
    return s


def _unit(_rank: int, _task: Task) -> float:
    return 0.0


def dry_run(plan: Plan, duration: Callable[[int, Task], float] = _unit,
            transfer: Callable[[int, Task], float] = _unit) -> list[Span]:
    """Run every stream of every rank to completion; return spans in completion order.

    `duration(rank, task)` is a task's busy time on its stream; `transfer(rank, send_task)` the
    time a message spends on the wire after its SEND is posted. Raises `DeadlockError`, naming
    every stream's blocking task, when some stream can never finish.
    """
    recv, send = Kind.RECV, Kind.SEND
    new_span, set_rank, set_stream, set_task, set_start, set_end = (
        object.__new__, _SET_RANK, _SET_STREAM, _SET_TASK, _SET_START, _SET_END)
    lanes = [(rp.rank, s, ts) for rp in plan.ranks for s, ts in rp.streams if ts]
    n = len(lanes)
    pos = [0] * n
    clock = [0.0] * n
    # `after` only names tasks of other streams: a plan of single-stream ranks has none
    awaited = {(r, a) for r, _, ts in lanes for t in ts if t.after for a in t.after} if any(
        len(rp.streams) > 1 for rp in plan.ranks) else set()
    done: dict[tuple[int, str], float] = {}  # (rank, task name) -> end, for awaited tasks
    arrived: dict[int, float] = {}  # P2P tag -> arrival time
    coll_count: dict[tuple[int, tuple[int, ...]], int] = {}  # (rank, group) -> collectives met
    meeting: dict[tuple[tuple[int, ...], int], dict[int, tuple[int, float]]] = {}
    # who waits for what: a lane is in at most one of these lists, and only while blocked
    on_done: dict[tuple[int, str], list[int]] = {}
    on_arrival: dict[int, list[int]] = {}
    on_meeting: dict[tuple[tuple[int, ...], int], list[int]] = {}
    # a collective meets when every rank of its group the plan holds has arrived (a
    # simulation view holds one replica of each kind; the others would arrive alike)
    present = {rp.rank for rp in plan.ranks}
    seats_of: dict[tuple[int, ...], int] = {}
    spans: list[Span] = []
    add = spans.append
    todo = deque(range(n))
    queued = [True] * n

    def wake(waiters: list[int]) -> None:
        for j in waiters:
            if not queued[j]:
                queued[j] = True
                todo.append(j)

    def finished(r: int, name: str, end: float) -> None:
        if (r, name) in awaited:
            done[(r, name)] = end
            waiters = on_done.pop((r, name), None)
            if waiters:
                wake(waiters)

    while todo:
        i = todo.popleft()
        queued[i] = False
        r, stream, seq = lanes[i]
        p, now, last = pos[i], clock[i], len(seq)
        while p < last:
            t = seq[p]
            ready = now
            if t.after:
                missing = next(((r, a) for a in t.after if (r, a) not in done), None)
                if missing is not None:
                    on_done.setdefault(missing, []).append(i)
                    break
                ready = max(ready, *(done[(r, a)] for a in t.after))
            kind = t.kind
            if kind is recv:
                at = arrived.get(t.tag)
                if at is None:
                    on_arrival.setdefault(t.tag, []).append(i)
                    break
                start, end = ready, max(ready, at) + duration(r, t)  # wait, then unpack
            elif kind is send:
                start, end = ready, ready + duration(r, t)
                arrived[t.tag] = end + transfer(r, t)
                waiters = on_arrival.pop(t.tag, None)
                if waiters:
                    wake(waiters)
            elif t.group:
                key = (t.group, coll_count.get((r, t.group), 0))
                seats = meeting.setdefault(key, {})
                if r in seats:  # another stream of this rank holds its seat at this meeting
                    on_meeting.setdefault(key, []).append(i)
                    break
                seats[r] = (i, ready)
                need = seats_of.get(t.group)
                if need is None:
                    need = seats_of[t.group] = sum(1 for g in t.group if g in present)
                if len(seats) < need:
                    break  # the last rank to arrive finishes this task for us
                del meeting[key]
                start = max(at for _, at in seats.values())
                for m, (j, _) in seats.items():
                    coll_count[(m, t.group)] = key[1] + 1
                    if j != i:
                        mt = lanes[j][2][pos[j]]
                        end = start + duration(m, mt)
                        add(_span(m, lanes[j][1], mt, start, end))
                        clock[j] = end
                        pos[j] += 1
                        if awaited:
                            finished(m, mt.name, end)
                        wake([j])
                waiters = on_meeting.pop(key, None)
                if waiters:
                    wake(waiters)
                end = start + duration(r, t)
            else:
                start, end = ready, ready + duration(r, t)
            # `_span`, inlined: these lines run once per task of the step
            sp = new_span(Span)
            set_rank(sp, r)
            set_stream(sp, stream)
            set_task(sp, t)
            set_start(sp, start)
            set_end(sp, end)
            add(sp)
            now = end
            p += 1
            if awaited:
                finished(r, t.name, end)
        pos[i], clock[i] = p, now
    if len(spans) < sum(len(seq) for _, _, seq in lanes):
        raise DeadlockError("deadlock in plan: " + "; ".join(_stuck(plan, lanes, pos)))
    return spans


def _stuck(plan: Plan, lanes: list[tuple[int, str, tuple[Task, ...]]],
           pos: list[int]) -> list[str]:
    """Each unfinished stream and the task it is blocked at, in plan order."""
    streams = {rp.rank: len(rp.streams) for rp in plan.ranks}
    out = []
    for (r, s, seq), p in zip(lanes, pos, strict=True):
        if p < len(seq):
            t = seq[p]
            why = f" (from rank {t.peer})" if t.kind is Kind.RECV else ""
            where = f" on stream {s}" if streams[r] > 1 else ""
            out.append(f"rank {r} at {t.name}{why}{where}")
    return out
