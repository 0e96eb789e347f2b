"""Overlapped pairs on real workers: which thread runs a pair's backward.

Losses of dualpipev (which pairs F with I in its steady state) against single-device
training are in test_equivalence.py, dense and with expert parallelism; here the measured
timeline shows the CPU hand-over rule of `piper.lanes`: a dense model's backwards run right
after their forwards in the compute thread, while with expert parallelism the pair thread
takes them as soon as the forward waits in its all-to-all."""

from __future__ import annotations

from piper import schedules
from piper.capture import capture
from piper.model_file import load_model_file
from runtime.cluster.launcher import run
from runtime.lowering.lower import lower
from runtime.lowering.plan import PAIR_STREAM
from tests.conftest import GPT, ROOT

MOE = str(ROOT / "examples" / "moe.py")
TINY = (("size", "tiny"),)


def _paired_backwards(path: str, gpus: int, ep: int) -> tuple[int, int]:
    """(backwards the pair thread ran, backwards the plan pairs) over one run's last step."""
    spec = load_model_file(path, TINY)
    regions = capture(spec, 2).graph.names
    stages = [list(regions[: 2]), list(regions[2:3]), list(regions[3:4]), list(regions[4:])]
    prog = schedules.build("dualpipev", stages, microbatches=4, pp=2, dp=gpus // 2)
    prog = schedules.shard(prog, ep=ep, expert_regions=tuple(r for r in regions
                                                              if r.startswith("experts")))
    plan = lower(spec, prog, gpus, 8)
    result = run(spec, plan, batch_size=8, steps=2, seed=0)
    paired = sum(1 for rp in plan.ranks for t in rp.stream(PAIR_STREAM) if t.kind.is_chunk)
    stolen = sum(1 for s in result.spans if s.stream == PAIR_STREAM and s.task.kind.is_chunk)
    return stolen, paired


def test_dense_pairs_run_in_the_forwards_thread(ray_session):
    stolen, paired = _paired_backwards(GPT, 2, 1)
    assert paired > 0 and stolen == 0


def test_expert_all_to_all_hands_the_backward_to_the_pair_thread(ray_session):
    stolen, paired = _paired_backwards(MOE, 4, 2)
    assert paired > 0 and stolen > 0
