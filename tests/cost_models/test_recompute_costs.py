"""Recompute in the cost models: a recomputed stage's backward repeats its forward (in I when
the backward is split, with the forward's in-graph collectives), so the predicted step is
longer, and its microbatches keep only their regions' inputs, so the predicted peak is lower."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import piper
from cost_models import CATALOG, ClusterSpec, ModelCosts, simulate, task_costs
from cost_models.memory import activation_bytes
from cost_models.sharded import InGraphComm, with_in_graph_comm
from piper import schedules
from piper.dag import Kind
from runtime.lowering.plan import Plan, Task
from runtime.lowering.scheduler import schedule
from tests.cost_models.conftest import MICROBATCH, STAGES


@pytest.fixture(scope="module")
def plans(captured: piper.Captured) -> Callable[..., tuple[Plan, Plan]]:
    """`plans("zb1p")`: the pp=2 Plan of a schedule without and with Recompute."""
    dag0 = piper.single_device_dag(captured.graph)

    def build(name: str, tp: int = 1, stages: tuple[int, ...] = ()) -> tuple[Plan, Plan]:
        prog = schedules.build(name, STAGES[2], microbatches=4)
        prog = schedules.shard(prog, tp=tp)
        return (schedule(prog.apply(dag0)),
                schedule(schedules.with_recompute(prog, stages).apply(dag0)))
    return build


def _task(plan: Plan, rank: int, kind: Kind) -> Task:
    return next(t for t in plan.ranks[rank].tasks if t.kind is kind)


@pytest.mark.parametrize("name", ["1f1b", "zb1p"])
def test_recompute_lengthens_the_predicted_step_and_lowers_the_peak(
        plans: Callable[..., tuple[Plan, Plan]], costs: ModelCosts, name: str) -> None:
    plain, again = plans(name)
    cluster = CATALOG["h100-80gb"]
    a, b = (simulate(p, costs, cluster, MICROBATCH) for p in (plain, again))
    assert b.step_time_s > a.step_time_s
    # the first stage holds the most microbatches; with a split backward the last one holds
    # W's products from I to W, about what it saved anyway
    assert all(y <= x for x, y in zip(a.peak_memory_bytes, b.peak_memory_bytes, strict=True))
    assert b.peak_memory_bytes[0] < a.peak_memory_bytes[0]
    if name == "1f1b":
        assert b.peak_memory_bytes[1] < a.peak_memory_bytes[1]
    # the extra busy time of a rank is one forward per microbatch of its stage
    tc = task_costs(plain, costs, cluster, MICROBATCH)
    for rank, (x, y) in enumerate(zip(a.busy_s, b.busy_s, strict=True)):
        assert y - x == pytest.approx(4 * tc.forward_s[rank])
    kept, full = activation_bytes(again, costs, MICROBATCH), activation_bytes(plain, costs,
                                                                              MICROBATCH)
    assert all(k < f for k, f in zip(kept, full, strict=True))


def test_only_the_recomputed_stages_pay_and_save(plans: Callable[..., tuple[Plan, Plan]],
                                                 costs: ModelCosts) -> None:
    plain, again = plans("1f1b", stages=(0,))
    cluster = CATALOG["h100-80gb"]
    a, b = (task_costs(p, costs, cluster, MICROBATCH) for p in (plain, again))
    assert b.backward_s[0] == pytest.approx(a.backward_s[0] + a.forward_s[0])
    assert b.backward_s[1] == a.backward_s[1]
    ka, kb = (activation_bytes(p, costs, MICROBATCH) for p in (plain, again))
    assert kb[0] < ka[0] and kb[1] == ka[1]
    pa, pb = (simulate(p, costs, cluster, MICROBATCH).peak_memory_bytes for p in (plain, again))
    assert pb[0] < pa[0] and pb[1] == pa[1]


def test_split_backward_puts_the_recompute_in_i_not_w(
        plans: Callable[..., tuple[Plan, Plan]], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    plain, again = plans("zb1p")
    cluster = ideal_cluster(flops=1e9)
    a, b = (task_costs(p, costs, cluster, MICROBATCH) for p in (plain, again))
    for rank in range(2):
        i, w = _task(again, rank, Kind.BWD_I), _task(again, rank, Kind.BWD_W)
        assert b.duration(rank, i) == pytest.approx(a.duration(rank, i) + a.forward_s[rank])
        assert b.duration(rank, w) == pytest.approx(a.duration(rank, w))


def test_recompute_runs_the_forward_collectives_again_in_backward(
        plans: Callable[..., tuple[Plan, Plan]], costs: ModelCosts) -> None:
    plain, again = plans("zb1p", tp=2)
    cluster = CATALOG["h100-80gb"]
    n = len(costs.regions)
    one = tuple((1 << 20,) for _ in range(n))  # 1 MiB each way per region
    traffic = InGraphComm(forward_all_reduce=one, backward_all_reduce=one,
                          all_to_all=tuple(() for _ in range(n)))
    a, b = (with_in_graph_comm(task_costs(p, costs, cluster, MICROBATCH), p, traffic, cluster,
                               MICROBATCH) for p in (plain, again))
    bare = task_costs(plain, costs, cluster, MICROBATCH)
    for s in range(2):
        comm_f = a.forward_s[s] - bare.forward_s[s]
        assert comm_f > 0
        assert b.backward_s[s] == pytest.approx(a.backward_s[s] + a.forward_s[s])
        assert b.recompute_s[s] == pytest.approx(bare.forward_s[s] + comm_f)
        i = _task(again, s, Kind.BWD_I)
        assert b.duration(s, i) == pytest.approx(a.duration(s, i) + a.forward_s[s])
