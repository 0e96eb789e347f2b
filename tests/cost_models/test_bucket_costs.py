"""Bucketed all-reduce prices: one collective per bucket; started inside the last backward,
only what outlasts that backward is left for the AR task."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cost_models import ClusterSpec, ModelCosts, simulate, task_costs
from cost_models.comm import ring_all_reduce_time
from piper.dag import Kind
from runtime.lowering.plan import Plan


@pytest.fixture(scope="module")
def bucketed(make_plan: Callable[..., Plan]) -> Callable[..., Plan]:
    """pp2 x dp2, 4 microbatches, with `bucket_mb` buckets (None: one all-reduce)."""
    def build(bucket_mb: float | None, *, comm_stream: bool = False, name: str = "1f1b"
              ) -> Plan:
        return make_plan(name, pp=2, microbatches=4, dp=2, bucket_mb=bucket_mb,
                         comm_stream=comm_stream)
    return build


def _ar(plan: Plan, rank: int = 0):
    return next(t for t in plan.ranks[rank].tasks if t.kind is Kind.ALL_REDUCE)


def _cluster(ideal_cluster: Callable[..., ClusterSpec], latency: float) -> ClusterSpec:
    return ideal_cluster(flops=1e9, intra_node_bandwidth=1e7, intra_node_latency=latency)


def test_late_buckets_cost_one_collective_each(bucketed, costs: ModelCosts, ideal_cluster):
    c = _cluster(ideal_cluster, 1e-4)
    plan = bucketed(0.01, comm_stream=True)  # on a comm stream: started at the AR
    assert plan.bucket_bytes == round(0.01 * 2**20)
    tc = task_costs(plan, costs, c, microbatch_size=4)
    assert tc.early_buckets == frozenset()
    total = tc.gradient_bytes[0]
    k = -(-total // plan.bucket_bytes)
    assert k > 2

    def ring(n: float) -> float:
        return ring_all_reduce_time(n, 2, latency=1e-4, bandwidth=1e7)
    expect = (k - 1) * ring(plan.bucket_bytes) + ring(total - (k - 1) * plan.bucket_bytes)
    assert tc.duration(0, _ar(plan)) == pytest.approx(expect)
    assert tc.duration(0, _ar(plan)) > ring(total)  # k latencies instead of one


def test_early_buckets_leave_only_what_outlasts_the_backward(bucketed, costs: ModelCosts,
                                                             ideal_cluster):
    plan = bucketed(0.01)
    c = _cluster(ideal_cluster, 0.0)
    tc = task_costs(plan, costs, c, microbatch_size=4)
    assert tc.early_buckets == frozenset({0, 1})
    total, cap = tc.gradient_bytes[0], plan.bucket_bytes
    last = total - (-(-total // cap) - 1) * cap
    back = tc.backward_s[0]
    whole = ring_all_reduce_time(total, 2, latency=0.0, bandwidth=1e7)
    # communication slower than backward: the channel is the bottleneck after bucket 0
    # starts (at back * cap / total); what remains after backward is the rest of it
    assert whole > back
    assert tc.duration(0, _ar(plan)) == pytest.approx(back * cap / total + whole - back)
    # communication much faster than backward: only the last bucket is left
    fast = ideal_cluster(flops=1e3, intra_node_bandwidth=1e7, intra_node_latency=0.0)
    tc = task_costs(plan, costs, fast, microbatch_size=4)
    assert tc.duration(0, _ar(plan)) == pytest.approx(
        ring_all_reduce_time(last, 2, latency=0.0, bandwidth=1e7))


def test_split_backward_starts_buckets_at_the_all_reduce(bucketed, costs, ideal_cluster):
    plan = bucketed(0.01, name="zb1p")
    assert task_costs(plan, costs, _cluster(ideal_cluster, 0.0), 4).early_buckets == frozenset()


def test_early_buckets_shorten_a_communication_bound_step(bucketed, costs: ModelCosts,
                                                          ideal_cluster):
    c = _cluster(ideal_cluster, 1e-6)
    one = simulate(bucketed(None), costs, c, microbatch_size=4).step_time_s
    early = simulate(bucketed(0.01), costs, c, microbatch_size=4).step_time_s
    assert early < one


def _task(plan: Plan, kind: Kind, rank: int = 0):
    return next(t for t in plan.ranks[rank].tasks if t.kind is kind)


def test_zero_units_gather_one_collective_each_and_reduce_scatter_early(
        make_plan, costs: ModelCosts, ideal_cluster):
    from cost_models.comm import REDUCE_SCATTER, collective_time

    c = _cluster(ideal_cluster, 1e-4)
    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2, zero=3, bucket_mb=0.01)
    tc = task_costs(plan, costs, c, microbatch_size=4)
    assert tc.early_buckets == frozenset({0, 1})
    one = task_costs(make_plan("1f1b", pp=2, microbatches=4, dp=2, zero=3), costs, c, 4)
    ag, rs = _task(plan, Kind.ALL_GATHER), _task(plan, Kind.REDUCE_SCATTER)
    # the ALL_GATHER brings the chunk's first unit; the chunk gathers the others, each
    # while the unit before it computes (what does not hide behind 1/n of it shows)
    from cost_models.comm import ALL_GATHER
    n = tc.units[0]
    assert n == -(-costs.element_size * costs.params_of(plan.stage_regions[0])
                  // plan.bucket_bytes) > 2
    unit = collective_time(ALL_GATHER, round(tc.gather_bytes[0] / n), ag.group, c)
    assert tc.duration(0, ag) == pytest.approx(unit + c.task_overhead_s)
    assert tc.duration(0, ag) < one.duration(0, ag)
    fwd = _task(plan, Kind.FWD)
    busy = one.duration(0, fwd) - c.task_overhead_s
    assert tc.duration(0, fwd) == pytest.approx(
        busy + (n - 1) * max(0.0, unit - busy / n) + c.task_overhead_s)
    assert tc.duration(0, fwd) > one.duration(0, fwd)  # slow links: the gathers show
    # the gathers inside the chunk take NVLink's contention from it over the share they cover
    import dataclasses

    hit = task_costs(plan, costs, dataclasses.replace(c, comm_compute_contention=0.5), 4)
    hidden = (n - 1) * min(unit, busy / n)
    assert hit.duration(0, fwd) - tc.duration(0, fwd) == pytest.approx(
        busy * 0.5 * min(1.0, hidden / busy))
    total, cap = tc.gradient_bytes[0], plan.bucket_bytes
    sizes = [cap] * (total // cap) + [total % cap]
    late = sum(collective_time(REDUCE_SCATTER, n, rs.group, c) for n in sizes)
    assert tc.duration(0, rs) < late + c.task_overhead_s  # started inside the backward
    # on a comm stream the units wait for the task, one collective each
    moved = make_plan("1f1b", pp=2, microbatches=4, dp=2, zero=2, bucket_mb=0.01,
                      comm_stream=True)
    tm = task_costs(moved, costs, c, microbatch_size=4)
    assert tm.early_buckets == frozenset()
    assert tm.duration(0, _task(moved, Kind.REDUCE_SCATTER)) == pytest.approx(
        late + c.task_overhead_s)


def test_a_gather_under_the_next_forward_shows_its_first_bucket_and_what_outlasts(
        make_plan, costs: ModelCosts, ideal_cluster):
    """Megatron's --overlap-param-gather: ZeRO-1's post-update gather runs in buckets under
    the next forward, each dispatched when the one before arrives: the step sees the
    first bucket's, what each later one has left past its predecessor's forward, and the
    forward slowed by contention over the part hidden."""
    import dataclasses

    from cost_models.comm import ALL_GATHER, collective_time

    c = _cluster(ideal_cluster, 1e-4)
    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2, zero=1, bucket_mb=0.01,
                     comm_stream=True)
    tc = task_costs(plan, costs, c, microbatch_size=4)
    ag = next(t for t in plan.ranks[0].tasks if t.kind is Kind.ALL_GATHER)
    assert ag.mb < 0  # after the update
    total, cap = tc.gather_bytes[0], plan.bucket_bytes
    sizes = [cap] * (total // cap) + ([total % cap] if total % cap else [])
    assert len(sizes) > 2
    times = [collective_time(ALL_GATHER, n, ag.group, c) for n in sizes]
    in_line = tc.duration(0, ag)
    assert in_line == pytest.approx(sum(times) + c.task_overhead_s)
    under = dataclasses.replace(tc, gather_under_forward=True)
    fwd = tc.forward_s[0]
    covers = [fwd * n / total for n in sizes]
    expect = times[0] + sum(max(0.0, t - f) for t, f in zip(times[1:], covers, strict=False))
    assert under.duration(0, ag) == pytest.approx(expect + c.task_overhead_s)
    assert times[0] < under.duration(0, ag) < in_line  # slow links: part of it shows
    fast = dataclasses.replace(under, forward_s=tuple(1e3 for _ in tc.forward_s))
    assert fast.duration(0, ag) == pytest.approx(times[0] + c.task_overhead_s)
    slowed = dataclasses.replace(fast, cluster=dataclasses.replace(
        c, comm_compute_contention=0.5))
    assert slowed.duration(0, ag) == pytest.approx(
        times[0] + 0.5 * sum(times[1:]) + c.task_overhead_s)


def test_zero3_units_hold_two_units_gathered_not_the_stage(make_plan, costs: ModelCosts):
    from cost_models.memory import StageMemory
    from cost_models.task_costs import gathered_element_size

    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2, zero=3, bucket_mb=0.01)
    size = gathered_element_size(costs, 3)
    whole = StageMemory.of(plan.stage_regions, costs, 4, 3, ())
    units = StageMemory.of(plan.stage_regions, costs, 4, 3, (), plan.bucket_bytes)
    for s, rs in enumerate(plan.stage_regions):
        assert whole.gathered[s] == size * costs.params_of(rs)
        unit = max(plan.bucket_bytes // costs.element_size, costs.largest_param_of(rs))
        assert units.gathered[s] == min(whole.gathered[s], 2 * size * unit)
    assert units.gathered[0] < whole.gathered[0]


def test_overlapped_pairs_gather_zero3_stages_whole(make_plan, costs: ModelCosts, ideal_cluster):
    """Under dualpipev a paired backward runs on another thread: its gathers would meet the
    other lane's on one communicator, so units are not gathered inside chunks there, and
    the models price and hold the stage whole (`runtime.execute.unit_gather.unit_gathers`)."""
    from cost_models.memory import StageMemory
    from runtime.execute.unit_gather import unit_gathers

    plain = make_plan("1f1b", pp=2, microbatches=4, dp=2, zero=3, bucket_mb=0.01)
    pairs = make_plan("dualpipev", pp=2, microbatches=4, dp=2, zero=3, bucket_mb=0.01)
    assert unit_gathers(plain) and pairs.paired and not unit_gathers(pairs)
    c = _cluster(ideal_cluster, 1e-4)
    assert task_costs(pairs, costs, c, 4).units == ()
    assert task_costs(plain, costs, c, 4).units
    whole = StageMemory.of(pairs.stage_regions, costs, 4, 3, (), pairs.bucket_bytes,
                           paired=True)
    units = StageMemory.of(pairs.stage_regions, costs, 4, 3, (), pairs.bucket_bytes)
    assert whole.gathered[0] > units.gathered[0]
