"""The scheduler's Plans: per-rank orders follow the Order directives, and the dry run
refuses plans that would deadlock."""

from __future__ import annotations

import pytest

import piper
from piper import schedules
from piper.dag import Kind
from piper.model_file import load_model_file
from runtime.lowering.dryrun import DeadlockError, dry_run
from runtime.lowering.plan import COMPUTE_STREAM, PAIR_STREAM, Plan, RankPlan, Task
from runtime.lowering.scheduler import schedule
from tests.conftest import GPT

TWO = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]


@pytest.fixture(scope="module")
def dag0():
    cap = piper.capture(load_model_file(GPT, (("size", "tiny"),)), 2)
    return piper.single_device_dag(cap.graph)


def chunks(plan: Plan, rank: int) -> list[str]:
    return [t.name for t in plan.ranks[rank].tasks if t.kind in (Kind.FWD, Kind.BWD)]


@pytest.mark.parametrize("sched", ["gpipe", "1f1b"])
def test_rank_order_is_the_order_directive(dag0, sched):
    prog = schedules.build(sched, TWO, microbatches=4, dp=2)
    plan = schedule(prog.apply(dag0))
    orders = [d for d in prog.directives if isinstance(d, piper.Order)]
    for rp in plan.ranks:
        assert chunks(plan, rp.rank) == orders[rp.device].tasks.split()


def test_sends_follow_producer_and_recvs_precede_consumer(dag0):
    plan = schedule(schedules.one_f_one_b(TWO, microbatches=4).apply(dag0))
    for rp in plan.ranks:
        ts = rp.tasks
        for i, t in enumerate(ts):
            if t.kind is Kind.SEND:
                prev = ts[i - 1]
                assert prev.kind is (Kind.BWD if t.grad else Kind.FWD) and prev.mb == t.mb
            if t.kind is Kind.RECV:
                nxt = ts[i + 1]
                assert nxt.kind is (Kind.BWD if t.grad else Kind.FWD) and nxt.mb == t.mb


def test_allreduce_after_last_backward_then_update(dag0):
    plan = schedule(schedules.gpipe(TWO, microbatches=2, dp=2).apply(dag0))
    assert plan.groups == ((0, 1), (2, 3))
    for rp in plan.ranks:
        names = [t.name for t in rp.tasks]
        s = rp.device
        assert names[-2:] == [f"AR{s}", f"U{s}"]
        assert names.index(f"AR{s}") > max(names.index(f"B{s}.{m}") for m in range(2))


def test_one_f_one_b_keeps_at_most_pp_microbatches_in_flight(dag0):
    four = [["embed"], ["layer.0", "layer.1"], ["layer.2"], ["layer.3", "head"]]
    plan = schedule(schedules.one_f_one_b(four, microbatches=8).apply(dag0))
    for rp in plan.ranks:
        live = peak = 0
        for t in rp.tasks:
            live += {Kind.FWD: 1, Kind.BWD: -1}.get(t.kind, 0)
            peak = max(peak, live)
        assert peak == 4 - rp.device


def test_dry_run_detects_crafted_deadlock():
    """Both ranks wait to receive before they send: the classic P2P deadlock."""
    recv0 = Task(Kind.RECV, 0, 0, peer=1, values=("x",), tag=0, name="RECV_B1>0.0")
    send0 = Task(Kind.SEND, 0, 0, peer=1, values=("x",), tag=10, name="SEND_F0>1.0")
    recv1 = Task(Kind.RECV, 1, 0, peer=0, values=("x",), tag=10, name="RECV_F0>1.0")
    send1 = Task(Kind.SEND, 1, 0, peer=0, values=("x",), tag=0, name="SEND_B1>0.0")
    ranks = (RankPlan(0, 0, 0, (0,), ((COMPUTE_STREAM, (recv0, send0)),)),
             RankPlan(1, 1, 0, (1,), ((COMPUTE_STREAM, (recv1, send1)),)))
    plan = Plan(model=None, stage_regions=(), stage_device=(0, 1), output_stage=1, pp=2, dp=1,
                microbatches=1, ranks=ranks, groups=())
    with pytest.raises(DeadlockError, match=r"rank 0 at RECV_B1>0.0 \(from rank 1\)"):
        dry_run(plan)
    ok = (RankPlan(0, 0, 0, (0,), ((COMPUTE_STREAM, (send0, recv0)),)), ranks[1])
    dry_run(Plan(model=None, stage_regions=(), stage_device=(0, 1), output_stage=1, pp=2,
                 dp=1, microbatches=1, ranks=ok, groups=()))


def test_dry_run_detects_mismatched_collective_order():
    a0 = Task(Kind.ALL_REDUCE, 0, group=(0, 1), name="AR0")
    a1 = Task(Kind.ALL_REDUCE, 1, group=(0, 1), name="AR1")
    send = Task(Kind.SEND, 0, 0, peer=1, tag=0, name="SEND")
    recv = Task(Kind.RECV, 1, 0, peer=0, tag=0, name="RECV")
    # rank 1 enters the collective only after a message rank 0 sends after the collective
    ranks = (RankPlan(0, 0, 0, (0,), ((COMPUTE_STREAM, (a0, send)),)),
             RankPlan(1, 0, 1, (0,), ((COMPUTE_STREAM, (recv, a1)),)))
    plan = Plan(model=None, stage_regions=(), stage_device=(0,), output_stage=0, pp=1, dp=2,
                microbatches=1, ranks=ranks, groups=((0, 1),))
    with pytest.raises(DeadlockError, match="rank 0 at AR0"):
        dry_run(plan)


def test_cross_device_order_cycle_names_both_orders(dag0):
    """Device 0 wants B0.0 before F0.1 (fine alone), device 1 wants F1.1 before B1.0: the
    gradient of microbatch 0 then waits for a forward that waits for it."""
    ds = [piper.Place(tuple(r), stage=s, device=s) for s, r in enumerate(TWO)]
    prog = piper.Program(ds + [piper.Split(2), piper.Order(0, "F0.0 B0.0 F0.1 B0.1"),
                               piper.Order(1, "F1.0 F1.1 B1.0 B1.1")])
    with pytest.raises(piper.DirectiveError, match=r"cycle .*Order directives \[3, 4\]"):
        prog.apply(dag0)


def test_pair_backward_runs_on_the_pair_lane_with_its_messages(dag0):
    four = [["embed", "layer.0"], ["layer.1"], ["layer.2"], ["layer.3", "head"]]
    prog = schedules.dualpipev(four, microbatches=4)
    plan = schedule(prog.apply(dag0))  # the dry run passes
    words = {w for d in prog.directives if isinstance(d, piper.Order) for w in d.words}
    pairs = {b: f for f, b in (w for w in words if len(w) == 2)}
    assert plan.paired and pairs
    for rp in plan.ranks:
        lane = rp.stream(PAIR_STREAM)
        backward = [t for t in lane if t.kind.is_chunk]
        assert {t.name for t in backward} == {b for b in pairs if int(b[1:].split(".")[0])
                                              in rp.stages}
        assert all(t.pair == pairs[t.name] for t in backward)
        # a backward's own sends and receives travel with it; nothing else is on the lane
        assert {t.kind for t in lane} <= {Kind.BWD_I, Kind.SEND, Kind.RECV}
        for t in lane:
            if t.kind.is_p2p:
                assert t.grad and any(b.mb == t.mb for b in backward)
        compute = rp.stream(COMPUTE_STREAM)
        for b in backward:  # what follows the pair on the compute lane waits for it
            f = next(i for i, t in enumerate(compute) if t.name == b.pair)
            nxt = next(t for t in compute[f + 1:] if t.kind.is_chunk)
            assert b.name in nxt.after
