"""Split: cut each replica's batch into microbatches."""

from __future__ import annotations

from dataclasses import dataclass, replace

import networkx as nx

from piper.dag import TrainingDAG
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
        per_mb = [n for n in dag.graph.nodes if n.mb >= 0]
        for m in range(self.microbatches):
            g.add_nodes_from(replace(n, mb=m) for n in per_mb)
        for u, v, attrs in dag.graph.edges(data=True):
            for m in range(self.microbatches):
                uu = u if u.mb < 0 else replace(u, mb=m)
                vv = v if v.mb < 0 else replace(v, mb=m)
                g.add_edge(uu, vv, **attrs)
        return dag.with_graph(g, microbatches=self.microbatches)
