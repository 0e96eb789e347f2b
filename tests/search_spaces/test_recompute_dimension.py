"""Recompute as a search dimension: off by default (the space is as before), a categorical
choice when asked for, in every sample and every Program it names."""

from __future__ import annotations

import optuna
import pytest

import piper
from piper import Recompute
from piper.dag import TrainingDAG
from piper.model_file import load_model_file
from search_spaces import PipelineSpace
from search_spaces.pipeline import ALL_SCHEDULES

REGIONS = ("embed", "layer.0", "layer.1", "layer.2", "layer.3", "head")


def space(**kw: object) -> PipelineSpace:
    return PipelineSpace(REGIONS, (1.0,) * 6, 4, 16, schedules=ALL_SCHEDULES, zeros=(0, 3),
                         **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def dag0() -> TrainingDAG:
    cap = piper.capture(load_model_file("examples/gpt.py", (("size", "tiny"),)), 2)
    return piper.single_device_dag(cap.graph)


def test_recompute_is_off_by_default_and_doubles_the_space_when_on() -> None:
    off, on = space(), space(recomputes=(False, True))
    assert "recompute" not in off.grid() and "recompute" not in off.parameters()
    assert on.grid()["recompute"] == [False, True]
    assert on.parameters()["recompute"] == [False, True]
    points = on.points()
    assert len(points) == 2 * len(off.points())
    assert [{k: v for k, v in p.items() if k != "recompute"} for p in points
            if not p["recompute"]] == off.points()


def test_every_point_names_a_program_that_recomputes_as_it_says(dag0: TrainingDAG) -> None:
    sp = space(recomputes=(False, True))
    for point in sp.points():
        prog = sp.program(**point)
        dag = prog.apply(dag0)
        assert any(isinstance(d, Recompute) for d in prog.directives) == point["recompute"]
        assert prog.summary()["recompute"] == point["recompute"]
        assert dag.recompute == (tuple(range(len(dag.stages))) if point["recompute"] else ())


def test_samples_choose_recompute_both_ways_and_map_back() -> None:
    sp = space(recomputes=(False, True))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(24):
        trial = study.ask()
        point = sp.sample(trial)
        assert trial.params["recompute"] == point["recompute"]
        assert sp.sample(optuna.trial.FixedTrial(sp.params_of(point))) == point
        seen.add(point["recompute"])
        prog = sp.suggest(optuna.trial.FixedTrial(trial.params))
        assert prog.summary()["recompute"] == point["recompute"]
        study.tell(trial, 0.0)
    assert seen == {False, True}
