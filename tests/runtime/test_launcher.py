"""A `Job` holds its workers and their state between steps, so two can be stepped in turn
(as benchmarks/vs_torch_pipelining.py steps ours and torch's) without touching each other."""

from __future__ import annotations

from piper import schedules
from piper.capture import capture
from piper.model_file import load_model_file
from runtime.launcher import Job
from runtime.lowering import lower
from runtime.reference import max_rel_diff, reference_losses
from tests.conftest import GPT

TINY = (("size", "tiny"),)


def test_two_jobs_stepped_in_turn_each_train_like_one_device(ray_session):
    spec = load_model_file(GPT, TINY)
    regions = capture(spec, 2).graph.names
    plan = lower(spec, schedules.build("1f1b", [list(regions[:3]), list(regions[3:])],
                                       microbatches=4, pp=2), 2, 8)
    with Job(spec, plan, batch_size=8, seed=0) as a, Job(spec, plan, batch_size=8,
                                                        seed=0) as b:
        losses = [(a.step().loss, b.step().loss) for _ in range(3)]
        result = a.finish()
    ref = reference_losses(spec, batch_size=8, steps=3, seed=0)
    assert max_rel_diff([x for x, _ in losses], ref) < 1e-4
    assert max_rel_diff([y for _, y in losses], ref) < 1e-4
    assert [s.loss for s in result.steps] == [x for x, _ in losses]
    assert result.spans and len(result.model_state_bytes) == 2
    assert not a.actors and not b.actors  # closed: the workers are gone
