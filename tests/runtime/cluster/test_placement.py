"""Placement (`runtime.cluster.placement`): blocks of consecutive ranks per node, reserved before any
worker starts, and a cluster without room told at once instead of waiting forever."""

from __future__ import annotations

import time

import pytest

from piper.errors import PiperError
from runtime.cluster.launcher import describe_nodes
from runtime.cluster.placement import blocks, place, rank_resources


def test_blocks_fill_nodes_in_rank_order():
    assert blocks(5, 2) == [range(2), range(2, 4), range(4, 5)]
    assert blocks(4, 8) == [range(4)]


def test_what_a_rank_reserves(ray_session):
    assert rank_resources("cuda", joined=False) == {"GPU": 1.0}
    assert rank_resources("cpu", joined=True, world=2) == {"CPU": 1.0}  # the session has 2
    assert 0 < rank_resources("cpu", joined=True, world=3)["CPU"] < 0.01  # more: shared
    assert 0 < rank_resources("cpu", joined=False)["CPU"] < 0.01


def test_nodes_are_said_in_runs():
    assert describe_nodes(("a", "a", "b", "b", "a")) == \
        "ranks 0-1 on a, ranks 2-3 on b, rank 4 on a"


def test_ranks_land_in_their_blocks_and_the_groups_go_with_the_job(ray_session):
    ray = ray_session
    p = place(4, 2, rank_resources("cpu", joined=False))
    try:
        assert len(p.groups) == 2
        opts = p.options(3)["scheduling_strategy"]
        assert opts.placement_group == p.groups[1]
        assert opts.placement_group_bundle_index == 1
        table = ray.util.placement_group_table()
        assert all(table[g.id.hex()]["strategy"] == "STRICT_PACK" for g in p.groups)
    finally:
        ids = [g.id.hex() for g in p.groups]
        p.remove()
    table = ray.util.placement_group_table()
    assert all(table[i]["state"] == "REMOVED" for i in ids)


def test_a_cluster_without_room_is_told_at_once(ray_session):
    t0 = time.monotonic()
    with pytest.raises(PiperError, match=r"no room for 2 ranks in blocks of 2 per node "
                                         r"\(200 CPU each\) within 1 s; its nodes: .*CPU"):
        place(2, 2, {"CPU": 100.0}, ready_s=1.0)
    assert time.monotonic() - t0 < 10
    table = ray_session.util.placement_group_table()
    assert all(g["state"] == "REMOVED" for g in table.values()
               if g["bundles"] and g["bundles"][0].get("CPU") == 100.0)
