"""PipelineSpace: feasible points only, Programs that apply, Infeasible points, suggest()."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import optuna
import pytest

import piper
from piper import Program, schedules
from piper.dag import TrainingDAG
from piper.model_file import load_model_file
from search_spaces import Infeasible, PipelineSpace

REGIONS = ("embed", "layer.0", "layer.1", "layer.2", "layer.3", "head")
COSTS = (1.0, 4.0, 4.0, 4.0, 4.0, 2.0)


@pytest.fixture(scope="module")
def dag0() -> TrainingDAG:
    cap = piper.capture(load_model_file("examples/gpt.py", (("size", "tiny"),)), 2)
    return piper.single_device_dag(cap.graph)


def space(gpus: int, batch_size: int, **kw: Any) -> PipelineSpace:
    return PipelineSpace(regions=REGIONS, region_costs=COSTS, gpus=gpus, batch_size=batch_size,
                         **kw)


class FirstChoiceTrial:
    """Picks the first choice (or the low end) of every parameter, remembering what it saw."""

    def __init__(self) -> None:
        self.asked: dict[str, list[Any]] = {}

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        self.asked[name] = list(choices)
        return choices[0]

    def suggest_float(self, name: str, low: float, high: float) -> float:
        self.asked[name] = [low, high]
        return low


def test_grid_lists_pp_dividing_gpus_up_to_the_region_count() -> None:
    g = space(gpus=12, batch_size=16, max_microbatches=8).grid()
    assert g == {"pp": [1, 2, 3, 4, 6], "microbatches": [1, 2, 4, 8],
                 "schedule": ["gpipe", "1f1b", "none"], "zero": [0]}


def test_full_space_rules_out_points_no_schedule_can_run(dag0: TrainingDAG) -> None:
    from search_spaces.pipeline import ALL_SCHEDULES

    sp = PipelineSpace(dag0.model.names, (1.0,) * 6, 4, 16, schedules=ALL_SCHEDULES,
                       zeros=(0, 1, 2, 3))
    points = list(sp.enumerate())
    for p, prog in points:
        dag = prog.apply(dag0)
        assert dag.world_size == 4 and dag.zero == p["zero"]
        assert p["zero"] == 0 or dag.dp > 1
        if p["schedule"] in ("interleaved-1f1b", "dualpipev"):
            assert len(dag.stages) == 2 * p["pp"]
        if p["schedule"] == "dualpipev":
            assert p["microbatches"] >= 2 * p["pp"]
    assert {p["schedule"] for p, _ in points} == {*ALL_SCHEDULES, schedules.NO_PIPELINE}
    # ZeRO-3 composes with the split backward of the zero-bubble schedules
    assert {p["schedule"] for p, _ in points if p["zero"] == 3} == {
        *ALL_SCHEDULES, schedules.NO_PIPELINE}
    with pytest.raises(Infeasible, match="at least 2 x pp = 4 microbatches"):
        sp.program(pp=2, microbatches=2, schedule="dualpipev", zero=0)
    with pytest.raises(Infeasible, match="dp=1 has none"):
        sp.program(pp=4, microbatches=4, schedule="1f1b", zero=1)


@pytest.mark.parametrize("gpus, batch", [(4, 8), (6, 12), (8, 4), (1, 3)])
def test_enumerate_yields_only_feasible_points_that_apply(dag0: TrainingDAG, gpus: int,
                                                          batch: int) -> None:
    sp = space(gpus, batch)
    points = list(sp.enumerate())
    assert points
    grid = sp.grid()
    for params, prog in points:
        pp, m = params["pp"], params["microbatches"]
        dp = gpus // pp
        assert pp * dp == gpus
        assert batch % (dp * m) == 0
        assert params["schedule"] in grid["schedule"]
        s = prog.summary()
        want = schedules.NO_PIPELINE if pp == 1 else params["schedule"]
        assert (s["pp"], s["dp"], s["microbatches"], s["schedule"]) == (pp, dp, m, want)
        dag = prog.apply(dag0)
        assert dag.world_size == gpus
        assert (dag.pp, dag.dp, dag.microbatches) == (pp, dp, m)


def test_enumerate_skips_exactly_the_infeasible_grid_points() -> None:
    sp = space(gpus=4, batch_size=8)
    got = {(p["pp"], p["microbatches"], p["schedule"]) for p, _ in sp.enumerate()}
    want = {(pp, m, s) for pp in (1, 2, 4) for m in (1, 2, 4, 8)
            for s in ("gpipe", "1f1b", "none")
            if 8 % ((4 // pp) * m) == 0 and (pp > 1) == (s != "none")}  # pp=1: no pipeline
    assert got == want
    assert (1, 4, "gpipe") not in got  # dp=4 x 4 microbatches = 16 > 8


@pytest.mark.parametrize("params, msg", [
    ({"pp": 3, "microbatches": 1, "schedule": "gpipe"}, "pp=3 x tp=1 does not divide 4 devices"),
    ({"pp": 1, "microbatches": 4, "schedule": "none"},
     "dp=4 x microbatches=4 does not divide batch 8"),
    ({"pp": 1, "microbatches": 1, "schedule": "1f1b"}, "pp=1 has no pipeline to schedule"),
    ({"pp": 2, "microbatches": 1, "schedule": "none"}, "is for pp=1, not pp=2"),
])
def test_program_of_an_infeasible_point_raises_infeasible(params: dict, msg: str) -> None:
    with pytest.raises(Infeasible, match=msg):
        space(gpus=4, batch_size=8).program(**params)


def test_program_cuts_stages_by_balanced_region_cost() -> None:
    sp = space(gpus=4, batch_size=8)
    assert sp.stages(4) == [["embed", "layer.0"], ["layer.1"], ["layer.2"], ["layer.3", "head"]]
    prog = sp.program(pp=2, microbatches=2, schedule="gpipe")
    assert prog == schedules.gpipe(sp.stages(2), microbatches=2, dp=2)


def test_suggest_asks_categories_then_degree_positions_and_builds_that_point(
        dag0: TrainingDAG) -> None:
    sp = space(gpus=4, batch_size=8, zeros=(0, 1))
    trial = FirstChoiceTrial()
    prog = sp.suggest(trial)
    assert trial.asked == {"schedule": ["gpipe", "1f1b", "none"], "zero": [0, 1],
                           "pp_quantile": [0.0, 1.0], "microbatches_quantile": [0.0, 1.0]}
    # gpipe's smallest pipeline is pp=2 (pp=1 is kept once, under none)
    assert prog == sp.program(pp=2, microbatches=1, schedule="gpipe", zero=0)
    assert prog.apply(dag0).world_size == 4


def test_suggest_with_an_optuna_fixed_trial(dag0: TrainingDAG) -> None:
    sp = space(gpus=4, batch_size=8)
    # 1f1b's pp among 2, 4 (pp=1 is `none`'s); then with dp=2 the microbatches among 1, 2,
    # 4: the first pp, the middle microbatch count
    prog = sp.suggest(optuna.trial.FixedTrial({"schedule": "1f1b", "pp_quantile": 0.0,
                                               "microbatches_quantile": 0.5}))
    assert isinstance(prog, Program)
    assert prog == schedules.one_f_one_b(sp.stages(2), microbatches=2, dp=2)
    assert prog.apply(dag0).world_size == 4


@pytest.mark.parametrize("gpus, batch", [(8, 32), (6, 12), (16, 8)])
def test_sampled_points_are_always_feasible_and_cover_the_space(gpus: int, batch: int) -> None:
    from search_spaces.pipeline import ALL_SCHEDULES

    sp = space(gpus, batch, schedules=ALL_SCHEDULES, zeros=(0, 1, 2, 3), tps=(1, 2))
    feasible = sp.points()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(300):
        trial = study.ask()
        point = sp.sample(trial)  # would raise Infeasible for an invalid point
        sp.check(**point)
        dp = gpus // (point["pp"] * point["tp"])
        assert point["zero"] == 0 or dp > 1, "ZeRO only with data-parallel replicas"
        seen.add(tuple(sorted(point.items())))
        study.tell(trial, 0.0)
    assert len(seen) >= min(len(feasible), 300) // 3


def test_points_are_exactly_the_valid_grid_points() -> None:
    import itertools

    sp = space(gpus=8, batch_size=16, zeros=(0, 1, 2), tps=(1, 2, 4))
    grid = sp.grid()
    valid = []
    for values in itertools.product(*grid.values()):
        p = dict(zip(grid, values))
        try:
            sp.program(**p)
        except Infeasible:
            continue
        valid.append(p)
    assert sp.points() == valid


def test_tensor_parallel_points_shrink_the_pipeline_and_data_degrees(dag0: TrainingDAG) -> None:
    s = space(8, 16, schedules=("1f1b",), tps=(1, 2, 4))
    points = list(s.enumerate())
    tps = {p["tp"] for p, _ in points}
    assert tps == {1, 2, 4}
    for params, prog in points:
        dag = prog.apply(dag0)
        assert dag.world_size == 8 and dag.sharding.tp == params["tp"]
        assert prog.summary()["tp"] * prog.summary()["pp"] * prog.summary()["dp"] == 8


def test_expert_parallel_points_split_replicas() -> None:
    moe = piper.capture(load_model_file("examples/moe.py", (("size", "tiny"),)), 2).graph
    s = PipelineSpace(regions=moe.names, region_costs=(1.0,) * len(moe.names), gpus=4,
                      batch_size=16, schedules=("1f1b",), eps=(1, 2, 4),
                      expert_regions=("experts.0", "experts.1"))
    dag0 = piper.single_device_dag(moe)
    seen = set()
    for params, prog in s.enumerate():
        dag = prog.apply(dag0)
        assert dag.dp % dag.sharding.ep == 0
        seen.add((params["pp"], params["ep"]))
    assert (1, 4) in seen and (2, 2) in seen and (2, 4) not in seen
    with pytest.raises(Infeasible, match="ep=4 does not divide dp=2"):
        s.program(pp=2, microbatches=2, schedule="1f1b", ep=4)


def test_tensor_and_expert_parallel_degrees_compose_unless_the_pair_is_excluded() -> None:
    moe = piper.capture(load_model_file("examples/moe.py", (("size", "tiny"),)), 2).graph
    s = PipelineSpace(regions=moe.names, region_costs=(1.0,) * len(moe.names), gpus=8,
                      batch_size=16, schedules=("1f1b",), tps=(1, 2), eps=(1, 2),
                      expert_regions=("experts.0", "experts.1"))
    dag0 = piper.single_device_dag(moe)
    both = [(p, prog) for p, prog in s.enumerate() if p["tp"] == 2 and p["ep"] == 2]
    assert both
    for params, prog in both:
        dag = prog.apply(dag0)
        assert (dag.sharding.tp, dag.sharding.ep) == (2, 2) and dag.world_size == 8
    cut = dataclasses.replace(s, bad_shardings=((2, 2),))
    assert {(p["tp"], p["ep"]) for p in cut.points()} == {(1, 1), (1, 2), (2, 1)}
    with pytest.raises(Infeasible, match="tp=2 and ep=2 together"):
        cut.program(**both[0][0])


def test_params_of_is_the_inverse_of_sample() -> None:
    from search_spaces.pipeline import ALL_SCHEDULES

    sp = space(8, 32, schedules=ALL_SCHEDULES, zeros=(0, 1, 2, 3), tps=(1, 2, 4))
    names = sp.parameters()
    assert names == {"schedule": [*ALL_SCHEDULES, schedules.NO_PIPELINE], "zero": [0, 1, 2, 3],
                     "tp_quantile": None, "pp_quantile": None, "microbatches_quantile": None}
    for p in sp.points():
        params = sp.params_of(p)
        assert set(params) == set(names)
        assert sp.sample(optuna.trial.FixedTrial(params)) == p


def test_expert_tensor_parallelism_and_the_expert_mesh_are_variants_of_tp_points():
    """On a model with experts (4 per layer, hidden 16) a tp=2 ep=2 point is also run with
    each expert split over the TP group (etp=2) and as Megatron's expert mesh (ep=4 over the
    TP ranks); each variant is a strategy the space accepts and builds."""
    sp = space(8, 8, tps=(1, 2), eps=(1, 2), expert_regions=("layer.*",), expert_count=4,
               expert_hidden=16)
    point = {"pp": 1, "microbatches": 1, "schedule": sp.flat_schedule, "tp": 2, "ep": 2}
    got = {(v.get("etp", 1), v["ep"], v.get("ep_over_tp", False)) for v in sp.variants(point)}
    assert got == {(1, 2, False), (2, 2, False), (1, 4, True)}
    mesh = next(v for v in sp.variants(point) if v.get("ep_over_tp"))
    shard = next(d for d in sp.program(**mesh).directives if isinstance(d, piper.Shard))
    assert (shard.degree, shard.over_tp, shard.tensor) == (4, True, 1)
    no_cut = dataclasses.replace(sp, expert_hidden=0, expert_count=2)  # biases; 2 experts
    assert {(v.get("etp", 1), v["ep"]) for v in no_cut.variants(point)} == {(1, 2)}
