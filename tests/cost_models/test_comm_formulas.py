"""Alpha-beta P2P, ring all-reduce and the choice of link."""

from __future__ import annotations

import pytest

from cost_models import CATALOG
from cost_models.comm import link, p2p_time, ring_all_reduce_time


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
