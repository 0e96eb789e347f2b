"""The compute token of overlapped pairs: who runs a pair's backward, and when the other
lane may compute."""

from __future__ import annotations

import threading
import time

from piper import lanes
from piper.lanes import ComputeToken, computing, waiting


def test_forward_lane_claims_the_backward_unless_it_was_stolen() -> None:
    token = ComputeToken()
    assert token.claim("F0.0")
    assert not token.claim("F0.0")  # one thread per backward
    assert token.steal("F0.0", 0.01) is False  # the pair lane sees it taken
    assert token.steal("F0.1", 0.01) is None  # nothing to do yet: the forward lane computes
    token.reset()
    assert token.claim("F0.0")  # a new step frees every pair


def test_pair_lane_steals_while_the_forward_lane_waits_on_communication() -> None:
    token = ComputeToken()
    got: list[bool | None] = []
    thief = threading.Thread(target=lambda: got.append(token.steal("F0.0", 5.0)))
    thief.start()
    time.sleep(0.05)
    assert not got  # the forward lane is computing (not waiting): no steal
    with token.idle():
        thief.join(5.0)
    assert got == [True]
    assert not token.claim("F0.0")  # the forward lane then leaves it alone


def test_an_in_graph_collective_hands_the_token_over_while_it_waits() -> None:
    token = ComputeToken()
    order: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def forward() -> None:
        with computing(token):
            order.append("F starts")
            with waiting():  # e.g. the expert all-to-all of the forward
                inside.set()
                release.wait(5.0)
            order.append("F resumes")

    def backward() -> None:
        assert token.steal("F", 5.0)  # the forward lane waits: the backward may go
        with lanes.lane(1), computing(token):
            order.append("B computes")
            release.set()
            time.sleep(0.05)  # F's collective is done now, but B holds the token
            order.append("B ends")

    f = threading.Thread(target=forward)
    b = threading.Thread(target=backward)
    f.start()
    inside.wait(5.0)
    b.start()
    f.join(5.0)
    b.join(5.0)
    assert order == ["F starts", "B computes", "B ends", "F resumes"]


def test_lane_of_a_thread_defaults_to_the_compute_lane() -> None:
    assert lanes.current() == 0
    with lanes.lane(1):
        assert lanes.current() == 1
        seen: list[int] = []
        t = threading.Thread(target=lambda: seen.append(lanes.current()))
        t.start()
        t.join()
        assert seen == [0]  # per thread
    assert lanes.current() == 0


def test_claims_wake_the_pair_lane_only_when_the_forward_lane_is_done() -> None:
    token = ComputeToken()
    seen: list[bool | None] = []
    thief = threading.Thread(target=lambda: seen.append(token.steal("F0.0", 5.0)))
    thief.start()
    token.claim("F0.0")
    time.sleep(0.05)
    assert not seen  # a claim alone does not switch threads
    token.wake()
    thief.join(5.0)
    assert seen == [False]
