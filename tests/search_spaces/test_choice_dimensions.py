"""Recompute, the comm stream and all-reduce buckets as search dimensions: off by default
(the space is as before), choices when asked for, in every sample and every Program it
names."""

from __future__ import annotations

from collections.abc import Iterator

import optuna
import pytest

import piper
from piper import Program, Recompute, Stream
from piper.dag import Kind, TrainingDAG
from piper.model_file import load_model_file
from search_spaces import PipelineSpace
from search_spaces.pipeline import ALL_SCHEDULES

REGIONS = ("embed", "layer.0", "layer.1", "layer.2", "layer.3", "head")
# dimension -> the PipelineSpace field that turns it on
CHOICES = {"recompute": "recomputes", "comm_stream": "comm_streams"}


def space(**kw: object) -> PipelineSpace:
    return PipelineSpace(REGIONS, (1.0,) * 6, 4, 16, schedules=ALL_SCHEDULES, zeros=(0, 3),
                         **kw)  # type: ignore[arg-type]


def on(dim: str) -> PipelineSpace:
    return space(**{CHOICES[dim]: (False, True)})


@pytest.fixture(scope="module")
def dag0() -> TrainingDAG:
    cap = piper.capture(load_model_file("examples/gpt.py", (("size", "tiny"),)), 2)
    return piper.single_device_dag(cap.graph)


def dp_of(point: dict) -> int:
    return 4 // (point["pp"] * point.get("tp", 1))


@pytest.mark.parametrize("dim", CHOICES)
def test_choice_is_off_by_default_and_doubles_the_space_where_it_applies(dim: str) -> None:
    off, sp = space(), on(dim)
    asked = {"recompute": "recompute", "comm_stream": "comm_stream_quantile"}[dim]
    assert dim not in off.grid() and asked not in off.parameters()
    assert sp.grid()[dim] == [False, True]
    # recompute is a categorical choice; the comm stream a position among what is valid
    assert sp.parameters()[asked] == ([False, True] if dim == "recompute" else None)
    points = sp.points()
    assert [{k: v for k, v in p.items() if k != dim} for p in points
            if not p[dim]] == off.points()
    # recompute runs with everything; a comm stream needs data-parallel collectives other
    # than ZeRO-3's (which stay with the compute that waits for its gathers)
    applies = [p for p in off.points()
               if dim == "recompute" or (dp_of(p) > 1 and p["zero"] != 3)]
    assert 0 < len(applies) and len(points) == len(off.points()) + len(applies)


def programs(dim: str, dag0: TrainingDAG) -> Iterator[tuple[dict, Program, TrainingDAG]]:
    """Every point of the space with `dim` on, its Program, and that applied to `dag0`."""
    sp = on(dim)
    for point in sp.points():
        prog = sp.program(**point)
        yield point, prog, prog.apply(dag0)


def test_every_point_names_a_program_that_recomputes_as_it_says(dag0: TrainingDAG) -> None:
    for point, prog, dag in programs("recompute", dag0):
        assert any(isinstance(d, Recompute) for d in prog.directives) == point["recompute"]
        assert prog.summary()["recompute"] == point["recompute"]
        assert dag.recompute == (tuple(range(len(dag.stages))) if point["recompute"] else ())


def test_every_point_puts_gradient_collectives_where_it_says(dag0: TrainingDAG) -> None:
    for point, prog, dag in programs("comm_stream", dag0):
        assert any(isinstance(d, Stream) for d in prog.directives) == point["comm_stream"]
        assert prog.summary()["comm_stream"] == point["comm_stream"]
        moved = {k for k, s in dag.streams if s == "comm"}
        # the gradient all-reduce moves in every case (ZeRO-3's gathers stay on compute)
        assert (Kind.ALL_REDUCE.value in moved) == point["comm_stream"]
        assert Kind.ALL_GATHER.value not in moved or point["zero"] != 3


@pytest.mark.parametrize("dim", CHOICES)
def test_samples_choose_both_ways_and_map_back(dim: str) -> None:
    sp = on(dim)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(32):
        trial = study.ask()
        point = sp.sample(trial)
        if dim == "recompute":
            assert trial.params[dim] == point[dim]
        assert sp.sample(optuna.trial.FixedTrial(sp.params_of(point))) == point
        seen.add(point[dim])
        prog = sp.suggest(optuna.trial.FixedTrial(trial.params))
        assert prog.summary()[dim] == point[dim]
        study.tell(trial, 0.0)
    assert seen == {False, True}


def test_bucket_sizes_are_variants_of_data_parallel_points(dag0: TrainingDAG) -> None:
    off, sp = space(), space(buckets=(0, 25))
    assert sp.grid() == off.grid() and sp.points() == off.points()  # scored, not sampled
    variants, zeros = 0, set()
    for point in sp.points():
        vs = sp.variants(point)
        assert vs[0] == point
        # all-reduce buckets, or ZeRO's units; one replica has no data-parallel collectives
        applies = dp_of(point) > 1
        assert [v.get("bucket_mb", 0) for v in vs] == ([0, 25] if applies else [0])
        for v in vs[1:]:
            prog = sp.program(**v)
            assert prog.summary()["bucket_mb"] == 25
            assert prog.apply(dag0).bucket_bytes == 25 * 2**20
            variants += 1
            zeros.add(v["zero"])
    assert variants > 0 and zeros == {0, 3}
