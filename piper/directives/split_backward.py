"""SplitBackward: separate each backward into input-gradient and weight-gradient halves."""

from __future__ import annotations

from dataclasses import dataclass, replace

import networkx as nx

from piper.dag import Kind, Node, TrainingDAG
from piper.directives.base import Directive
from piper.errors import DirectiveError

_WEIGHT_SIDE = (Kind.UPDATE, Kind.ALL_REDUCE, Kind.REDUCE_SCATTER)


@dataclass(frozen=True, repr=False)
class SplitBackward(Directive):
    """Split every backward B(s, m) into I(s, m) (gradients of the stage's inputs, which the
    previous stage waits for) and W(s, m) (gradients of its weights, which only the update
    needs), so a schedule can run W later to fill pipeline bubbles (zero-bubble schedules).

    Requires: not replicated or ordered yet; not split already. `stages` limits the split to
    those stages (default: all).
    Rewrites: B's inputs feed I; I feeds W; B's edges towards the update (U, AR, RS) leave
    from W, every other edge (gradients to earlier stages) from I.

        before: RECV_B1>0.m -> B0.m -> U0
        after:  RECV_B1>0.m -> I0.m -> W0.m -> U0
    """

    stages: tuple[int, ...] = ()
    phase = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if dag.dp != 1 or dag.ordered:
            raise DirectiveError(index, self, "SplitBackward must come before Replicate and "
                                 "Order")
        if any(n.kind is Kind.BWD_I for n in dag.graph.nodes):
            raise DirectiveError(index, self, "backward is already split")
        bad = [s for s in self.stages if not 0 <= s < len(dag.stages)]
        if bad:
            raise DirectiveError(index, self, f"stages {bad} do not exist ({len(dag.stages)} "
                                 "stages)")
        chosen = set(self.stages or range(len(dag.stages)))

        def split(n: Node) -> bool:
            return n.kind is Kind.BWD and n.stage in chosen

        g = nx.DiGraph()
        g.add_nodes_from(n for n in dag.graph.nodes if not split(n))
        for n in dag.graph.nodes:
            if split(n):
                g.add_edge(replace(n, kind=Kind.BWD_I), replace(n, kind=Kind.BWD_W), kind="data")
        for u, v, attrs in dag.graph.edges(data=True):
            if split(u):
                u = replace(u, kind=Kind.BWD_W if v.kind in _WEIGHT_SIDE else Kind.BWD_I)
            if split(v):
                v = replace(v, kind=Kind.BWD_I)
            g.add_edge(u, v, **attrs)
        return dag.with_graph(g)
