"""Contention: ranks sharing a node's cores, and communication overlapping computation."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import piper
from cost_models import ClusterSpec, ModelCosts, simulate
from piper import Program, schedules
from piper.directives import Stream
from runtime.lowering.plan import Plan
from runtime.lowering.scheduler import schedule

ALL = [["embed", "layer.0", "layer.1", "layer.2", "layer.3", "head"]]


def _plan(captured: piper.Captured, prog: Program) -> Plan:
    return schedule(prog.apply(piper.single_device_dag(captured.graph)))


@pytest.mark.parametrize(("cores", "slowdown"), [(None, 1.0), (4, 1.0), (8, 1.0),
                                                (2, 2.0), (1, 4.0), (1.5, 4 / 1.5)])
def test_four_replicas_computing_at_once_share_the_nodes_cores(
        captured: piper.Captured, costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec], cores: float | None,
        slowdown: float) -> None:
    plan = _plan(captured, schedules.one_f_one_b(ALL, microbatches=1, dp=4))
    alone = simulate(plan, costs, ideal_cluster(), costs.batch).step_time_s
    shared = simulate(plan, costs, ideal_cluster(cores_per_node=cores), costs.batch)
    assert shared.step_time_s == pytest.approx(slowdown * alone, rel=1e-6)


def test_a_pipeline_that_computes_on_one_rank_at_a_time_is_not_slowed(
        make_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    plan = make_plan("gpipe", pp=2, microbatches=1)  # F0 F1 B1 B0: never two at once
    alone = simulate(plan, costs, ideal_cluster(), costs.batch).step_time_s
    shared = simulate(plan, costs, ideal_cluster(cores_per_node=1), costs.batch).step_time_s
    assert shared == pytest.approx(alone, rel=1e-9)


def test_cores_are_shared_within_a_node_only(
        captured: piper.Captured, costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    plan = _plan(captured, schedules.one_f_one_b(ALL, microbatches=1, dp=4))
    alone = simulate(plan, costs, ideal_cluster(), costs.batch).step_time_s
    two_nodes = ideal_cluster(cores_per_node=2, gpus_per_node=2)  # two ranks per node
    assert simulate(plan, costs, two_nodes, costs.batch).step_time_s == pytest.approx(alone)


def test_overlapped_collectives_slow_the_compute_they_overlap(
        captured: piper.Captured, costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    # interleaved: a rank's later stage all-reduces while its earlier stage still computes
    four = [["embed", "layer.0"], ["layer.1"], ["layer.2"], ["layer.3", "head"]]
    base = schedules.build("interleaved-1f1b", four, microbatches=4, dp=2, pp=2)
    plan = _plan(captured, Program([*base.directives, Stream("AR", stream="comm")]))
    slow_links = {"flops": 1e9, "intra_node_bandwidth": 1e7, "intra_node_latency": 1e-3}
    free = simulate(plan, costs, ideal_cluster(**slow_links), costs.batch)
    c = 0.5
    contended = simulate(plan, costs, ideal_cluster(comm_compute_contention=c, **slow_links),
                         costs.batch)
    assert any(s.stream == "comm" for s in free.spans)
    assert free.step_time_s < contended.step_time_s <= (1 + c) * free.step_time_s
    # the network's share where the data-parallel pair sits one rank per node (Calculon:
    # 15% NVLink, 2% InfiniBand), NVLink's where it shares a node
    apart = {**slow_links, "inter_node_bandwidth": 1e7, "inter_node_latency": 1e-3,
             "gpus_per_node": 1}
    net = simulate(plan, costs, ideal_cluster(inter_node_contention=c, **apart), costs.batch)
    nvlink_only = simulate(plan, costs, ideal_cluster(comm_compute_contention=c, **apart),
                           costs.batch)
    alone = simulate(plan, costs, ideal_cluster(**apart), costs.batch)
    assert net.step_time_s > alone.step_time_s == pytest.approx(nvlink_only.step_time_s)
    inside = simulate(plan, costs, ideal_cluster(inter_node_contention=c, **slow_links),
                      costs.batch)
    assert inside.step_time_s == pytest.approx(free.step_time_s)
