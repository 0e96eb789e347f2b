"""Properties of the search space, on random points drawn by hypothesis: every valid Program
it yields lowers to a DAG that `verify` accepts and a Plan the deadlock dry run passes; and
(a few examples, on real worker processes) trains to the single-device losses."""

from __future__ import annotations

from functools import cache

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cost_models import CATALOG
from piper.dag import Kind, verify
from piper.model_file import load_model_file, parse_model_args
from planner.search.evaluate import Evaluator
from runtime.cluster.launcher import run
from runtime.lowering.lower import apply_for, lower
from runtime.lowering.scheduler import schedule
from runtime.train.reference import max_rel_diff, reference_losses
from search_spaces import PipelineSpace
from search_spaces.pipeline import ALL_SCHEDULES
from tests.conftest import GPT, ROOT

MODELS = {  # name: (file, --model-arg values)
    "gpt": (GPT, ["size=tiny"]),
    "gpt_tied": (GPT, ["size=tiny", "tie=true"]),
    "skip_mlp": (str(ROOT / "tests" / "models" / "skip_mlp.py"), []),
}


@cache
def evaluator(model: str) -> Evaluator:
    """Captured once per model; the space's gpus and batch vary around it."""
    path, args = MODELS[model]
    return Evaluator(load_model_file(path, parse_model_args(args)), 1, 1, CATALOG["cpu"])


def draw_point(data: st.DataObject, model: str, gpus: int, batch: int, max_mb: int):
    """A feasible point of the space as its Program, drawn among the valid points (drawing
    from the grid and rejecting the invalid ones filtered too much: hypothesis's health
    check failed now and then)."""
    ev = evaluator(model)
    space = PipelineSpace(ev.captured.graph.names, ev.region_costs(), gpus, batch,
                          schedules=ALL_SCHEDULES, zeros=(0, 1, 2, 3), max_microbatches=max_mb)
    points = space.points()
    assume(points)
    return space.program(**data.draw(st.sampled_from(points), label="point"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), model=st.sampled_from(sorted(MODELS)),
       gpus=st.sampled_from([1, 2, 3, 4, 6, 8]), batch=st.sampled_from([8, 12, 16, 24]))
def test_valid_programs_verify_and_pass_the_deadlock_dry_run(data, model, gpus, batch):
    program = draw_point(data, model, gpus, batch, max_mb=12)
    dag = apply_for(program, evaluator(model).dag, gpus)
    verify(dag)
    plan = schedule(dag, check=True)  # raises on a deadlock
    assert plan.world_size == gpus
    forwards = {(t.stage, t.mb) for rp in plan.ranks for t in rp.tasks if t.kind is Kind.FWD}
    assert forwards == {(s, m) for s in range(len(plan.stage_regions))
                        for m in range(program.summary()["microbatches"])}, \
        "every stage runs every microbatch forward"


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), gpus=st.sampled_from([2, 3, 4]))
def test_sampled_programs_reproduce_single_device_losses(ray_session, data, gpus):
    ev = evaluator("gpt")
    spec, batch = ev.spec, 12
    program = draw_point(data, "gpt", gpus, batch, max_mb=4)
    result = run(spec, lower(spec, program, gpus, batch), batch_size=batch, steps=2, seed=0)
    ref = reference_losses(spec, batch_size=batch, steps=2, seed=0)
    assert max_rel_diff([s.loss for s in result.steps], ref) <= 1e-4, program.summary()
