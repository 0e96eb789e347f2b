"""The Global Training DAG: chunk and communication nodes over stages, microbatches, replicas.

Nodes are small frozen values (hashable, printable); the graph itself is a networkx DiGraph
whose edges are `data` (a tensor flows) or `temporal` (an `Order` says "after"). A DAG is never
mutated once built: every directive returns a new one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from functools import cached_property

import networkx as nx

from piper.capture import ModelGraph, Value
from piper.errors import PiperError
from piper.sharding import ModelSharding


class Kind(enum.Enum):
    FWD = "F"
    BWD = "B"
    BWD_I = "I"  # backward for input gradients only (after SplitBackward)
    BWD_W = "W"  # backward for weight gradients only (after SplitBackward)
    UPDATE = "U"
    SEND = "SEND"
    RECV = "RECV"
    ALL_REDUCE = "AR"
    ALL_GATHER = "AG"
    REDUCE_SCATTER = "RS"

    @property
    def is_collective(self) -> bool:
        return self in (Kind.ALL_REDUCE, Kind.ALL_GATHER, Kind.REDUCE_SCATTER)

    def __lt__(self, other: Kind) -> bool:  # nodes sort by kind first
        order = list(Kind)
        return order.index(self) < order.index(other)

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FWD, Kind.BWD, Kind.BWD_I, Kind.BWD_W, Kind.UPDATE)

    @property
    def is_chunk(self) -> bool:
        """Runs a stage's forward or (part of its) backward for one microbatch."""
        return self in (Kind.FWD, Kind.BWD, Kind.BWD_I, Kind.BWD_W)

    @property
    def ends_backward(self) -> bool:
        """The task after which a microbatch's weight gradients exist."""
        return self in (Kind.BWD, Kind.BWD_W)

    @property
    def is_p2p(self) -> bool:
        return self in (Kind.SEND, Kind.RECV)


@dataclass(frozen=True, order=True)
class Node:
    """One task of the training step.

    `stage` is the stage whose device runs the node. For P2P nodes `src`/`dst` are the stages
    the message goes between (for gradients `src` is the consumer stage); `grad` marks the
    backward direction. ZeRO collectives: ALL_GATHER with a microbatch materialises the
    stage's parameters for its forward (or, with `grad`, its backward); without one it
    re-gathers them after the update. REDUCE_SCATTER with a microbatch shards that
    microbatch's gradients; without one, the accumulated gradients.
    """

    kind: Kind
    stage: int
    mb: int = -1
    replica: int = 0
    src: int = -1
    dst: int = -1
    grad: bool = False

    def __post_init__(self) -> None:
        # DAG rewrites hash nodes millions of times on big models; hash the fields once.
        object.__setattr__(self, "_hash", hash((self.kind.value, self.stage, self.mb,
                                                self.replica, self.src, self.dst, self.grad)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Node):
            return NotImplemented
        return (self._hash == other._hash and self.kind is other.kind  # type: ignore[attr-defined]
                and self.stage == other.stage and self.mb == other.mb
                and self.replica == other.replica and self.src == other.src
                and self.dst == other.dst and self.grad == other.grad)

    @property
    def name(self) -> str:
        """Short printable name: F0.3, B1.0, U0, AR0, SEND_F0>1.3, RECV_B1>0.2."""
        k = self.kind.value
        if self.kind.is_p2p:
            return f"{k}_{'B' if self.grad else 'F'}{self.src}>{self.dst}.{self.mb}"
        if self.kind is Kind.ALL_REDUCE and self.src >= 0:
            return f"ART{self.src}"  # all-reduce of tied parameters, tie group `src`
        if self.kind in (Kind.UPDATE, Kind.ALL_REDUCE) or self.mb < 0:
            return f"{k}{self.stage}"
        if self.kind is Kind.ALL_GATHER:
            return f"{k}_{'B' if self.grad else 'F'}{self.stage}.{self.mb}"
        return f"{k}{self.stage}.{self.mb}"

    def __repr__(self) -> str:
        return self.name + (f"@r{self.replica}" if self.replica else "")


def parse_task(name: str) -> tuple[Kind, int, int]:
    """`F0.3` -> (FWD, 0, 3); `U1` -> (UPDATE, 1, -1). Raises ValueError on anything else."""
    kinds = {"F": Kind.FWD, "B": Kind.BWD, "I": Kind.BWD_I, "W": Kind.BWD_W, "U": Kind.UPDATE}
    kind = kinds.get(name[:1])
    if kind is None:
        raise ValueError(f"bad task name {name!r}: expected F<stage>.<mb>, B<stage>.<mb>, "
                         "I<stage>.<mb>, W<stage>.<mb>, U<stage>")
    body = name[1:]
    try:
        if kind is Kind.UPDATE:
            return kind, int(body), -1
        s, m = body.split(".")
        return kind, int(s), int(m)
    except ValueError:
        raise ValueError(f"bad task name {name!r}: expected F<stage>.<mb>, B<stage>.<mb>, "
                         "I<stage>.<mb>, W<stage>.<mb>, U<stage>") from None


@dataclass(frozen=True, slots=True)
class Stage:
    """A group of regions executed as one chunk on one pipeline device."""

    index: int
    regions: tuple[str, ...]
    device: int


@dataclass(frozen=True)
class TrainingDAG:
    """The whole training step as a DAG, plus the structure directives have set so far."""

    model: ModelGraph
    stages: tuple[Stage, ...]
    graph: nx.DiGraph = field(compare=False, repr=False)
    microbatches: int = 1
    dp: int = 1
    zero: int = 0
    bucket_bytes: int = 0  # data-parallel all-reduce bucket cap (Replicate.bucket_mb); 0: none
    placement: tuple[tuple[str, int, int], ...] = ()  # (region, stage, device) from Place
    ordered: tuple[int, ...] = ()  # devices an Order has constrained
    streams: tuple[tuple[str, str], ...] = ()  # task kind value -> logical stream (Stream)
    sharding: ModelSharding = field(default_factory=ModelSharding)  # tensor / expert parallelism inside chunks
    recompute: tuple[int, ...] = ()  # stages whose activations are rebuilt in backward
    recompute_policy: str = "full"  # what they keep (`piper.directives.recompute.POLICIES`)
    pairs: tuple[tuple[Node, Node], ...] = ()  # overlapped (forward, backward), replica 0 (Order)
    kept: tuple[int, ...] = ()
    """Replicas whose nodes exist; empty: all. A simulation view (`planner.search.replicas`): data-
    parallel replicas that run alike are simulated once; their collectives keep whole groups."""

    @property
    def pp(self) -> int:
        return 1 + max(s.device for s in self.stages)

    @property
    def ranks(self) -> int:
        """Ranks the DAG's nodes run on; each is `cp * tp` devices running the same tasks."""
        return self.pp * self.dp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sharding.cp * self.sharding.tp

    @property
    def replicas(self) -> tuple[int, ...]:
        """The replicas this DAG holds nodes of (all of them unless `kept` says otherwise)."""
        return kept_replicas(self.kept, self.dp)

    def device_of(self, node: Node) -> int:
        return self.stages[node.stage].device

    def rank_of(self, node: Node) -> int:
        """Megatron-style layout: replicas of one pipeline device are adjacent ranks."""
        return self.device_of(node) * self.dp + node.replica

    def nodes(self, kind: Kind | None = None) -> list[Node]:
        return sorted(n for n in self.graph.nodes if kind is None or n.kind is kind)

    def stage_values(self, src: int, dst: int) -> tuple[Value, ...]:
        """Tensors stage `src` sends to stage `dst` in the forward direction."""
        key = (src, dst)
        memo = self._stage_values
        if key not in memo:  # asked once per P2P node: tens of thousands in a large plan
            of = self._region_stage
            names: list[str] = []
            for f in self.model.flows:
                a, b = self.model.regions[f.src].name, self.model.regions[f.dst].name
                if of.get(a) == src and of.get(b) == dst:
                    names += [v for v in f.values if v not in names]
            values = {v.name: v for v in self.model.values}
            memo[key] = tuple(values[v] for v in names)
        return memo[key]

    def tie_groups(self) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        """Tied parameters grouped by the stages that use them: [(params, stages)].

        A parameter used by several stages lives on each; their gradients are summed by an
        all-reduce among the devices (and replicas) that hold it, after which every copy
        takes the same optimizer step.
        """
        groups: dict[tuple[int, ...], list[str]] = {}
        for param, regions in self.model.tied:
            stages = tuple(sorted({self.stage_of_region(self.model.regions[r].name)
                                   for r in regions}))
            if len(stages) > 1:
                groups.setdefault(stages, []).append(param)
        return [(tuple(ps), st) for st, ps in sorted(groups.items())]

    def stage_of_region(self, region: str) -> int:
        return self._region_stage[region]

    @cached_property
    def _region_stage(self) -> dict[str, int]:
        """Region name -> stage index, built once per DAG (the first stage listing it)."""
        out: dict[str, int] = {}
        for s in self.stages:
            for r in s.regions:
                out.setdefault(r, s.index)
        return out

    @cached_property
    def _stage_values(self) -> dict[tuple[int, int], tuple[Value, ...]]:
        return {}

    def stage_edges(self) -> list[tuple[int, int]]:
        """Forward dataflow between distinct stages."""
        of = {r.index: self.stage_of_region(r.name) for r in self.model.regions}
        return sorted({(of[f.src], of[f.dst]) for f in self.model.flows
                       if of[f.src] != of[f.dst]})

    def with_graph(self, graph: nx.DiGraph, **changes: object) -> TrainingDAG:
        return replace(self, graph=graph, **changes)


def kept_replicas(kept: tuple[int, ...], dp: int) -> tuple[int, ...]:
    """Of `dp` replicas, those `kept` names (all when it names none of them)."""
    return tuple(r for r in kept if r < dp) or tuple(range(dp))


def stage_dag(model: ModelGraph, stages: tuple[Stage, ...],
              placement: tuple[tuple[str, int, int], ...] = ()) -> TrainingDAG:
    """Chunk nodes F/B/U per stage with data edges; SEND/RECV where stages are on two devices."""
    dag = TrainingDAG(model=model, stages=stages, graph=nx.DiGraph(), placement=placement)
    g = dag.graph
    for s in stages:
        f, b, u = Node(Kind.FWD, s.index, 0), Node(Kind.BWD, s.index, 0), Node(Kind.UPDATE, s.index)
        g.add_edge(f, b, kind="data")  # saved activations (and the loss, on the output stage)
        g.add_edge(b, u, kind="data")
    for a, b in dag.stage_edges():
        fa, fb = Node(Kind.FWD, a, 0), Node(Kind.FWD, b, 0)
        ba, bb = Node(Kind.BWD, a, 0), Node(Kind.BWD, b, 0)
        if stages[a].device == stages[b].device:
            g.add_edge(fa, fb, kind="data")
            g.add_edge(bb, ba, kind="data")
            continue
        send, recv = Node(Kind.SEND, a, 0, src=a, dst=b), Node(Kind.RECV, b, 0, src=a, dst=b)
        nx.add_path(g, [fa, send, recv, fb], kind="data")
        if any(v.floating for v in dag.stage_values(a, b)):
            gs = Node(Kind.SEND, b, 0, src=b, dst=a, grad=True)
            gr = Node(Kind.RECV, a, 0, src=b, dst=a, grad=True)
            nx.add_path(g, [bb, gs, gr, ba], kind="data")
    for t, (_, tied_stages) in enumerate(dag.tie_groups()):
        for device in sorted({stages[s].device for s in tied_stages}):
            mine = [s for s in tied_stages if stages[s].device == device]
            art = Node(Kind.ALL_REDUCE, mine[0], src=t)  # the first stage's update applies it
            for s in mine:
                g.add_edge(Node(Kind.BWD, s, 0), art, kind="data")
            g.add_edge(art, Node(Kind.UPDATE, mine[0]), kind="data")
    return dag


def single_device_dag(model: ModelGraph) -> TrainingDAG:
    """The captured model as one stage per region, all on device 0, one microbatch."""
    stages = tuple(Stage(r.index, (r.name,), 0) for r in model.regions)
    return stage_dag(model, stages)


class VerifyError(PiperError):
    pass


def verify(dag: TrainingDAG) -> None:
    """Check the invariants every DAG must hold; raise `VerifyError` listing each violation."""
    problems: list[str] = []
    g = dag.graph
    if not nx.is_directed_acyclic_graph(g):
        cyc = nx.find_cycle(g)
        problems.append("cycle: " + " -> ".join(repr(u) for u, _ in cyc))
    names = [r for s in dag.stages for r in s.regions]
    if sorted(names) != sorted(dag.model.names):
        missing = sorted(set(dag.model.names) - set(names))
        dup = sorted({r for r in names if names.count(r) > 1})
        problems.append(f"stages must cover every region once (missing {missing}, twice {dup})")
    devices = sorted({s.device for s in dag.stages})
    if devices != list(range(len(devices))):
        problems.append(f"devices must be 0..{len(devices) - 1}, got {devices}")
    feeds_update = {n for n in g.nodes if n.kind is Kind.UPDATE}
    frontier = list(feeds_update)
    while frontier:  # one reverse walk from every update at once
        for p in g.predecessors(frontier.pop()):
            if p not in feeds_update:
                feeds_update.add(p)
                frontier.append(p)
    for n in g.nodes:
        if n.kind is Kind.FWD and not any(Node(k, n.stage, n.mb, n.replica) in g
                                          for k in (Kind.BWD, Kind.BWD_I)):
            problems.append(f"{n!r} has no backward")
        if n.kind.ends_backward and n not in feeds_update:
            problems.append(f"{n!r} reaches no update")
        if n.kind is Kind.SEND:
            recvs = [s for s in g.successors(n) if s.kind is Kind.RECV]
            if len(recvs) != 1 or dag.rank_of(recvs[0]) == dag.rank_of(n):
                problems.append(f"{n!r} must feed exactly one RECV on another rank")
    sh = dag.sharding
    if dag.dp % sh.ep_replicas:
        over = f" over tp={sh.tp}" if sh.ep_tp else ""
        problems.append(f"expert parallelism ep={sh.ep}{over} splits data-parallel replicas, "
                        f"so it needs Replicate with a degree divisible by {sh.ep_replicas} "
                        f"(dp={dag.dp})")
    updates = [n for n in g.nodes if n.kind is Kind.UPDATE]
    want = len(dag.stages) * len(dag.replicas)
    if len(updates) != want:
        problems.append(f"expected {want} updates, got {len(updates)}")
    if problems:
        raise VerifyError("invalid DAG: " + "; ".join(problems))
