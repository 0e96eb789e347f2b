"""Alpha-beta P2P, ring and tree all-reduce, the choice of link, and two-level hierarchy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models import CATALOG
from cost_models.cluster import AlphaBeta
from cost_models.comm import (
    all_reduce_time,
    collective_time,
    link,
    p2p_message_time,
    p2p_time,
    ring_all_gather_time,
    ring_all_reduce_time,
    tree_all_reduce_time,
)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 64])
def test_ring_all_reduce_is_2_p_minus_1_alpha_plus_2_p_minus_1_over_p_n_over_beta(p: int) -> None:
    n, alpha, beta = 3.0e9, 7e-6, 4.5e11
    expected = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / beta
    assert ring_all_reduce_time(n, p, latency=alpha, bandwidth=beta) == pytest.approx(
        expected, rel=1e-12)


def test_all_reduce_over_one_rank_is_free() -> None:
    assert ring_all_reduce_time(1e9, 1, latency=1e-5, bandwidth=1e9) == 0.0


def test_p2p_is_alpha_plus_n_over_beta() -> None:
    assert p2p_time(4e6, latency=1e-5, bandwidth=2e9) == pytest.approx(1e-5 + 2e-3)


def test_link_is_intra_node_inside_a_node_and_inter_node_once_a_group_spans_two() -> None:
    c = CATALOG["h100-80gb"]
    intra = (c.intra_node_latency, c.intra_node_bandwidth)
    inter = (c.inter_node_latency, c.inter_node_bandwidth)
    assert link(c, range(8)) == intra
    assert link(c, (7, 8)) == inter
    assert link(c, (0, 8, 16)) == inter


# ---- tree, the cheaper of the two, hierarchy, fitted figures -------------------------------
ALPHA, BETA = 1e-5, 1e10


@pytest.mark.parametrize(("p", "levels"), [(2, 1), (3, 2), (8, 3), (9, 4), (1024, 10)])
def test_tree_all_reduce_is_2_ceil_log2_p_times_alpha_plus_n_over_beta(p: int,
                                                                      levels: int) -> None:
    n = 1e6
    assert tree_all_reduce_time(n, p, latency=ALPHA, bandwidth=BETA) == pytest.approx(
        2 * levels * (ALPHA + n / BETA), rel=1e-12)


def test_all_reduce_takes_the_tree_for_small_messages_and_the_ring_for_large() -> None:
    p = 64
    small, large = 1e3, 1e9
    tree = tree_all_reduce_time(small, p, latency=ALPHA, bandwidth=BETA)
    assert tree < ring_all_reduce_time(small, p, latency=ALPHA, bandwidth=BETA)
    assert all_reduce_time(small, p, latency=ALPHA, bandwidth=BETA) == tree
    ring = ring_all_reduce_time(large, p, latency=ALPHA, bandwidth=BETA)
    assert ring < tree_all_reduce_time(large, p, latency=ALPHA, bandwidth=BETA)
    assert all_reduce_time(large, p, latency=ALPHA, bandwidth=BETA) == ring


def _two_level(**changes: object):
    """The H100 entry on alpha-beta links (no measured bus-bandwidth curve)."""
    c = CATALOG["h100-80gb"]
    return replace(c, intra_node_latency=ALPHA, intra_node_bandwidth=BETA,
                   inter_node_latency=1e-4, inter_node_bandwidth=1e9, intra_node_busbw=(),
                   **changes)


def test_a_group_inside_one_node_uses_the_intra_node_link() -> None:
    c = _two_level()
    n = 4e8
    assert collective_time("all_reduce", n, range(8), c) == pytest.approx(
        ring_all_reduce_time(n, 8, latency=ALPHA, bandwidth=BETA))
    assert collective_time("all_gather", n, range(4), c) == pytest.approx(
        ring_all_gather_time(n, 4, latency=ALPHA, bandwidth=BETA))


def test_a_group_across_nodes_runs_hierarchically_when_that_is_cheaper() -> None:
    c = _two_level()
    n, nodes, per = 4e8, 2, 8
    inter = {"latency": 1e-4, "bandwidth": 1e9}
    intra = {"latency": ALPHA, "bandwidth": BETA}
    hier = (ring_all_gather_time(n, per, **intra)  # reduce-scatter in node
            + all_reduce_time(n / per, nodes, **inter)  # all-reduce of a slice across
            + ring_all_gather_time(n, per, **intra))  # all-gather in node
    flat = ring_all_reduce_time(n, nodes * per, **inter)
    assert hier < flat
    assert collective_time("all_reduce", n, range(16), c) == pytest.approx(hier)
    ag = ring_all_gather_time(n / per, nodes, **inter) + ring_all_gather_time(n, per, **intra)
    assert collective_time("all_gather", n, range(16), c) == pytest.approx(ag)


def test_one_rank_per_node_has_no_hierarchy_to_use() -> None:
    c = _two_level()
    group = (0, 8, 16, 24)  # four nodes, one rank on each
    n = 1e8
    assert collective_time("all_reduce", n, group, c) == pytest.approx(
        all_reduce_time(n, 4, latency=1e-4, bandwidth=1e9))


def test_fitted_figures_replace_the_intra_node_link_for_their_kind_only() -> None:
    fitted = AlphaBeta(latency=3e-4, bandwidth=5e8)
    c = _two_level(all_reduce=fitted, p2p=AlphaBeta(latency=2e-4, bandwidth=1e9))
    n = 1e6
    # fitted with the ring's form, so priced with it (no tree: the backend chose already)
    assert collective_time("all_reduce", n, range(4), c) == pytest.approx(
        ring_all_reduce_time(n, 4, latency=3e-4, bandwidth=5e8))
    assert collective_time("all_gather", n, range(4), c) == pytest.approx(
        ring_all_gather_time(n, 4, latency=ALPHA, bandwidth=BETA))
    assert p2p_message_time(c, 0, 1, n) == pytest.approx(2e-4 + n / 1e9)
    assert p2p_message_time(c, 7, 8, n) == pytest.approx(1e-4 + n / 1e9)  # across nodes


def test_unknown_collective_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="all_to_all"):
        collective_time("all_to_all", 1e6, range(4), CATALOG["h200"])
