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
    after SplitBackward I<stage>.<mb> and W<stage>.<mb>. Two tasks joined by `+` are an
    *overlapped pair* (DualPipe's F&B): a forward and a backward (B or I) of two different
    stages that run at once, the backward on the device's `pair` lane, so one's
    communication (an all-to-all inside it, its receive) hides behind the other's compute.
    Requires: Split and Replicate done; each task runs on `device` and appears once.
    Rewrites: a temporal edge from every task of one word to every task of the next. An order
    that contradicts the data dependences (or another Order) would make a cycle; that is an
    error naming the cycle and the directives whose edges form it.

        Order(0, "F0.0 F0.1 B0.0 B0.1")
        adds:   F0.0 ~> F0.1 ~> B0.0 ~> B0.1
        Order(0, "F0.1 F0.2+I3.0 W3.0")
        adds:   F0.1 ~> F0.2, F0.1 ~> I3.0, F0.2 ~> W3.0, I3.0 ~> W3.0; pair (F0.2, I3.0)
    """

    device: int
    tasks: str
    phase = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", words(self.tasks))

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        return apply_orders(dag, [(index, self)])

    @property
    def names(self) -> list[str]:
        """Every task name in order; a pair's forward first (it allocates before the
        backward frees, the order that bounds memory from above)."""
        return [n for word in self.words for n in word]

    @property
    def words(self) -> list[tuple[str, ...]]:
        """The words of `tasks`: one task name, or the two of an overlapped pair."""
        return [tuple(sorted(w.split("+"), key=lambda n: n[:1] != "F"))
                for w in self.tasks.split()]

    def chain(self, dag: TrainingDAG, index: int) -> list[tuple[Node, ...]]:
        """The listed words as nodes of replica 0, checked against `dag`."""
        names = self.names
        if len(set(names)) != len(names):
            raise DirectiveError(index, self, "a task appears twice")
        out: list[tuple[Node, ...]] = []
        for word in self.words:
            nodes = tuple(self._node(dag, index, name) for name in word)
            if len(nodes) > 1:
                _check_pair(index, self, nodes)
            out.append(nodes)
        return out

    def _node(self, dag: TrainingDAG, index: int, name: str) -> Node:
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
        return node

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
    pairs = list(dag.pairs)
    try:
        for index, order in orders:
            words = order.chain(dag, index)
            pairs += [w for w in words if len(w) == 2]  # type: ignore[misc]
            for r in dag.replicas:
                for before, after in itertools.pairwise(words):
                    for a, b in itertools.product(before, after):
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
    return dag.with_graph(g, ordered=dag.ordered + tuple(o.device for _, o in orders),
                          pairs=tuple(pairs))


def _check_pair(index: int, order: Order, pair: tuple[Node, ...]) -> None:
    """A pair runs two chunks at once on one device: a forward beside a backward of another
    stage, so they share no parameters whose gradients both would write."""
    names = "+".join(n.name for n in pair)
    if len(pair) != 2:
        raise DirectiveError(index, order, f"{names}: a pair joins exactly two tasks")
    f, b = pair
    if f.kind is not Kind.FWD or b.kind not in (Kind.BWD, Kind.BWD_I):
        raise DirectiveError(index, order, f"{names}: a pair joins a forward (F) and a "
                             "backward (B or I)")
    if f.stage == b.stage:
        raise DirectiveError(index, order, f"{names}: a pair's two tasks must be of "
                             "different stages")


def _raise_cycle(g: nx.DiGraph, index: int, order: Order) -> None:
    cycle = nx.find_cycle(g)
    involved = sorted({g.edges[u, v].get("directive") for u, v in cycle} - {None})
    path = " -> ".join(repr(u) for u, _ in cycle) + f" -> {cycle[0][0]!r}"
    raise DirectiveError(index, order, f"order makes a cycle {path} (Order directives "
                         f"{involved} against the data dependences)")
