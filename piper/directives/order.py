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
        return apply_orders(dag, [(index, self)])

    def chain(self, dag: TrainingDAG, index: int) -> list[Node]:
        """The listed tasks as nodes of replica 0, checked against `dag`."""
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
        return nodes

    def _fmt(self, name: str, value: object) -> str:
        return repr(value)


def apply_orders(dag: TrainingDAG, orders: list[tuple[int, Order]]) -> TrainingDAG:
    """Apply consecutive Orders (`(index, Order)` pairs) as one rewrite.

    Same result as applying them one by one, but the graph is copied and checked for cycles
    once rather than once per device — on a plan with 10^4-10^5 nodes that is most of the
    cost of applying a Program. A cycle is then traced back by replaying them one at a time,
    so the error names the first Order that closes it, as before.
    """
    g = dag.graph.copy()
    try:
        for index, order in orders:
            nodes = order.chain(dag, index)
            for r in range(dag.dp):
                for a, b in itertools.pairwise(nodes):
                    a, b = Node(a.kind, a.stage, a.mb, r), Node(b.kind, b.stage, b.mb, r)
                    if not g.has_edge(a, b):
                        g.add_edge(a, b, kind="temporal", directive=index)
    except DirectiveError:
        if len(orders) == 1:
            raise
        acyclic = False  # an earlier Order's cycle is the first error: replay to find it
    else:
        acyclic = nx.is_directed_acyclic_graph(g)
    if not acyclic:
        if len(orders) == 1:
            _raise_cycle(g, *orders[0])
        for index, order in orders:
            dag = apply_orders(dag, [(index, order)])
    return dag.with_graph(g, ordered=dag.ordered + tuple(o.device for _, o in orders))


def _raise_cycle(g: nx.DiGraph, index: int, order: Order) -> None:
    cycle = nx.find_cycle(g)
    involved = sorted({g.edges[u, v].get("directive") for u, v in cycle} - {None})
    path = " -> ".join(repr(u) for u, _ in cycle) + f" -> {cycle[0][0]!r}"
    raise DirectiveError(index, order, f"order makes a cycle {path} (Order directives "
                         f"{involved} against the data dependences)")
