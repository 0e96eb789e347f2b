"""What a short real run adds to the profile: the executor's time between tasks, and how
much slower compute ran than the simulator predicts for the same Plan (`calibrate._in_run`),
checked on timelines built from the simulator's own with known distortions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from cost_models import CATALOG, ClusterSpec, ModelCosts, simulate
from cost_models.calibrate import RunSample, _in_run, task_gaps
from runtime.lowering.dryrun import Span
from runtime.lowering.plan import Plan

GAP = 2e-4


def stretched(spans: tuple[Span, ...], factor: float, gap: float) -> tuple[Span, ...]:
    """Each lane replayed back to back: compute `factor` times longer, `gap` between tasks
    (as measured, a task's own span holds its waiting, so gaps are bookkeeping only)."""
    out, clock = [], {}
    for s in sorted(spans, key=lambda s: (s.rank, s.stream, s.start, s.end)):
        lane = (s.rank, s.stream)
        start = clock[lane] + gap if lane in clock else s.start
        dur = (s.end - s.start) * (factor if s.task.kind.is_compute else 1.0)
        out.append(Span(s.rank, s.stream, s.task, start, start + dur))
        clock[lane] = start + dur
    return tuple(out)


@pytest.fixture
def case(make_plan: Callable[..., Plan], costs: ModelCosts) -> tuple[Plan, ModelCosts, ClusterSpec]:
    """1F1B over 2 stages of the tiny GPT, on a cluster whose tasks cost no overhead."""
    return (make_plan("1f1b", pp=2, microbatches=4), costs,
            dataclasses.replace(CATALOG["cpu"], task_overhead_s=0.0))


def test_gaps_are_the_time_between_tasks_of_each_lane(case) -> None:
    plan, costs, cluster = case
    gaps = task_gaps(stretched(simulate(plan, costs, cluster, 2).spans, 1.0, GAP))
    assert gaps and all(g == pytest.approx(GAP) for g in gaps)


@pytest.mark.parametrize("factor", [1.0, 2.5])
def test_in_run_recovers_the_overhead_and_the_compute_factor(case, factor: float) -> None:
    plan, costs, cluster = case
    measured = stretched(simulate(plan, costs, cluster, 2).spans, factor, GAP)
    spec = _in_run(cluster, RunSample(plan, 2, measured), costs)
    assert spec.task_overhead_s == pytest.approx(GAP)
    # the factor is what makes the simulated compute match the measured compute
    assert spec.runtime_compute_factor == pytest.approx(factor, rel=1e-6)

