"""Logical streams: the Stream directive moves collectives off the compute stream; the
scheduler turns cross-stream edges into waits; the dry run and simulator honour both."""

from __future__ import annotations

import pytest

import piper
from cost_models import CATALOG, model_costs, simulate
from piper import schedules
from piper.dag import Kind
from piper.model_file import load_model_file
from runtime.lowering.dryrun import dry_run
from runtime.lowering.plan import COMPUTE_STREAM
from runtime.lowering.scheduler import schedule
from tests.conftest import GPT

FOUR = [["embed", "layer.0"], ["layer.1"], ["layer.2"], ["layer.3", "head"]]


@pytest.fixture(scope="module")
def captured():
    return piper.capture(load_model_file(GPT, (("size", "tiny"),)), 1)


def with_stream(prog: piper.Program, kinds: str) -> piper.Program:
    return piper.Program([*prog.directives, piper.Stream(kinds, stream="comm")],
                         name=prog.name)


def test_collectives_move_to_their_stream_and_wait_for_their_backward(captured):
    dag0 = piper.single_device_dag(captured.graph)
    prog = with_stream(schedules.one_f_one_b(FOUR[:2] + [FOUR[2] + FOUR[3]], microbatches=4,
                                             dp=2, zero=2), "RS AG")
    plan = schedule(prog.apply(dag0))
    for rp in plan.ranks:
        streams = dict(rp.streams)
        assert set(streams) == {COMPUTE_STREAM, "comm"}
        assert all(t.kind in (Kind.REDUCE_SCATTER, Kind.ALL_GATHER) for t in streams["comm"])
        assert not any(t.group for t in streams[COMPUTE_STREAM])
        for t in streams["comm"]:
            if t.kind is Kind.REDUCE_SCATTER:  # waits for its microbatch's backward
                assert t.after == (f"B{t.stage}.{t.mb}",)
        update = [t for t in streams[COMPUTE_STREAM] if t.kind is Kind.UPDATE]
        assert all(t.after for t in update), "the update waits for the gradient shards"


def test_stream_directive_rejects_what_it_cannot_move(captured):
    dag0 = piper.single_device_dag(captured.graph)
    base = schedules.gpipe([FOUR[0] + FOUR[1], FOUR[2] + FOUR[3]], microbatches=2, dp=2,
                           zero=3)
    with pytest.raises(piper.DirectiveError, match="must stay on the compute stream"):
        with_stream(base, "AG").apply(dag0)
    with pytest.raises(piper.DirectiveError, match="kinds must be among"):
        with_stream(base, "F").apply(dag0)
    with pytest.raises(piper.PiperError, match="split over streams"):
        schedule(with_stream(base, "RS").apply(dag0))


def test_overlap_never_slows_the_simulated_step_and_hides_all_reduce(captured):
    dag0 = piper.single_device_dag(captured.graph)
    costs = model_costs(captured)
    cluster = CATALOG["a100-40gb"]
    prog = schedules.one_f_one_b(FOUR, microbatches=8, dp=2)
    plain = simulate(schedule(prog.apply(dag0)), costs, cluster, 4)
    plan = schedule(with_stream(prog, "AR").apply(dag0))
    overlapped = simulate(plan, costs, cluster, 4)
    assert overlapped.step_time_s <= plain.step_time_s + 1e-12
    spans = dry_run(plan)
    comm = [s for s in spans if s.stream == "comm"]
    assert comm and all(s.task.kind is Kind.ALL_REDUCE for s in comm)


def test_measured_trace_shows_each_stream(ray_session, tmp_path, capsys):
    import json

    from planner.cli import main
    from tests.conftest import TINY

    trace = tmp_path / "t.json"
    rc = main(["run", GPT, *TINY, "--gpus", "2", "--dp", "2", "--microbatches", "2",
               "--comm-stream", "--steps", "1", "--device", "cpu", "--trace", str(trace)])
    capsys.readouterr()
    assert rc == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    by_stream = {(e["tid"], e["name"]) for e in events}
    assert {("comm", "AR0"), (COMPUTE_STREAM, "U0")} <= by_stream
