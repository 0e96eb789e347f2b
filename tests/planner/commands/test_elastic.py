"""`run --elastic`'s arithmetic: the checkpoint interval it advises (Young/Daly at Meta's
Llama 3 failure rate) and the device counts a re-plan tries."""

from __future__ import annotations

from planner.commands.elastic import Change, checkpoint_advice, fewer


def test_the_advised_interval_is_young_daly_at_metas_failure_rate() -> None:
    # 16,384 devices fail every 54 days / 419 = 11,135 s; sqrt(2 x 2 s x 11,135 s) = 211 s
    said = checkpoint_advice(2.0, 0.5, 16384, 100)
    assert "every 3 h" in said and "is 211 s: --checkpoint-every 422 (now 100)" in said
    # four times the devices fail four times as often: half the interval
    assert "--checkpoint-every 211 " in checkpoint_advice(2.0, 0.5, 4 * 16384, 100)


def test_a_change_says_where_it_goes_on_from_and_what_it_lost() -> None:
    s = {"dp": 2, "pp": 2, "tp": 1, "ep": 1, "zero": 0, "schedule": "1f1b",
         "virtual_stages": 1, "microbatches": 4, "recompute": False}
    c = Change("node 10.0.0.2 lost", 4, 1, 4, 2, s, {**s, "pp": 1}, 0.2, None)
    assert c.line().startswith("elastic: node 10.0.0.2 lost after step 5: from the "
                               "checkpoint of step 4 (1 step lost) on 2 devices, was 4: dp=2 "
                               "pp=1")
    assert c.record()["event"] == "replan" and c.record()["new_gpus"] == 2
    assert fewer(3) == [3, 2, 1]


def test_a_free_checkpoint_advises_every_step() -> None:
    assert "--checkpoint-every 1 " in checkpoint_advice(0.0, 0.5, 8, 10)
