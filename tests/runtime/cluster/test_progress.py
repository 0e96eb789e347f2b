"""The progress board (`runtime.cluster.progress`): what a rank last said, through Ray."""

from __future__ import annotations

import time

from runtime.cluster.progress import PUSH_S, Reporter, board, read


def test_a_rank_report_reaches_the_board_and_ages(ray_session):
    b = board()
    r = Reporter(b, rank=3, node="10.0.0.7")
    try:
        r.phase("step 2")
        r.task("compute", "F1.0")
        r.task("comm", "AR1")
        end = time.monotonic() + 10
        while time.monotonic() < end:
            p = read(b).get(3)
            if p and p.tasks.get("comm") == "AR1":
                break
            time.sleep(PUSH_S)
        assert p.phase == "step 2" and p.node == "10.0.0.7" and p.pid > 0
        assert p.describe() == ("during step 2 while running task F1.0 (compute stream), "
                                "AR1 (comm stream)")
        assert not p.silent
        r.phase("after step 2")
        time.sleep(5 * PUSH_S)
        assert read(b)[3].describe() == "after step 2"
        r.close()
        time.sleep(3 * PUSH_S)
        before = read(b)[3].age_s
        time.sleep(1.5)
        assert read(b)[3].age_s >= before + 1.0  # a closed reporter is silent
    finally:
        r.close()
        ray_session.kill(b)


def test_an_unreadable_board_says_nothing(ray_session):
    b = board()
    ray_session.kill(b)
    assert read(b, timeout_s=2.0) == {}
