"""Replicate: data parallelism over copies of the whole pipeline, with ZeRO 0-3."""

from __future__ import annotations

import itertools
from dataclasses import KW_ONLY, dataclass

import networkx as nx

from piper.dag import Kind, Node, TrainingDAG, kept_replicas
from piper.directives.base import Directive
from piper.errors import DirectiveError


@dataclass(frozen=True, repr=False)
class Replicate(Directive):
    """Run `degree` data-parallel replicas; each takes 1/degree of every step's batch.

    Requires: not replicated yet, no Order yet, degree >= 1, zero in 0..3.
    Rewrites: every node is copied per replica r. Then, per stage s and replica, the edges
    B(s, m) -> U(s) are cut by the collectives of the ZeRO stage, whose group is the stage's
    replicas:

        zero=0  B(s,m) -> AR(s) -> U(s)                    all-reduce the gradients
        zero=1  B(s,m) -> RS(s) -> U(s) -> AG(s)           optimizer state sharded: reduce-
                                                           scatter once, update the shard,
                                                           all-gather the parameters
        zero=2  B(s,m) -> RS(s,m) -> U(s) -> AG(s)         + gradients sharded per microbatch
        zero=3  AG_F(s,m) -> F(s,m),  AG_B(s,m) -> B(s,m)  + parameters sharded: gathered
                B(s,m) -> RS(s,m) -> U(s)                    before every chunk, freed after

    With SplitBackward, W(s,m) takes B's place before the reduce-scatter, and ZeRO-3 gathers
    only before I: AG_B(s,m) -> I(s,m) -> W(s,m) -> RS(s,m). W reads no parameters (it
    multiplies what I kept: each matmul's input and output gradient, see
    `runtime.execute.weight_grad`), so the parameters are freed right after I.

    ZeRO-2 and -3 act per microbatch, so they compose with any pipeline schedule.

    `bucket_mb` (DDP's `bucket_cap_mb`; None: one collective per stage). With zero=0, AR(s)
    moves the stage's gradients as several all-reduces of at most that many MiB, in reverse
    parameter order. When AR(s) is on the compute stream and the stage's backward is not
    split, each bucket starts from inside the stage's last backward as soon as its
    gradients are final, so the all-reduce overlaps the rest of that backward
    (`runtime.execute.buckets`). With ZeRO-1/2/3 the stage is sharded in units of those buckets
    (FSDP's units; without a cap the whole stage is one), each gathered and reduce-scattered
    on its own; ZeRO-2/3 then start each unit's reduce-scatter from inside every backward
    under the same conditions (every data-parallel collective on the compute stream), so a
    microbatch's unsharded gradient never lives whole (`runtime.execute.zero`).
    """

    degree: int
    _: KW_ONLY
    zero: int = 0
    bucket_mb: float | None = None
    phase = 3

    @property
    def bucket_bytes(self) -> int:
        """`bucket_mb` in bytes (0: one collective per stage), as Plans carry it."""
        b = self.bucket_mb
        return 0 if b is None else max(1, round(b * 2**20))

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if not isinstance(self.degree, int) or self.degree < 1:
            raise DirectiveError(index, self, "degree must be an int >= 1")
        if self.zero not in (0, 1, 2, 3):
            raise DirectiveError(index, self, f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        b = self.bucket_mb
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float))
                              or not b > 0):
            raise DirectiveError(index, self, f"bucket_mb must be a number > 0 or None, "
                                 f"got {b!r}")
        if dag.dp != 1 or dag.ordered:
            raise DirectiveError(index, self, "Replicate must come once, before Order")
        g = nx.DiGraph()
        edges = list(dag.graph.edges(data=True))
        for r in kept_replicas(dag.kept, self.degree):
            copy = {n: Node(n.kind, n.stage, n.mb, r, n.src, n.dst, n.grad)
                    for n in dag.graph.nodes}
            before = len(g)
            for u, v, attrs in edges:
                uu, vv = copy[u], copy[v]
                if uu.kind.ends_backward and vv.kind is Kind.UPDATE:
                    nx.add_path(g, [uu, *self._between(uu), vv], kind="data")
                else:
                    g.add_edge(uu, vv, **attrs)
            # this replica's nodes are exactly those just added (a scan of all is O(dp^2))
            for n in list(itertools.islice(g.nodes, before, None)):
                if self.zero == 3 and n.kind in (Kind.FWD, Kind.BWD, Kind.BWD_I):
                    ag = Node(Kind.ALL_GATHER, n.stage, n.mb, r, grad=n.kind is not Kind.FWD)
                    g.add_edge(ag, n, kind="data")
                if self.zero in (1, 2) and n.kind is Kind.UPDATE:
                    g.add_edge(n, Node(Kind.ALL_GATHER, n.stage, replica=r), kind="data")
        return dag.with_graph(g, dp=self.degree, zero=self.zero,
                              bucket_bytes=self.bucket_bytes)

    def _between(self, b: Node) -> list[Node]:
        if self.zero == 0:
            return [Node(Kind.ALL_REDUCE, b.stage, replica=b.replica)]
        if self.zero == 1:
            return [Node(Kind.REDUCE_SCATTER, b.stage, replica=b.replica)]
        return [Node(Kind.REDUCE_SCATTER, b.stage, b.mb, b.replica)]
