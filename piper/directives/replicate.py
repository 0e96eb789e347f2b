"""Replicate: data parallelism over copies of the whole pipeline."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace

import networkx as nx

from piper.dag import Kind, Node, TrainingDAG
from piper.directives.base import Directive
from piper.errors import DirectiveError


@dataclass(frozen=True, repr=False)
class Replicate(Directive):
    """Run `degree` data-parallel replicas; each takes 1/degree of every step's batch.

    Requires: not replicated yet, no Order yet, degree >= 1. `zero` picks the ZeRO stage;
    this build implements ZeRO-0 (plain gradient all-reduce).
    Rewrites: every node is copied per replica r (replica field r); on each replica the edges
    B(s, *) -> U(s) are cut by one ALL_REDUCE node AR(s) whose group is the stage's replicas.

        before: B0.0 -> U0,  B0.1 -> U0
        Replicate(2)
        after:  B0.0@r -> AR0@r -> U0@r,  B0.1@r -> AR0@r      for r in 0, 1
    """

    degree: int
    _: KW_ONLY
    zero: int = 0
    phase = 2

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if not isinstance(self.degree, int) or self.degree < 1:
            raise DirectiveError(index, self, "degree must be an int >= 1")
        if self.zero != 0:
            raise DirectiveError(index, self, f"ZeRO-{self.zero} is not implemented yet; "
                                 "use zero=0")
        if dag.dp != 1 or dag.ordered:
            raise DirectiveError(index, self, "Replicate must come once, before Order")
        g = nx.DiGraph()
        for r in range(self.degree):
            for u, v, attrs in dag.graph.edges(data=True):
                uu, vv = replace(u, replica=r), replace(v, replica=r)
                if uu.kind is Kind.BWD and vv.kind is Kind.UPDATE:
                    ar = Node(Kind.ALL_REDUCE, u.stage, replica=r)
                    g.add_edge(uu, ar, kind="data")
                    g.add_edge(ar, vv, kind="data")
                else:
                    g.add_edge(uu, vv, **attrs)
        return dag.with_graph(g, dp=self.degree, zero=self.zero)
