"""Split: cut each replica's batch into microbatches."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from piper.dag import Node, TrainingDAG
from piper.directives.base import Directive
from piper.errors import DirectiveError


@dataclass(frozen=True, repr=False)
class Split(Directive):
    """Split every replica's share of the batch into `microbatches` equal microbatches.

    Requires: placement done, not split or replicated yet, microbatches >= 1.
    Rewrites: every per-microbatch node (F, B, SEND, RECV) becomes `microbatches` copies with the
    same edges among copies of one microbatch; every copy of B feeds the stage's single U
    (gradients accumulate across microbatches).

        before: F0.0 -> F1.0 -> B1.0 -> B0.0 -> U0
        Split(2)
        after:  F0.0 -> F1.0 -> B1.0 -> B0.0 -> U0   and   F0.1 -> F1.1 -> B1.1 -> B0.1 -> U0
    """

    microbatches: int
    phase = 1

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise DirectiveError(index, self, "microbatches must be an int >= 1")
        if dag.microbatches != 1 or dag.dp != 1 or dag.ordered:
            raise DirectiveError(index, self, "Split must come once, before Replicate and Order")
        g = nx.DiGraph()
        k = self.microbatches
        # each node's k copies, made once (an edge per microbatch reuses them)
        copies = {n: [Node(n.kind, n.stage, m, n.replica, n.src, n.dst, n.grad)
                      for m in range(k)] if n.mb >= 0 else [n] * k
                  for n in dag.graph.nodes}
        for m in range(k):
            g.add_nodes_from(c[m] for n, c in copies.items() if n.mb >= 0)
        g.add_edges_from((copies[u][m], copies[v][m], attrs)
                         for u, v, attrs in dag.graph.edges(data=True) for m in range(k))
        return dag.with_graph(g, microbatches=self.microbatches)
