"""Contract every schedule in the library meets, run against each one: a Program of
directives only, covering every chunk task once, deadlock-free, and round-tripping."""

from __future__ import annotations

import pytest

import piper
from piper import schedules
from piper.dag import Kind
from piper.model_file import load_model_file
from runtime.lowering.scheduler import schedule
from tests.conftest import GPT


@pytest.fixture(scope="module")
def dag0():
    cap = piper.capture(load_model_file(GPT, (("size", "tiny"),)), 2)
    return piper.single_device_dag(cap.graph)


def cut(names: tuple[str, ...], k: int) -> list[list[str]]:
    size = len(names) // k
    stages = [list(names[i * size:(i + 1) * size]) for i in range(k)]
    stages[-1] += names[k * size:]
    return stages


def shapes(name: str) -> list[tuple[int, int, int]]:
    """(pp, stages, microbatches) combinations a schedule accepts on 6 regions."""
    if name == "interleaved-1f1b":
        return [(2, 4, 2), (2, 4, 4), (2, 6, 6), (3, 6, 3), (2, 4, 8)]
    if name == "dualpipev":
        return [(1, 2, 2), (2, 4, 4), (2, 4, 7), (3, 6, 6), (3, 6, 10)]
    return [(1, 1, 1), (2, 2, 1), (2, 2, 4), (3, 3, 5), (6, 6, 8)]


CASES = [(n, *s) for n in schedules.SCHEDULES for s in shapes(n)]


@pytest.mark.parametrize(("name", "pp", "n_stages", "m"), CASES)
@pytest.mark.parametrize("dp", [1, 2])
def test_schedule_contract(dag0, name, pp, n_stages, m, dp):
    prog = schedules.build(name, cut(dag0.model.names, n_stages), microbatches=m, dp=dp, pp=pp)
    assert all(isinstance(d, piper.Directive) for d in prog.directives)
    assert piper.Program.from_json(prog.to_json()) == prog
    dag = prog.apply(dag0)
    assert (dag.pp, dag.dp, len(dag.stages)) == (pp, dp, n_stages)
    plan = schedule(dag)  # includes the deadlock dry run
    for rp in plan.ranks:
        chunks = [t.name for t in rp.tasks if t.kind.is_chunk]
        kinds = "FIW" if name in ("zb1p", "dualpipev") else "FB"
        expected = {f"{k}{s}.{mb}" for s in rp.stages for mb in range(m) for k in kinds}
        assert sorted(chunks) == sorted(expected), "every chunk task of the rank exactly once"
    summary = prog.summary()
    assert (summary["pp"], summary["dp"], summary["microbatches"]) == (pp, dp, m)
    assert summary["virtual_stages"] == n_stages // pp


def test_interleaved_places_stages_round_robin(dag0):
    prog = schedules.interleaved_1f1b(cut(dag0.model.names, 4), microbatches=4, pp=2)
    dag = prog.apply(dag0)
    assert [s.device for s in dag.stages] == [0, 1, 0, 1]


@pytest.mark.parametrize(("stages", "m", "pp", "match"), [
    (4, 3, 2, "multiple of pp=2"),
    (3, 2, 2, "do not split over pp=2"),
])
def test_interleaved_rejects_shapes_it_cannot_run(dag0, stages, m, pp, match):
    with pytest.raises(ValueError, match=match):
        schedules.interleaved_1f1b(cut(dag0.model.names, stages), microbatches=m, pp=pp)


def test_zb1p_defers_weight_gradients_by_the_device_lag(dag0):
    prog = schedules.zb1p(cut(dag0.model.names, 3), microbatches=5)
    orders = [d.tasks.split() for d in prog.directives if isinstance(d, piper.Order)]
    for device, order in enumerate(orders):
        lag = device
        for mb in range(5 - lag):  # W(mb) comes right after I(mb + lag)
            assert order[order.index(f"I{device}.{mb + lag}") + 1] == f"W{device}.{mb}"
    assert orders[2][:3] == ["F2.0", "I2.0", "F2.1"]  # the last device defers most
    assert orders[0][-2:] == ["I0.4", "W0.4"]  # the first never defers


def test_split_backward_rewrites_each_backward_into_input_and_weight_halves(dag0):
    stages = cut(dag0.model.names, 2)
    plain = piper.Program(schedules.one_f_one_b(stages, microbatches=2, dp=2,
                                                zero=2).directives[:4]).apply(dag0)
    split = piper.Program([*schedules.one_f_one_b(stages, microbatches=2).directives[:3],
                           piper.SplitBackward(), piper.Replicate(2, zero=2)]).apply(dag0)
    g = split.graph
    n_b = len(plain.nodes(Kind.BWD))
    assert len(split.nodes(Kind.BWD)) == 0
    assert len(split.nodes(Kind.BWD_I)) == len(split.nodes(Kind.BWD_W)) == n_b
    assert g.number_of_edges() == plain.graph.number_of_edges() + n_b  # one I -> W each
    for w in split.nodes(Kind.BWD_W):
        assert {p.kind for p in g.predecessors(w)} == {Kind.BWD_I}
        assert {s.kind for s in g.successors(w)} == {Kind.REDUCE_SCATTER}
    for i in split.nodes(Kind.BWD_I):
        assert all(s.kind in (Kind.BWD_W, Kind.SEND) for s in g.successors(i))


def test_split_backward_only_on_chosen_stages_and_not_twice(dag0):
    stages = cut(dag0.model.names, 2)
    base = list(schedules.gpipe(stages, microbatches=2).directives[:3])
    dag = piper.Program([*base, piper.SplitBackward((1,))]).apply(dag0)
    assert {n.stage for n in dag.nodes(Kind.BWD_I)} == {1}
    assert {n.stage for n in dag.nodes(Kind.BWD)} == {0}
    with pytest.raises(piper.DirectiveError, match="already split"):
        piper.Program([*base, piper.SplitBackward(), piper.SplitBackward()]).apply(dag0)


def test_dualpipev_places_stages_in_a_v_with_the_loss_on_device_zero(dag0):
    prog = schedules.dualpipev(cut(dag0.model.names, 4), microbatches=4)
    dag = prog.apply(dag0)
    assert [s.device for s in dag.stages] == [0, 1, 1, 0]
    assert dag.stage_of_region("head") == 3


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 7), (4, 8)])
def test_dualpipev_runs_every_half_backward_once_in_eight_phases(pp, m):
    for rank in range(pp):
        words = piper.Order(rank, schedules.dualpipev_order(rank, pp, m)).words
        order = [n for w in words for n in w]
        chunks = (rank, 2 * pp - 1 - rank)
        assert sorted(order) == sorted(f"{k}{s}.{mb}" for s in chunks for mb in range(m)
                                       for k in "FIW")
        pairs = [w for w in words if len(w) == 2]
        # phase 4 overlaps two pairs per round, phase 5 one: a forward beside the other
        # chunk's input-gradient backward
        assert len(pairs) == 2 * (m - 2 * pp + rank + 1) + (pp - rank - 1)
        for f, b in pairs:
            assert f[0] == "F" and b[0] == "I"
            assert {int(f[1:].split(".")[0]), int(b[1:].split(".")[0])} == set(chunks)
        for s in chunks:  # each chunk walks its microbatches in order, W after its I
            for k in "FIW":
                mbs = [int(t.split(".")[1]) for t in order if t.startswith(f"{k}{s}.")]
                assert mbs == list(range(m))
            for mb in range(m):
                assert order.index(f"W{s}.{mb}") > order.index(f"I{s}.{mb}")


def test_dualpipev_rejects_too_few_microbatches(dag0):
    with pytest.raises(ValueError, match="at least 2 x pp = 4"):
        schedules.dualpipev(cut(dag0.model.names, 4), microbatches=3)


def test_one_stage_schedules_reject_extra_stages(dag0):
    with pytest.raises(ValueError, match="one stage per device"):
        schedules.one_f_one_b(cut(dag0.model.names, 4), microbatches=2, pp=2)
