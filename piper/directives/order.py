"""Order: the execution order of chunk tasks on one pipeline device (a schedule's core)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import networkx as nx

from piper.dag import Kind, Node, TrainingDAG, parse_task
from piper.directives.base import Directive, words
from piper.errors import DirectiveError


@dataclass(frozen=True, repr=False)
class Order(Directive):
    """Run `tasks` on pipeline `device` in the given order (on every replica of the device).

    `tasks` is a string of task names separated by spaces: F<stage>.<mb>, B<stage>.<mb>, and
    after SplitBackward I<stage>.<mb> and W<stage>.<mb>.
    Requires: Split and Replicate done; each task runs on `device` and appears once.
    Rewrites: a temporal edge between each consecutive pair. An order that contradicts the
    data dependences (or another Order) would make a cycle; that is an error naming the cycle
    and the directives whose edges form it.

        Order(0, "F0.0 F0.1 B0.0 B0.1")
        adds:   F0.0 ~> F0.1 ~> B0.0 ~> B0.1
    """

    device: int
    tasks: str
    phase = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", words(self.tasks))

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        names = self.tasks.split()
        if len(set(names)) != len(names):
            raise DirectiveError(index, self, "a task appears twice")
        nodes: list[Node] = []
        for name in names:
            try:
                kind, stage, mb = parse_task(name)
            except ValueError as e:
                raise DirectiveError(index, self, str(e)) from None
            node = Node(kind, stage, mb)
            if node not in dag.graph:
                raise DirectiveError(index, self, f"task {name} does not exist "
                                     f"({len(dag.stages)} stages, {dag.microbatches} "
                                     "microbatches)")
            if dag.device_of(node) != self.device:
                raise DirectiveError(index, self, f"task {name} runs on device "
                                     f"{dag.device_of(node)}, not {self.device}")
            if kind is Kind.UPDATE:
                raise DirectiveError(index, self, "updates are placed by the scheduler; "
                                     "list only F and B tasks")
            nodes.append(node)
        g = dag.graph.copy()
        for r in range(dag.dp):
            for a, b in itertools.pairwise(nodes):
                a, b = Node(a.kind, a.stage, a.mb, r), Node(b.kind, b.stage, b.mb, r)
                if not g.has_edge(a, b):
                    g.add_edge(a, b, kind="temporal", directive=index)
        if nx.is_directed_acyclic_graph(g):
            return dag.with_graph(g, ordered=dag.ordered + (self.device,))
        cycle = nx.find_cycle(g)
        involved = sorted({g.edges[u, v].get("directive") for u, v in cycle} - {None})
        path = " -> ".join(repr(u) for u, _ in cycle) + f" -> {cycle[0][0]!r}"
        raise DirectiveError(index, self, f"order makes a cycle {path} (Order directives "
                             f"{involved} against the data dependences)")

    def _fmt(self, name: str, value: object) -> str:
        return repr(value)
