"""Communication costs: the alpha-beta model for P2P and ring all-reduce, and link choice.

alpha is a message's fixed latency (s), beta a link's bandwidth (bytes/s). The formulas are the
standard ones (Thakur, Rabenseifner & Gropp 2005; NCCL's ring): pure functions of numbers so
they can be checked by hand and reused by fitted models.
"""

from __future__ import annotations

from collections.abc import Iterable

from cost_models.cluster import ClusterSpec


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


def link(cluster: ClusterSpec, ranks: Iterable[int]) -> tuple[float, float]:
    """(latency, bandwidth) of the slowest link `ranks` span: inter-node once two nodes are in.

    A ring runs at the pace of its slowest hop, so one cross-node pair makes the whole
    collective inter-node.
    """
    nodes = {cluster.node_of(r) for r in ranks}
    if len(nodes) > 1:
        return cluster.inter_node_latency, cluster.inter_node_bandwidth
    return cluster.intra_node_latency, cluster.intra_node_bandwidth
