"""Recompute: what it records (and does not rewrite), its errors, its place among the other
directives, and its JSON and Python round trips."""

from __future__ import annotations

import pytest

import piper
from piper import Order, Place, Program, Recompute, Replicate, Split, schedules
from piper.dag import TrainingDAG
from piper.model_file import load_model_file
from tests.piper.test_program import run_python

STAGES = {
    2: [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]],
    4: [["embed", "layer.0"], ["layer.1"], ["layer.2"], ["layer.3", "head"]],
}
# (schedule, pipeline ranks, stages, microbatches): every schedule of the library
SHAPES = [("gpipe", 2, 2, 2), ("1f1b", 2, 2, 4), ("interleaved-1f1b", 2, 4, 4),
          ("zb1p", 2, 2, 4), ("dualpipev", 2, 4, 4)]


@pytest.fixture(scope="module")
def dag0() -> TrainingDAG:
    cap = piper.capture(load_model_file("examples/gpt.py", (("size", "tiny"),)), 2)
    return piper.single_device_dag(cap.graph)


def edges(dag: TrainingDAG) -> set:
    return {(u, v, a["kind"]) for u, v, a in dag.graph.edges(data=True)}


def test_recompute_records_every_stage_and_leaves_the_graph_alone(dag0: TrainingDAG) -> None:
    plain = schedules.one_f_one_b(STAGES[2], microbatches=4, dp=2)
    dag = schedules.with_recompute(plain).apply(dag0)
    assert dag.recompute == (0, 1)
    assert edges(dag) == edges(plain.apply(dag0))
    assert plain.apply(dag0).recompute == ()


def test_recompute_of_chosen_stages_records_them_sorted_once(dag0: TrainingDAG) -> None:
    prog = schedules.with_recompute(schedules.gpipe(STAGES[4], microbatches=2), (3, 1, 3))
    assert prog.apply(dag0).recompute == (1, 3)


@pytest.mark.parametrize("name, pp, n, m", SHAPES)
@pytest.mark.parametrize("zero", [0, 3])
def test_recompute_composes_with_every_schedule_and_zero(dag0: TrainingDAG, name: str,
                                                         pp: int, n: int, m: int,
                                                         zero: int) -> None:
    prog = schedules.build(name, STAGES[n], microbatches=m, dp=2, pp=pp, zero=zero,
                           recompute=True)
    prog = schedules.shard(prog, tp=2)
    kinds = [type(d).__name__ for d in prog.directives]
    assert kinds.index("Recompute") < kinds.index("Order")
    dag = prog.apply(dag0)
    assert dag.recompute == tuple(range(n)) and dag.sharding.tp == 2
    assert prog.summary()["recompute"] is True


@pytest.mark.parametrize("name, pp, n, m", SHAPES)
def test_program_with_recompute_round_trips_through_json_and_python(
        dag0: TrainingDAG, name: str, pp: int, n: int, m: int) -> None:
    p = schedules.build(name, STAGES[n], microbatches=m, dp=2, pp=pp, zero=1, recompute=True)
    from_json, from_python = Program.from_json(p.to_json()), run_python(p.to_python())
    assert from_json == p and from_python == p
    assert from_json.apply(dag0).recompute == from_python.apply(dag0).recompute == (
        p.apply(dag0).recompute)


def test_recompute_of_chosen_stages_round_trips_and_reads_plainly() -> None:
    for d in (Recompute(), Recompute((0, 2)), Recompute(policy="op"),
              Recompute((1,), policy="attention")):
        assert eval(d.to_python(), {"Recompute": Recompute}) == d
        assert Program.from_json(Program([d]).to_json()).directives == (d,)
    assert Recompute().to_python() == "Recompute()"
    assert Recompute(policy="op").to_python() == "Recompute(policy='op')"
    assert Recompute([1]).to_dict() == {"type": "Recompute", "stages": [1], "policy": "full"}


def test_recompute_policy_names_megatrons_alias_and_refuses_unknown_ones(
        dag0: TrainingDAG) -> None:
    assert Recompute(policy="selective").policy == "attention"
    with pytest.raises(ValueError, match="unknown recompute policy 'fast'"):
        Recompute(policy="fast")
    prog = schedules.build("1f1b", STAGES[2], microbatches=2, pp=2, recompute="op")
    assert prog.apply(dag0).recompute_policy == "op"
    assert prog.summary()["recompute"] == "op"
    assert schedules.build("1f1b", STAGES[2], microbatches=2, pp=2,
                           recompute=True).summary()["recompute"] is True


def test_recompute_of_a_missing_stage_raises_naming_it(dag0: TrainingDAG) -> None:
    prog = schedules.with_recompute(schedules.gpipe(STAGES[2], microbatches=2), (1, 2))
    with pytest.raises(piper.DirectiveError, match=r"stages \[2\] do not exist \(2 stages\)"
                       ) as e:
        prog.apply(dag0)
    assert isinstance(e.value.directive, Recompute)


def test_recompute_twice_raises(dag0: TrainingDAG) -> None:
    base = [Place(tuple(r), stage=s, device=s) for s, r in enumerate(STAGES[2])]
    with pytest.raises(piper.DirectiveError, match="Recompute must come once") as e:
        Program([*base, Split(2), Recompute((0,)), Recompute((1,))]).apply(dag0)
    assert e.value.index == 4


def test_recompute_after_order_raises_phase_order_error(dag0: TrainingDAG) -> None:
    base = [Place(tuple(r), stage=s, device=s) for s, r in enumerate(STAGES[2])]
    orders = [Order(s, f"F{s}.0 B{s}.0") for s in range(2)]
    with pytest.raises(piper.DirectiveError, match="in the order"):
        Program([*base, *orders, Recompute()]).apply(dag0)


def test_recompute_before_or_after_replicate_gives_the_same_dag(dag0: TrainingDAG) -> None:
    base = [*(Place(tuple(r), stage=s, device=s) for s, r in enumerate(STAGES[2])), Split(2)]
    a = Program([*base, Recompute(), Replicate(2, zero=3)]).apply(dag0)
    b = Program([*base, Replicate(2, zero=3), Recompute()]).apply(dag0)
    assert a.recompute == b.recompute == (0, 1) and edges(a) == edges(b)
