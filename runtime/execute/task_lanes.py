"""What a rank's task lists say beyond their order, worked out once per plan: the units of
the pair lane (an overlapped pair's backward with its receives and sends, run under the pair's
forward) and, per chunk task, the receives to post ahead so inputs travel meanwhile."""

from __future__ import annotations

from piper.dag import Kind
from runtime.lowering.plan import PAIR_STREAM, RankPlan, Task


def pair_units(rp: RankPlan) -> dict[str, list[tuple[int, Task]]]:
    """Forward task name -> the pair lane's tasks (position, task) that run under it:
    receives, the paired backward, its sends."""
    units: dict[str, list[tuple[int, Task]]] = {}
    unit: list[tuple[int, Task]] = []
    for j, t in enumerate(rp.stream(PAIR_STREAM)):
        if unit and t.kind is not Kind.SEND and any(u.pair for _, u in unit):
            unit = []
        unit.append((j, t))
        if t.pair:
            units[t.pair] = unit
    return units


def lookahead_receives(rp: RankPlan) -> dict[str, dict[int, list[Task]]]:
    """Per lane (a stream that runs chunks), per chunk task's position: the receives that
    feed the lane's next two chunks."""
    out: dict[str, dict[int, list[Task]]] = {}
    for name, tasks in rp.streams:
        chunks = [i for i, t in enumerate(tasks) if t.kind.is_chunk]
        ahead = out[name] = {}
        for a, b in zip(chunks, chunks[1:] + [len(tasks)]):
            nxt = next((c for c in chunks if c > b), len(tasks))
            ahead[a] = [t for t in tasks[a + 1:nxt] if t.kind is Kind.RECV]
    return out
