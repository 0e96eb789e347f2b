"""Communication costs: the alpha-beta model for P2P and collectives over a two-level topology.

alpha is a message's fixed latency (s), beta a link's bandwidth (bytes/s). The formulas are the
standard ones (Thakur, Rabenseifner & Gropp 2005; NCCL's ring and tree): pure functions of
numbers so they can be checked by hand and reused by fitted models.

Inside a node, a cluster with measured nccl-tests curves (`ClusterSpec.intra_node_busbw`)
prices a collective at the bus bandwidth measured for its message size instead: nccl-tests
define busbw so that a ring all-reduce of n bytes over p ranks takes 2(p-1)/p n / busbw and an
all-gather or reduce-scatter (p-1)/p n / busbw, and the measured curve carries the latency
floor and the slow ramp to full speed (A100 NVLink3: 18 GB/s at 1 MB, 106 at 16 MB, 194 at
256 MB) that an alpha-beta link with the nominal bandwidth does not.

Topology: ranks fill nodes in order (`ClusterSpec.node_of`). A group inside one node runs on
the intra-node fabric; a group across nodes either runs flat at the pace of its slowest
(inter-node) hop, or hierarchically — inside each node, then across nodes with one rank per
node, then inside again — whichever is cheaper, as NCCL picks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

from cost_models.cluster import AlphaBeta, ClusterSpec

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)


def p2p_time(nbytes: float, *, latency: float, bandwidth: float) -> float:
    """One message: alpha + n / beta."""
    return latency + nbytes / bandwidth


def ring_all_reduce_time(nbytes: float, ranks: int, *, latency: float,
                         bandwidth: float) -> float:
    """Ring all-reduce of n bytes over p ranks: 2(p-1) alpha + 2(p-1)/p * n / beta.

    A reduce-scatter then an all-gather, each p-1 steps moving n/p bytes per rank.
    """
    if ranks <= 1:
        return 0.0
    p = ranks
    return 2 * (p - 1) * latency + 2 * (p - 1) / p * nbytes / bandwidth


def ring_all_gather_time(nbytes: float, ranks: int, *, latency: float,
                         bandwidth: float) -> float:
    """Ring all-gather (or reduce-scatter) of an n-byte result over p ranks:
    (p-1) alpha + (p-1)/p * n / beta — half an all-reduce."""
    if ranks <= 1:
        return 0.0
    p = ranks
    return (p - 1) * latency + (p - 1) / p * nbytes / bandwidth


def tree_all_reduce_time(nbytes: float, ranks: int, *, latency: float,
                         bandwidth: float) -> float:
    """Binomial-tree reduce then broadcast: 2 ceil(log2 p) (alpha + n / beta).

    Logarithmic in latency, so it beats the ring for small messages over many ranks; the
    ring's bandwidth term is p/(p-1) log2 p times smaller, so it wins for large ones.
    """
    if ranks <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(ranks)) * (latency + nbytes / bandwidth)


def all_reduce_time(nbytes: float, ranks: int, *, latency: float, bandwidth: float) -> float:
    """The cheaper of ring and tree all-reduce on one kind of link."""
    return min(ring_all_reduce_time(nbytes, ranks, latency=latency, bandwidth=bandwidth),
               tree_all_reduce_time(nbytes, ranks, latency=latency, bandwidth=bandwidth))


def link(cluster: ClusterSpec, ranks: Iterable[int]) -> tuple[float, float]:
    """(latency, bandwidth) of the slowest link `ranks` span: inter-node once two nodes are in.

    A ring runs at the pace of its slowest hop, so one cross-node pair makes the whole
    collective inter-node.
    """
    nodes = {cluster.node_of(r) for r in ranks}
    if len(nodes) > 1:
        return cluster.inter_node_latency, cluster.inter_node_bandwidth
    return cluster.intra_node_latency, cluster.intra_node_bandwidth


def layout(cluster: ClusterSpec, ranks: Iterable[int]) -> tuple[int, int]:
    """(nodes the group spans, most group ranks on one of them)."""
    return _layout(cluster.gpus_per_node, tuple(ranks))


@functools.lru_cache(maxsize=4096)
def _layout(gpus_per_node: int, ranks: tuple[int, ...]) -> tuple[int, int]:
    # memoised: a simulated step asks once per collective (and bucket), of a few groups
    # of up to thousands of ranks
    per: dict[int, int] = {}
    for r in ranks:
        n = r // gpus_per_node  # `ClusterSpec.node_of`
        per[n] = per.get(n, 0) + 1
    return len(per), max(per.values(), default=0)


def contention(cluster: ClusterSpec, group: Sequence[int]) -> float:
    """Share of compute lost while a collective of `group` runs beside it: the network's
    (`inter_node_contention`) where the group has one rank per node, so the NICs carry it,
    else NVLink's (`comm_compute_contention`)."""
    nodes, per_node = layout(cluster, group)
    return (cluster.inter_node_contention if nodes > 1 and per_node == 1
            else cluster.comm_compute_contention)


def p2p_message_time(cluster: ClusterSpec, src: int, dst: int, nbytes: float) -> float:
    """A message between two ranks: the fitted intra-node P2P figures when the cluster has
    them and both ranks share a node, else the link the pair spans."""
    if cluster.p2p is not None and cluster.node_of(src) == cluster.node_of(dst):
        return p2p_time(nbytes, latency=cluster.p2p.latency, bandwidth=cluster.p2p.bandwidth)
    lat, bw = link(cluster, (src, dst))
    return p2p_time(nbytes, latency=lat, bandwidth=bw)


def collective_time(kind: str, nbytes: float, group: Sequence[int],
                    cluster: ClusterSpec) -> float:
    """Seconds of one collective of `kind` over `group`; `nbytes` is the full tensor (the
    all-reduced buffer, the gathered result, the scattered input)."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")
    p = len(group)
    if p <= 1:
        return 0.0
    nodes, per_node = layout(cluster, group)
    if nodes == 1:
        return in_node_time(kind, nbytes, p, cluster)
    inter = (cluster.inter_node_latency, cluster.inter_node_bandwidth)
    flat = _on_one_link(kind, nbytes, p, *inter)
    if per_node <= 1:
        return flat
    return min(flat, _hierarchical(kind, nbytes, nodes, per_node, cluster))


def _intra(cluster: ClusterSpec, kind: str) -> tuple[float, float, bool]:
    """(latency, bandwidth, fitted) inside a node for `kind`."""
    fitted: AlphaBeta | None = getattr(cluster, kind)
    if fitted is not None:
        return fitted.latency, fitted.bandwidth, True
    return cluster.intra_node_latency, cluster.intra_node_bandwidth, False


def in_node_time(kind: str, nbytes: float, p: int, cluster: ClusterSpec) -> float:
    """A collective over `p` ranks of one node: on the measured bus-bandwidth curve where
    the cluster has one (and no fitted figure for `kind`), else on the alpha-beta link."""
    if p <= 1:
        return 0.0
    if cluster.intra_node_busbw and getattr(cluster, kind) is None:
        share = (p - 1) / p * (2 if kind == ALL_REDUCE else 1)
        ring = kind != ALL_REDUCE or p < NVLS_MIN_RANKS
        return share * nbytes / cluster.busbw(nbytes, ring)
    return _on_one_link(kind, nbytes, p, *_intra(cluster, kind))


NVLS_MIN_RANKS = 5
"""NVLink SHARP lifts all-reduce bus bandwidth only from 5 GPUs up: on H100 it stays at the
ring's 365-370 GB/s for 2-4 GPUs and reaches 420-480 for 5-8 (NVIDIA/nccl issue 1455)."""


def _on_one_link(kind: str, nbytes: float, p: int, latency: float, bandwidth: float,
                 fitted: bool = False) -> float:
    if kind != ALL_REDUCE:
        return ring_all_gather_time(nbytes, p, latency=latency, bandwidth=bandwidth)
    if fitted:  # fitted with the ring's form: the backend's own algorithm choice is in it
        return ring_all_reduce_time(nbytes, p, latency=latency, bandwidth=bandwidth)
    return all_reduce_time(nbytes, p, latency=latency, bandwidth=bandwidth)


def _hierarchical(kind: str, nbytes: float, nodes: int, per_node: int,
                  cluster: ClusterSpec) -> float:
    """Inside each node, across nodes on 1/per_node of the data, inside again.

    all-reduce: reduce-scatter in node + all-reduce across + all-gather in node;
    all-gather: all-gather across (each node's slice) + all-gather in node;
    reduce-scatter: the mirror image.
    """
    across = (cluster.inter_node_latency, cluster.inter_node_bandwidth)
    part = nbytes / per_node
    rs_in = in_node_time(REDUCE_SCATTER, nbytes, per_node, cluster)
    ag_in = in_node_time(ALL_GATHER, nbytes, per_node, cluster)
    if kind == ALL_REDUCE:
        return rs_in + _on_one_link(ALL_REDUCE, part, nodes, *across) + ag_in
    if kind == ALL_GATHER:
        return _on_one_link(ALL_GATHER, part, nodes, *across) + ag_in
    return rs_in + _on_one_link(REDUCE_SCATTER, part, nodes, *across)
