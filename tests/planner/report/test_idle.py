"""Where a step waits (`planner.report.idle`), and how the timeline groups ranks alike
(`planner.report.plots`) and names the ranks a simulated one stands for (`planner.search.replicas`)."""

from __future__ import annotations

import dataclasses

from cost_models import CATALOG
from piper import schedules
from piper.dag import Kind
from piper.model_file import load_model_file
from planner.report.idle import idle_by_rank, idle_share, minus, union
from planner.report.plots import _same_ranks, ranks_text
from planner.search.evaluate import Evaluator
from planner.search.replicas import stands_for
from runtime.lowering.dryrun import Span
from runtime.lowering.plan import Task
from tests.conftest import GPT


def span(rank: int, kind: Kind, a: float, b: float, stream: str = "compute") -> Span:
    return Span(rank, stream, Task(kind, 0, 0), a, b)


def test_interval_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert minus([(0, 10)], [(1, 2), (5, 12)]) == [(0, 1), (2, 5)]
    assert minus([(0, 1), (4, 6)], [(0.5, 5)]) == [(0, 0.5), (5, 6)]


def test_compute_exposed_communication_and_bubble_split_the_step():
    spans = [span(0, Kind.FWD, 0, 2), span(0, Kind.ALL_REDUCE, 1, 4, "comm"),
             span(0, Kind.RECV, 4, 6), span(0, Kind.UPDATE, 6, 7),
             span(1, Kind.FWD, 0, 10)]
    idle = idle_by_rank(spans)
    r0 = idle[0]
    assert r0.step_s == 10
    assert r0.compute == ((0, 2), (6, 7))
    assert r0.exposed == ((2, 4),)  # the all-reduce where nothing computes
    assert r0.bubble == ((4, 6), (7, 10))  # a RECV's wait is bubble, not communication
    assert idle[1].bubble == () and idle[1].exposed == ()
    bubble, exposed = idle_share(idle)
    assert bubble == 5 / 20 and exposed == 2 / 20


def test_alike_ranks_are_one_row_labelled_with_every_rank_they_stand_for():
    spec = load_model_file(GPT, (("size", "tiny"),))
    names = Evaluator(spec, 1, 8, CATALOG["cpu"]).captured.graph.names
    cut = [list(names[:3]), list(names[3:])]
    # where ranks share a node's cores every replica is simulated: alike ones are grouped
    shared = dataclasses.replace(CATALOG["cpu"], cores_per_node=64)
    cpu = Evaluator(spec, 4, 8, shared)
    ev = cpu.evaluate(schedules.build("1f1b", cut, microbatches=4, dp=2, pp=2))
    assert ev.plan.complete
    assert _same_ranks(list(ev.prediction.spans)) == [(0, 1), (2, 3)]
    # on GPUs one replica of each kind is simulated and stands for the rest
    gpu = Evaluator(spec, 16, 16, CATALOG["h100-80gb"])
    ev = gpu.evaluate(schedules.build("1f1b", cut, microbatches=2, dp=8, pp=2))
    shown = {s.rank for s in ev.prediction.spans}
    assert shown == {0, 8}
    assert stands_for(ev.plan, gpu.cluster) == {0: tuple(range(8)), 8: tuple(range(8, 16))}


def test_ranks_read_short():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text(list(range(16))) == "ranks 0-15"
    assert ranks_text(list(range(0, 64, 4))) == "ranks 0, 4, ..., 60 (16)"
    assert ranks_text([1, 2, 5]) == "ranks 1, 2, 5"
