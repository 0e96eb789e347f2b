"""Contention: how much longer a compute task takes because of what runs beside it.

Three effects, the first two each priced by one `ClusterSpec` figure:

- `cores_per_node`: CPU ranks of one node share its cores. While k compute tasks of the node's
  ranks run at once, each gets min(1, cores / k) of its speed (processor sharing).
- `comm_compute_contention` (c): a compute task slows by c over the share of its time that a
  collective of its own rank runs on another stream (copies and reduction kernels take part
  of the device); `inter_node_contention` instead for a collective with one rank per node,
  which the NICs carry (Calculon: 15% for NVLink, 2% for InfiniBand).
- Without `cores_per_node` (one accelerator per rank), compute tasks of one rank that run at
  once (a forward beside its paired backward) share the device the same way.

All depend on the timeline, which depends on the stretched durations, so `timeline` iterates
timeline -> stretch factors -> timeline to a fixed point (damped; a few rounds suffice).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from cost_models.cluster import ClusterSpec
from cost_models.comm import contention as comm_contention
from runtime.lowering.dryrun import Span, dry_run
from runtime.lowering.plan import Plan, Task

ROUNDS = 8
TOLERANCE = 0.005

Key = tuple[int, str]  # (rank, task name)


def active(cluster: ClusterSpec) -> bool:
    """Whether `cluster` has any contention to price (GPU catalog entries have none)."""
    return (cluster.cores_per_node is not None or cluster.comm_compute_contention > 0
            or cluster.inter_node_contention > 0)


def timeline(plan: Plan, duration: Callable[[int, Task], float],
             transfer: Callable[[int, Task], float], cluster: ClusterSpec) -> list[Span]:
    """`dry_run` with compute durations stretched by contention, at its fixed point."""
    spans = dry_run(plan, duration, transfer)
    if not active(cluster) and not plan.paired:
        return spans
    factor: dict[Key, float] = {}
    for k in range(ROUNDS):
        target = stretch(spans, cluster)
        # first round: jump to the first estimate; then halve each change (no oscillation)
        new = target if k == 0 else {key: (factor.get(key, 1.0) + f) / 2
                                     for key, f in target.items()}
        change = max((abs(new.get(key, 1.0) - factor.get(key, 1.0))
                      for key in new.keys() | factor.keys()), default=0.0)
        factor = new

        def stretched(r: int, t: Task, _f: dict[Key, float] = factor) -> float:
            return duration(r, t) * _f.get((r, t.name), 1.0)

        spans = dry_run(plan, stretched, transfer)
        if change < TOLERANCE:
            break
    return spans


def stretch(spans: Sequence[Span], cluster: ClusterSpec) -> dict[Key, float]:
    """Per compute task, the factor (>= 1) its duration stretches by on this timeline."""
    compute = [s for s in spans if s.task.kind.is_compute and s.end > s.start]
    out = {(s.rank, s.task.name): 1.0 for s in compute}
    if cluster.cores_per_node is not None:
        cores = cluster.cores_per_node
        by_node: dict[int, list[Span]] = {}
        for s in compute:
            by_node.setdefault(cluster.node_of(s.rank), []).append(s)
        for node_spans in by_node.values():
            level = _Occupancy(node_spans)
            for s in node_spans:
                out[(s.rank, s.task.name)] *= max(1.0, level.mean(s.start, s.end) / cores)
    else:  # one device per rank: the two lanes of overlapped pairs share it
        by_rank: dict[int, list[Span]] = {}
        for s in compute:
            by_rank.setdefault(s.rank, []).append(s)
        for rank_spans in by_rank.values():
            if len({s.stream for s in rank_spans}) > 1:
                level = _Occupancy(rank_spans)
                for s in rank_spans:
                    out[(s.rank, s.task.name)] *= max(1.0, level.mean(s.start, s.end))
    if cluster.comm_compute_contention > 0 or cluster.inter_node_contention > 0:
        comm: dict[int, list[Span]] = {}
        for s in spans:
            if s.task.kind.is_collective:
                comm.setdefault(s.rank, []).append(s)
        for s in compute:
            mine = [o for o in comm.get(s.rank, ()) if o.stream != s.stream]
            lost = sum(comm_contention(cluster, o.task.group)
                       * max(0.0, min(s.end, o.end) - max(s.start, o.start)) for o in mine)
            most = max(cluster.comm_compute_contention, cluster.inter_node_contention)
            out[(s.rank, s.task.name)] *= 1 + min(lost / (s.end - s.start), most)
    return out


class _Occupancy:
    """How many of `spans` run at each instant, and its mean over an interval."""

    def __init__(self, spans: Sequence[Span]) -> None:
        edges: dict[float, int] = {}
        for s in spans:
            edges[s.start] = edges.get(s.start, 0) + 1
            edges[s.end] = edges.get(s.end, 0) - 1
        self.times = sorted(edges)
        self.level: list[int] = []  # running tasks on [times[i], times[i+1])
        self.area = [0.0]  # integral of the level from times[0] to times[i]
        n = 0
        for i, t in enumerate(self.times):
            n += edges[t]
            self.level.append(n)
            if i + 1 < len(self.times):
                self.area.append(self.area[-1] + n * (self.times[i + 1] - t))

    def _integral(self, t: float) -> float:
        i = bisect.bisect_right(self.times, t) - 1
        if i < 0:
            return 0.0
        return self.area[i] + self.level[i] * (t - self.times[i])

    def mean(self, a: float, b: float) -> float:
        return (self._integral(b) - self._integral(a)) / (b - a)
