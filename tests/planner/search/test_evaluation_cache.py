"""The Evaluator's cache: an equal Program is served without re-simulating; anything the
prediction depends on (here the cluster) changes the key."""

from __future__ import annotations

import dataclasses

import pytest

import planner.search.evaluate
from cost_models import CATALOG
from piper import schedules
from piper.model_file import load_model_file
from piper.program import Program
from planner.search.cache import EvaluationCache, evaluation_key
from planner.search.evaluate import Evaluator
from tests.conftest import GPT

TWO = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]


@pytest.fixture(scope="module")
def evaluator() -> Evaluator:
    return Evaluator(load_model_file(GPT, (("size", "tiny"),)), 2, 8, CATALOG["h100-80gb"])


@pytest.fixture
def simulations(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every plan the Evaluator hands to the simulator."""
    calls: list[object] = []
    real = planner.search.evaluate.simulate

    def counting(plan: object, *args: object, **kwargs: object) -> object:
        calls.append(plan)
        return real(plan, *args, **kwargs)
    monkeypatch.setattr(planner.search.evaluate, "simulate", counting)
    return calls


def program() -> Program:
    """Built afresh each call: equal to, but not the same object as, the last one."""
    return schedules.build("1f1b", TWO, microbatches=4)


def test_an_equal_program_is_served_from_the_cache(evaluator: Evaluator,
                                                   simulations: list[object]) -> None:
    evaluator.cache = EvaluationCache()
    first = evaluator.evaluate(program())
    second = evaluator.evaluate(Program.from_json(program().to_json()))
    assert len(simulations) == 1
    assert second is first
    assert (evaluator.cache.hits, evaluator.cache.misses) == (1, 1)


def test_another_cluster_misses_a_shared_cache(evaluator: Evaluator,
                                               simulations: list[object]) -> None:
    evaluator.cache = EvaluationCache()
    fast = evaluator.evaluate(program())
    slow_cluster = dataclasses.replace(evaluator, cluster=CATALOG["a100-40gb"])
    assert slow_cluster.cache is evaluator.cache
    slow = slow_cluster.evaluate(program())
    assert len(simulations) == 2
    assert slow.prediction.step_time_s > fast.prediction.step_time_s
    assert slow_cluster.evaluate(program()) is slow and len(simulations) == 2


def test_key_is_stable_text_and_names_every_input(evaluator: Evaluator) -> None:
    graph, costs, c = evaluator.captured.graph, evaluator.costs, evaluator.cluster
    key = evaluation_key(program(), graph, costs, c, 2, 2)
    assert key == evaluation_key(program(), graph, costs, c, 2, 2)
    assert len(key) == 64 and int(key, 16) >= 0
    others = {
        evaluation_key(schedules.build("gpipe", TWO, microbatches=4), graph, costs, c, 2, 2),
        evaluation_key(program(), graph, costs, CATALOG["h200"], 2, 2),
        evaluation_key(program(), graph, costs, c, 4, 2),
        evaluation_key(program(), graph, costs, c, 2, 4),
        evaluation_key(program(), graph, dataclasses.replace(costs, batch=2), c, 2, 2),
    }
    assert key not in others and len(others) == 5


def test_cache_keeps_the_most_recently_used_entries() -> None:
    cache: EvaluationCache[int] = EvaluationCache(size=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)  # evicts b, the least recently used
    assert (cache.get("b"), cache.get("a"), cache.get("c"), len(cache)) == (None, 1, 3, 2)


def test_bucket_variants_share_a_schedule_and_price_their_own_cap() -> None:
    spec = load_model_file(GPT, (("size", "tiny"),))
    stages = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]
    plain = schedules.build("1f1b", stages, microbatches=2, dp=2, zero=2)
    bucketed = schedules.with_buckets(plain, 0.001)
    shared = Evaluator(spec, 4, 8, CATALOG["h100-80gb"])
    a, b = shared.evaluate(plain), shared.evaluate(bucketed)
    assert b.plan.bucket_bytes == round(0.001 * 2**20) and a.plan.bucket_bytes == 0
    assert b.plan.ranks is a.plan.ranks, "one schedule for both caps"
    fresh = Evaluator(spec, 4, 8, CATALOG["h100-80gb"]).evaluate(bucketed)
    assert b.prediction.step_time_s == fresh.prediction.step_time_s
    assert b.prediction.peak_memory_bytes == fresh.prediction.peak_memory_bytes
    assert b.prediction.step_time_s != a.prediction.step_time_s
    # sequence parallelism too: the same tasks, priced with the sequence split
    tp = schedules.shard(schedules.build("1f1b", stages, microbatches=2, dp=1), tp=2)
    tp_sp = schedules.shard(schedules.build("1f1b", stages, microbatches=2, dp=1), tp=2,
                            sp=True)
    c, d = shared.evaluate(tp), shared.evaluate(tp_sp)
    assert d.plan.ranks is c.plan.ranks and d.plan.sharding.sp and not c.plan.sharding.sp
    fresh_sp = Evaluator(spec, 4, 8, CATALOG["h100-80gb"]).evaluate(tp_sp)
    assert d.prediction.step_time_s == fresh_sp.prediction.step_time_s


def test_the_model_on_another_cluster_and_size_shares_its_captures() -> None:
    spec = load_model_file(GPT, (("size", "tiny"),))
    stages = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]
    prog = schedules.shard(schedules.build("1f1b", stages, microbatches=2, dp=2), tp=2)
    base = Evaluator(spec, 8, 8, CATALOG["h100-80gb"])
    base.evaluate(schedules.build("1f1b", stages, microbatches=2, dp=4))
    base.sharded_costs(base.skeleton(prog).sharding)
    moved = base.on(CATALOG["a100-40gb"], 8, 16)
    assert moved.captured is base.captured and moved._sharded is base._sharded
    fresh = Evaluator(spec, 8, 16, CATALOG["a100-40gb"]).evaluate(prog)
    got = moved.evaluate(prog)
    assert got.prediction.step_time_s == fresh.prediction.step_time_s
    assert got.prediction.peak_memory_bytes == fresh.prediction.peak_memory_bytes
