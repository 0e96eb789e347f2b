"""Simulating one data-parallel replica of each kind gives the whole cluster's figures."""

from __future__ import annotations

import dataclasses

import pytest

import planner.search.evaluate
from cost_models import CATALOG
from piper import schedules
from piper.model_file import load_model_file
from piper.program import Program
from planner.search.evaluate import Evaluator
from planner.search.replicas import representative_replicas
from runtime.lowering.mesh import Mesh
from tests.conftest import GPT

# four devices per node: pp=2 x dp=3 puts device 0's replicas on node 0 and device 1's on
# nodes 0, 1, 1, so replica 0's pipeline stays in a node and replicas 1, 2 cross it
SMALL_NODES = dataclasses.replace(CATALOG["h100-80gb"], gpus_per_node=4)
TWO = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]
FOUR = [["embed", "layer.0"], ["layer.1"], ["layer.2"], ["layer.3", "head"]]


def test_replicas_of_one_kind_are_kept_once() -> None:
    assert representative_replicas(Mesh(2, 3), SMALL_NODES) == (0, 1)
    assert representative_replicas(Mesh(2, 64, tp=8), CATALOG["h100-80gb"]) == (0,)
    assert representative_replicas(Mesh(16, 128, tp=8), CATALOG["h100-80gb"]) == (0,)
    # tp=2 on 4-device nodes: device 0's replicas on nodes 0, 0, 1, device 1's on 1, 2, 2:
    # replicas 0 and 2 send one node on, replica 1 two
    assert representative_replicas(Mesh(2, 3, tp=2), SMALL_NODES) == (0, 1)
    # CPU ranks share cores: how many compute at once matters, so every replica stays
    shared = dataclasses.replace(CATALOG["cpu"], cores_per_node=2.0)
    assert representative_replicas(Mesh(2, 3), shared) == (0, 1, 2)


def _programs() -> list[tuple[str, Program, int]]:
    zb = schedules.with_comm_stream(schedules.with_buckets(
        schedules.build("zb1p", TWO, microbatches=4, dp=3, zero=2), 0.01), 2)
    return [
        ("1f1b dp3", schedules.build("1f1b", TWO, microbatches=4, dp=3), 6),
        ("zb1p zero2 buckets comm-stream", zb, 6),
        ("interleaved zero3 recompute", schedules.build(
            "interleaved-1f1b", FOUR, microbatches=4, dp=3, pp=2, zero=3, recompute=True), 6),
        ("tp2 zero1", schedules.shard(schedules.build("1f1b", TWO, microbatches=2, dp=3,
                                                      zero=1), tp=2), 12),
    ]


@pytest.mark.parametrize("name,program,gpus", _programs(), ids=[p[0] for p in _programs()])
def test_folded_simulation_equals_the_whole(name: str, program: Program, gpus: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_model_file(GPT, (("size", "tiny"),))
    folded = Evaluator(spec, gpus, 24, SMALL_NODES).evaluate(program)
    monkeypatch.setattr(planner.search.evaluate, "representative_replicas",
                        lambda mesh, cluster: tuple(range(mesh.dp)))
    whole = Evaluator(spec, gpus, 24, SMALL_NODES).evaluate(program)
    assert whole.plan.complete and not folded.plan.complete
    a, b = folded.prediction, whole.prediction
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    assert a.mfu == pytest.approx(b.mfu, rel=1e-12)
    assert a.tokens_per_s == pytest.approx(b.tokens_per_s, rel=1e-12)
    assert a.max_memory_bytes == b.max_memory_bytes
    # each kept rank predicts what the whole plan predicts for it
    whole_peak = dict(zip((rp.rank for rp in whole.plan.ranks), b.peak_memory_bytes,
                          strict=True))
    for rp, peak in zip(folded.plan.ranks, a.peak_memory_bytes, strict=True):
        assert peak == whole_peak[rp.rank]


def test_a_simulation_view_cannot_run() -> None:
    from runtime.cluster.launcher import Job

    spec = load_model_file(GPT, (("size", "tiny"),))
    view = Evaluator(spec, 6, 24, SMALL_NODES).evaluate(_programs()[0][1]).plan
    with pytest.raises(ValueError, match="simulation view"):
        Job(spec, view, batch_size=24, seed=0)
