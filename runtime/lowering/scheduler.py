"""Scheduler: lower a distributed TrainingDAG into a Plan, then prove it deadlock-free.

Passes, in order:
1. `compute_order`  — one global topological order of all nodes (data + temporal edges),
   ties broken GPipe-style; each rank's chunk tasks are its projection, so every cross-rank
   path is respected.
2. comm placement   — (in `schedule`) SEND right after its producer, RECV and ZeRO-3's ALL_GATHER right
   before their consumer, ALL_REDUCE / REDUCE_SCATTER right after the last backward they
   need; then the tied-parameter all-reduces (they span pipeline devices, so waiting
   earlier could stall a peer), then UPDATE, each followed by its parameter ALL_GATHER.
3. `dry_run`        — execute the Plan with blocking semantics; raises on deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import networkx as nx

from piper.dag import Kind, Node, TrainingDAG
from piper.errors import PiperError
from runtime.lowering.dryrun import dry_run
from runtime.lowering.plan import COMPUTE_STREAM, PAIR_STREAM, Plan, RankPlan, Task


def _priority(n: Node) -> tuple:
    phase = {Kind.FWD: 0, Kind.BWD: 1, Kind.BWD_I: 1, Kind.BWD_W: 1}.get(n.kind, 2)
    stage = n.stage if phase != 1 else -n.stage
    return (phase, n.mb, stage, n.kind.value, n.src, n.dst, n.replica)


def compute_order(dag: TrainingDAG) -> list[Node]:
    try:
        return list(nx.lexicographical_topological_sort(dag.graph, key=_priority))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(dag.graph)
        raise PiperError("cannot schedule: cycle " + " -> ".join(repr(u) for u, _ in cycle))


def schedule(dag: TrainingDAG, *, check: bool = True) -> Plan:
    """The Plan for `dag`; with `check`, a dry run proves it free of deadlock."""
    order = compute_order(dag)
    g = dag.graph
    tags = _tags(dag)
    group_of = {s.index: tuple(s.device * dag.dp + r for r in range(dag.dp)) for s in dag.stages}
    ties = dag.tie_groups()
    # every rank holding a copy: the tied stages' devices, each with all its replicas
    tie_group = [tuple(sorted({dag.stages[s].device * dag.dp + r for s in stages
                               for r in range(dag.dp)}))
                 for _, stages in ties]

    def task(n: Node) -> Task:
        if n.kind.is_p2p:
            peer_node = next(iter(g.successors(n) if n.kind is Kind.SEND else g.predecessors(n)))
            values = tuple(v.name for v in _forward_values(dag, n)
                           if v.floating or not n.grad)
            return Task(n.kind, n.stage, n.mb, peer=dag.rank_of(peer_node), values=values,
                        grad=n.grad, tag=tags[(n.src, n.dst, n.grad, n.mb, n.replica)],
                        name=n.name)
        if n.kind is Kind.ALL_REDUCE and n.src >= 0:
            return Task(n.kind, n.stage, values=ties[n.src][0], group=tie_group[n.src],
                        tag=n.src, name=n.name)
        if n.kind.is_collective:
            return Task(n.kind, n.stage, n.mb, grad=n.grad, group=group_of[n.stage],
                        name=n.name)
        return Task(n.kind, n.stage, n.mb, name=n.name)

    # each overlapped pair, on every replica, by either member: (forward, backward); the
    # backward runs on PAIR_STREAM
    pair_of = {n: p for f, b in dag.pairs for r in dag.replicas
               for p in [(Node(f.kind, f.stage, f.mb, r), Node(b.kind, b.stage, b.mb, r))]
               for n in p}
    # the ranks of the replicas the DAG holds (all, unless it is a simulation view)
    held = sorted(d * dag.dp + r for d in range(dag.pp) for r in dag.replicas)
    by_rank: dict[int, list[Node]] = {rank: [] for rank in held}
    for n in order:  # one pass, not one per rank: large plans have ~100 ranks x 10^4 nodes
        by_rank[dag.rank_of(n)].append(n)
    ranks = []
    for rank in held:
        mine = by_rank[rank]
        chunks = [n for n in mine if n.kind.is_chunk]
        seq: list[Node] = []
        placed: set[Node] = set()

        def add(nodes: list[Node], seq: list[Node] = seq, placed: set[Node] = placed) -> None:
            seq.extend(nodes)
            placed.update(nodes)

        for c in chunks:
            if c in placed:
                continue  # the other task of a pair, placed with the first
            unit = list(pair_of.get(c, (c,)))  # an overlapped pair at once
            add(sorted(p for u in unit for p in g.predecessors(u)
                       if p.kind in (Kind.RECV, Kind.ALL_GATHER)))
            add(unit)
            add(sorted(s for u in unit for s in g.successors(u) if s.kind is Kind.SEND))
            for u in unit:
                if u.kind.ends_backward:
                    add(sorted(s for s in g.successors(u) if s.kind.is_collective
                               and s.src < 0 and all(p in placed for p in g.predecessors(s))))
        # tied-parameter all-reduces span pipeline devices: only once all chunks are done
        add(sorted(n for n in mine if n.kind is Kind.ALL_REDUCE and n.src >= 0))
        for u in sorted(n for n in mine if n.kind is Kind.UPDATE):
            add([u])
            add(sorted(s for s in g.successors(u) if s.kind is Kind.ALL_GATHER))
        missing = set(mine) - set(seq)
        if missing:
            raise PiperError(f"scheduler left tasks unplaced on rank {rank}: {sorted(missing)}")
        device, replica = divmod(rank, dag.dp)
        stages = tuple(s.index for s in dag.stages if s.device == device)
        ranks.append(RankPlan(rank, device, replica, stages,
                              _streams(dag, seq, task, {b: f for f, b in pair_of.values()})))
    out = dag.stage_of_region(dag.model.regions[dag.model.output_region].name)
    plan = Plan(
        model=dag.model,
        stage_regions=tuple(s.regions for s in dag.stages),
        stage_device=tuple(s.device for s in dag.stages),
        output_stage=out,
        pp=dag.pp,
        dp=dag.dp,
        microbatches=dag.microbatches,
        zero=dag.zero,
        bucket_bytes=dag.bucket_bytes,
        ranks=tuple(ranks),
        groups=tuple(sorted({t.group for rp in ranks for t in rp.tasks if t.group})),
        ties=tuple(ties),
        sharding=dag.sharding,
        recompute=dag.recompute,
        recompute_policy=dag.recompute_policy,
    )
    if check:
        dry_run(plan)
    return plan


def _streams(dag: TrainingDAG, seq: list[Node], task: Callable[[Node], Task],
             paired: dict[Node, Node]) -> tuple[tuple[str, tuple[Task, ...]], ...]:
    """Split one rank's order by logical stream; an edge from another stream of the same
    rank becomes a wait (`Task.after`). With one stream nothing changes. The backward of an
    overlapped pair (`paired`: backward -> forward) runs on PAIR_STREAM, with its own sends
    and receives (unless a Stream directive put those elsewhere), so it waits for its input
    while its forward computes."""
    stream_of = dict(dag.streams)
    where = {n: stream_of.get(n.kind.value, COMPUTE_STREAM) for n in seq}
    g = dag.graph
    for b in paired.keys() & where.keys():
        where[b] = PAIR_STREAM
        for n in (*g.predecessors(b), *g.successors(b)):
            if n.kind.is_p2p and where.get(n) == COMPUTE_STREAM:
                where[n] = PAIR_STREAM
    rank_of = dag.rank_of
    out: dict[str, list[Task]] = {COMPUTE_STREAM: []}
    for n in seq:
        t = task(n)
        after = sorted(p.name for p in dag.graph.predecessors(n)
                       if p in where and where[p] != where[n] and rank_of(p) == rank_of(n))
        if after:
            t = replace(t, after=tuple(after))
        if n in paired:
            t = replace(t, pair=paired[n].name)
        out.setdefault(where[n], []).append(t)
    streams_of_group: dict[tuple[int, ...], set[str]] = {}
    for s, ts in out.items():
        for t in ts:
            if t.group:
                streams_of_group.setdefault(t.group, set()).add(s)
    for group, names in streams_of_group.items():
        if len(names) > 1:  # two threads would interleave one communicator's collectives
            raise PiperError(f"collectives of group {list(group)} are split over streams "
                             f"{sorted(names)}; put them all on one stream")
    return tuple((s, tuple(ts)) for s, ts in out.items())


def _tags(dag: TrainingDAG) -> dict[tuple, int]:
    """A distinct tag range per P2P message so messages never match the wrong receive."""
    tags, nxt = {}, 0
    for n in dag.nodes(Kind.SEND):
        tags[(n.src, n.dst, n.grad, n.mb, n.replica)] = nxt
        nxt += len(_forward_values(dag, n)) + 1
    return tags


def _forward_values(dag: TrainingDAG, n: Node) -> tuple:
    """The tensors of the forward edge a P2P node serves (gradients flow against it)."""
    return dag.stage_values(n.dst, n.src) if n.grad else dag.stage_values(n.src, n.dst)
