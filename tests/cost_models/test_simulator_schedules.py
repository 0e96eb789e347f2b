"""The simulator against closed forms: pipeline bubbles, activation memory, rates, caching."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest

import piper
from cost_models import (
    CATALOG,
    ClusterSpec,
    ModelCosts,
    TaskCosts,
    predicted_json,
    simulate,
    task_costs,
)
from cost_models.memory import static_bytes
from cost_models.simulator import Prediction
from piper import schedules
from piper.dag import Kind
from runtime.lowering.dryrun import Span, dry_run
from runtime.lowering.plan import COMPUTE_STREAM, PAIR_STREAM, Plan
from runtime.lowering.scheduler import schedule
from tests.cost_models.conftest import MICROBATCH, STAGES

LAYERS = 4  # examples/gpt.py CONFIGS["tiny"]; STAGES puts LAYERS / pp of them on each stage


def uniform(costs: ModelCosts) -> ModelCosts:
    """One FLOP per layer and none elsewhere: on the ideal 1 FLOP/s cluster, at the capture
    batch, a stage's forward takes as many seconds as it has layers, the same on every stage.
    """
    flops = tuple(1 if r.startswith("layer") else 0 for r in costs.regions)
    return dataclasses.replace(costs, forward_flops=flops)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_uniform_pipeline_matches_the_closed_form_step_and_bubble(
        make_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec], schedule: str, pp: int, m: int) -> None:
    plan = make_plan(schedule, pp=pp, microbatches=m)
    pred = simulate(plan, uniform(costs), ideal_cluster(), costs.batch)
    t_f = LAYERS / pp
    t_b = 2 * t_f
    assert pred.step_time_s == pytest.approx((m + pp - 1) * (t_f + t_b), abs=1e-9)
    assert pred.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-9)


def test_1f1b_holds_less_activation_memory_than_gpipe_on_every_rank(
        make_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    c, model = ideal_cluster(), uniform(costs)
    gpipe = simulate(make_plan("gpipe", pp=4, microbatches=8), model, c, 2)
    ofob = simulate(make_plan("1f1b", pp=4, microbatches=8), model, c, 2)
    assert all(a < b for a, b in zip(ofob.peak_memory_bytes, gpipe.peak_memory_bytes,
                                     strict=True))


def test_static_memory_is_16_bytes_per_parameter_of_the_ranks_stages(
        make_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2)
    expected = tuple(16 * sum(costs.params_of(plan.stage_regions[s]) for s in rp.stages)
                     for rp in plan.ranks)
    assert static_bytes(plan, costs) == expected
    no_acts = dataclasses.replace(costs, activation_bytes=(0,) * len(costs.regions))
    assert simulate(plan, no_acts, ideal_cluster(), 2).peak_memory_bytes == expected


def test_1f1b_peak_on_the_first_rank_is_static_plus_pp_microbatches(
        make_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    plan = make_plan("1f1b", pp=4, microbatches=8)
    pred = simulate(plan, uniform(costs), ideal_cluster(), 2)
    act = costs.activation_bytes_of(plan.stage_regions[0], 2)
    assert pred.peak_memory_bytes[0] == static_bytes(plan, costs)[0] + 4 * act


def test_rates_follow_their_definitions(make_plan: Callable[..., Plan],
                                        costs: ModelCosts) -> None:
    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2)
    c = CATALOG["h100-80gb"]
    pred = simulate(plan, costs, c, 3)
    samples = 3 * 4 * 2
    assert pred.tokens_per_s == pytest.approx(samples * costs.tokens_per_sample
                                              / pred.step_time_s)
    model_flops = 3 * sum(costs.forward_flops) / costs.batch * samples
    assert pred.mfu == pytest.approx(model_flops / (pred.step_time_s * 4 * c.flops))
    assert 0 < pred.mfu < c.compute_efficiency


def test_timeline_comes_from_the_runtime_dry_run(make_plan: Callable[..., Plan],
                                                 costs: ModelCosts) -> None:
    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2)
    pred = simulate(plan, costs, CATALOG["a100-40gb"], 2)
    assert all(isinstance(s, Span) for s in pred.spans)
    assert len(pred.spans) == sum(len(rp.tasks) for rp in plan.ranks)
    assert pred.step_time_s == max(s.end for s in pred.spans)
    ar = [s for s in pred.spans if s.task.kind is Kind.ALL_REDUCE]
    assert len(ar) == 4 and all(s.end > s.start for s in ar)


def test_predicted_json_has_the_cli_keys_and_serialises(make_plan: Callable[..., Plan],
                                                        costs: ModelCosts) -> None:
    plan = make_plan("gpipe", pp=2, microbatches=4)
    out = predicted_json(simulate(plan, costs, CATALOG["cpu"], 2))
    assert set(out) == {"step_time_s", "peak_memory_bytes", "ranks", "tokens_per_s", "mfu"}
    assert isinstance(out["peak_memory_bytes"], list) and len(out["peak_memory_bytes"]) == 2
    assert out["ranks"] == [0, 1]
    json.dumps(out)


# ---- closed forms of the other schedules ----------------------------------------------------
# Uniform chunk times: every stage's forward takes F = 1 s and its backward B = 2 s, split
# by SplitBackward into I = W = 1 s (TaskCosts prices each half at B / 2); messages are free.
F, B, W = 1.0, 2.0, 1.0
TINY_STAGES = {  # the tiny GPT's six regions cut into n stages; costs come from `uniform_chunks`
    3: [["embed", "layer.0"], ["layer.1", "layer.2"], ["layer.3", "head"]],
    6: [["embed"], ["layer.0"], ["layer.1"], ["layer.2"], ["layer.3"], ["head"]],
}


@pytest.fixture(scope="module")
def chunk_plan(captured: piper.Captured) -> Callable[..., Plan]:
    """`chunk_plan("dualpipev", pp=2, stages=4, microbatches=4)`: a scheduled Plan."""
    dag0 = piper.single_device_dag(captured.graph)
    cuts = {2: STAGES[2], 4: STAGES[4], **TINY_STAGES}

    def build(name: str, *, pp: int, stages: int, microbatches: int) -> Plan:
        prog = schedules.build(name, cuts[stages], microbatches=microbatches, pp=pp)
        return schedule(prog.apply(dag0))
    return build


def uniform_chunks(plan: Plan, cluster: ClusterSpec) -> TaskCosts:
    n = len(plan.stage_regions)
    return TaskCosts(cluster=cluster, forward_s=(F,) * n, backward_s=(B,) * n,
                     update_s=(0.0,) * n, gradient_bytes=(0,) * n,
                     value_bytes=tuple((v.name, 0) for v in plan.model.values))


def predict(plan: Plan, costs: ModelCosts, cluster: ClusterSpec) -> Prediction:
    return simulate(plan, costs, cluster, MICROBATCH, durations=uniform_chunks(plan, cluster))


@pytest.mark.parametrize(("pp", "v"), [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_1f1b_bubble_shrinks_by_the_virtual_stages(
        chunk_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec], pp: int, v: int, rounds: int) -> None:
    """Megatron's interleaved 1F1B: with F, B per chunk (a stage holds 1/v of a device's
    layers), every device idles (p-1)(F+B), so step = (m·v + p - 1)(F+B) and the bubble over
    the ideal m·v·(F+B) is (p-1)/(v·m) — 1F1B's (p-1)/m divided by v."""
    m = rounds * pp  # the schedule needs a multiple of pp; m == pp is all warm-up
    pred = predict(chunk_plan("interleaved-1f1b", pp=pp, stages=pp * v, microbatches=m),
                   costs, ideal_cluster())
    ideal = m * v * (F + B)
    assert pred.step_time_s == pytest.approx((m * v + pp - 1) * (F + B), abs=1e-9)
    assert (pred.step_time_s - ideal) / ideal == pytest.approx((pp - 1) / (v * m), abs=1e-9)
    assert pred.idle_s == pytest.approx(((pp - 1) * (F + B),) * pp)
    assert pred.bubble_fraction == pytest.approx((pp - 1) / (m * v + pp - 1), abs=1e-9)


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_zb1p_bubble_is_the_zero_bubble_papers_zb_h1(
        chunk_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec], pp: int, rounds: int) -> None:
    """ZB-H1 (Qi et al. 2024; DeepSeek-V3's table writes it with B the full backward):
    bubble (p-1)(F + B - 2W) per device, a third of 1F1B's (p-1)(F+B) when F = I = W.
    Input gradients travel back at I per hop, and each device runs its delayed W passes in
    what 1F1B leaves idle."""
    m = rounds * pp
    pred = predict(chunk_plan("zb1p", pp=pp, stages=pp, microbatches=m), costs,
                   ideal_cluster())
    bubble = (pp - 1) * (F + B - 2 * W)
    assert pred.step_time_s == pytest.approx(m * (F + B) + bubble, abs=1e-9)
    assert pred.idle_s == pytest.approx((bubble,) * pp)


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("extra", [0, 1, 6])
def test_dualpipev_bubble_with_sequential_forward_backward_pairs(
        chunk_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec], pp: int, extra: int) -> None:
    """DualPipeV on pp devices (2·pp stages in a V). DeepSeek-V3's table gives the bubble
    (PP/2 - 1)(F&B + B - 3W) with PP = 2·pp stages, where F&B is a forward and a backward
    chunk running overlapped. The two lanes of a pair share one device (the simulator
    stretches what runs at once), and with no communication to hide a pair takes F + B of
    it, so F&B = F + B here, and with F = I = W the table's figure (pp-1)(F + 2B - 3W) is
    an upper bound, not what the schedule does: its phases are the reference DualPipeV order,
    and every device idles exactly (pp-1)(F + B - 2W), ZB-H1's bubble with half the devices
    per stage count, whatever the number of microbatches."""
    stages, m = 2 * pp, 2 * pp + extra  # the schedule needs m >= 2·pp
    pred = predict(chunk_plan("dualpipev", pp=pp, stages=stages, microbatches=m), costs,
                   ideal_cluster())
    bubble = (pp - 1) * (F + B - 2 * W)
    assert pred.idle_s == pytest.approx((bubble,) * pp, abs=1e-9)
    assert pred.step_time_s == pytest.approx(2 * m * (F + B) + bubble, abs=1e-9)
    f_and_b = F + B  # sequential, not overlapped
    assert bubble <= (stages // 2 - 1) * (f_and_b + B - 3 * W)


def test_dualpipev_pairs_run_at_once_and_share_their_device(
        captured: piper.Captured, costs: ModelCosts) -> None:
    """A pair's backward (pair lane) runs beside its forward (compute lane); with both at
    once each gets half the device, so pairs buy nothing without communication to hide: the
    step is within a few percent of the same order run one task after another."""
    dag0 = piper.single_device_dag(captured.graph)
    prog = schedules.build("dualpipev", STAGES[4], microbatches=6, pp=2)
    flat = piper.Program([dataclasses.replace(d, tasks=d.tasks.replace("+", " "))
                          if isinstance(d, piper.Order) else d for d in prog.directives])
    cluster = CATALOG["a100-40gb"]
    paired = simulate(schedule(prog.apply(dag0)), costs, cluster, MICROBATCH)
    alone = simulate(schedule(flat.apply(dag0)), costs, cluster, MICROBATCH)
    assert paired.step_time_s == pytest.approx(alone.step_time_s, rel=0.05)
    for rank in range(2):
        lanes = {s: [x for x in paired.spans if x.rank == rank and x.stream == s
                     and x.task.kind.is_chunk] for s in (COMPUTE_STREAM, PAIR_STREAM)}
        both = sum(max(0.0, min(a.end, b.end) - max(a.start, b.start))
                   for a in lanes[COMPUTE_STREAM] for b in lanes[PAIR_STREAM])
        assert both > 0  # the lanes overlap in time
        assert paired.busy_s[rank] <= paired.step_time_s  # math counted once, not per lane
        assert paired.busy_s[rank] < sum(x.end - x.start for ts in lanes.values() for x in ts)


def test_busy_and_idle_add_up_to_the_step_on_every_rank_and_stream(
        make_plan: Callable[..., Plan], costs: ModelCosts) -> None:
    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2)
    pred = simulate(plan, costs, CATALOG["a100-40gb"], 2)
    step = pred.step_time_s
    assert [(u.rank, u.stream) for u in pred.streams] == [
        (rp.rank, s) for rp in plan.ranks for s, _ in rp.streams]
    for u in pred.streams:
        mine = [s for s in pred.spans if (s.rank, s.stream) == (u.rank, u.stream)]
        ran = sum(s.end - s.start for s in mine if s.task.kind is not Kind.RECV)
        assert u.busy_s == pytest.approx(ran) and u.busy_s + u.idle_s == pytest.approx(step)
    for rp, busy, idle in zip(plan.ranks, pred.busy_s, pred.idle_s, strict=True):
        math = sum(s.end - s.start for s in pred.spans
                   if s.rank == rp.rank and s.task.kind.is_compute)
        assert busy == pytest.approx(math) and busy + idle == pytest.approx(step)
    assert pred.bubble_fraction == pytest.approx(sum(pred.idle_s) / step / len(plan.ranks))


def test_timeline_does_not_depend_on_the_order_streams_are_visited(
        captured: piper.Captured, costs: ModelCosts) -> None:
    """The dry run is event driven: listing ranks (and so visiting streams) in another order
    gives every task the same start and end, with waits across streams, P2P messages and
    data-parallel collectives all in play."""
    dag0 = piper.single_device_dag(captured.graph)
    prog = schedules.build("zb1p", TINY_STAGES[3], microbatches=6, dp=2, zero=2)
    prog = piper.Program([*prog.directives, piper.Stream("RS AG", stream="comm")],
                         name=prog.name)
    plan = schedule(prog.apply(dag0))
    tc = task_costs(plan, costs, CATALOG["a100-40gb"], MICROBATCH)
    flipped = dataclasses.replace(plan, ranks=plan.ranks[::-1])

    def times(p: Plan) -> list[tuple]:
        return sorted((s.rank, s.stream, s.task.name, s.start, s.end)
                      for s in dry_run(p, tc.duration, tc.transfer))
    assert any(t.after for rp in plan.ranks for t in rp.tasks)
    assert times(flipped) == times(plan)
