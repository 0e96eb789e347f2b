"""The simulator against closed forms: pipeline bubbles, activation memory, rates, caching."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest

from cost_models import CATALOG, ClusterSpec, ModelCosts, predicted_json, simulate
from cost_models.memory import static_bytes
from piper.dag import Kind
from runtime.dryrun import Span
from runtime.plan import Plan

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
    assert set(out) == {"step_time_s", "peak_memory_bytes", "tokens_per_s", "mfu"}
    assert isinstance(out["peak_memory_bytes"], list) and len(out["peak_memory_bytes"]) == 2
    json.dumps(out)


def test_repeated_simulation_is_served_from_the_cache(make_plan: Callable[..., Plan],
                                                      costs: ModelCosts) -> None:
    plan = make_plan("1f1b", pp=4, microbatches=4)
    c = CATALOG["h200"]
    assert simulate(plan, costs, c, 2) is simulate(plan, costs, c, 2)
    assert simulate(plan, costs, c, 2) is not simulate(plan, costs, c, 4)
