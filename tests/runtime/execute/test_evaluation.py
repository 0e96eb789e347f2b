"""Evaluation on held-out data under a strategy: the forwards of its plan alone, the same
loss as single-device evaluation, shown beside the step and logged as eval_loss."""

from __future__ import annotations

import json

import pytest

from piper import schedules
from piper.capture import capture
from piper.dag import Kind
from piper.model_file import load_model_file, parse_model_args
from planner.cli import main
from runtime.execute.evaluation import forward_order
from runtime.lowering.lower import lower
from runtime.train.data import write_synthetic_tokens
from tests.conftest import GPT, TINY

STRATEGIES = {
    # an overlapped pair's lane, sequence-parallel gathers, recompute
    "dualpipev_tp2_sp": ["--tp", "2", "--sp", "--pp", "2", "--schedule", "dualpipev",
                         "--microbatches", "4", "--recompute"],
    # two stages per rank, ZeRO-3 gathers before each forward
    "interleaved_zero3": ["--pp", "2", "--dp", "2", "--zero", "3", "--schedule",
                          "interleaved-1f1b", "--microbatches", "4"],
}


def test_the_forward_order_keeps_forwards_their_gathers_and_activation_messages():
    spec = load_model_file(GPT, parse_model_args(["size=tiny"]))
    names = capture(spec, 1).graph.names
    prog = schedules.build("1f1b", [names[:3], names[3:]], microbatches=2, dp=2, zero=3)
    plan = lower(spec, prog, 4, 8)
    first, last = (forward_order(next(rp for rp in plan.ranks if rp.stages == (s,)))
                   for s in (0, 1))
    assert [t.name for t in first] == ["AG_F0.0", "F0.0", "SEND_F0>1.0",
                                       "AG_F0.1", "F0.1", "SEND_F0>1.1"]
    assert [t.kind for t in last if t.kind is not Kind.ALL_GATHER] == [
        Kind.RECV, Kind.FWD, Kind.RECV, Kind.FWD]
    assert not any(t.grad for t in first + last)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    return [write_synthetic_tokens(str(d / n), 20_000, vocab=128, seed=s)
            for n, s in (("a.bin", 1), ("b.bin", 2), ("held.bin", 3))], d


@pytest.mark.parametrize("case", sorted(STRATEGIES))
def test_eval_loss_under_a_strategy_is_single_device_eval_loss(capsys, data, case):
    (a, b, held), folder = data
    logs = folder / case
    rc = main(["run", GPT, *TINY, "--gpus", "4", *STRATEGIES[case], "--steps", "3",
               "--launcher", "local", "--data", f"0.7:{a}", f"0.3:{b}", "--eval-data", held,
               "--eval-every", "2", "--eval-steps", "2", "--log-dir", str(logs), "--check",
               "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert rc == 0 and out["check"]["passed"], out.get("check")
    assert [("eval_loss" in s) for s in out["steps"]] == [False, True, True]
    shown = [line for line in captured.err.splitlines() if "eval-loss" in line]
    assert [line.split("/")[0] for line in shown] == ["step 2", "step 3"]
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("eval_loss") for r in rows] == [s.get("eval_loss") for s in out["steps"]]
    # both strategies read the same blended batches and evaluate the same held-out ones
    data[1].joinpath(f"{case}.json").write_text(json.dumps(out["steps"]))
    others = [json.loads(p.read_text()) for p in folder.glob("*.json")]
    for other in others:
        for mine, theirs in zip(out["steps"], other, strict=True):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
            assert mine.get("eval_loss") == pytest.approx(theirs.get("eval_loss"), rel=1e-4)


def test_eval_data_needs_token_data(capsys, data):
    (_, _, held), _ = data
    assert main(["run", GPT, *TINY, "--gpus", "2", "--dp", "2", "--eval-data", held]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --eval-data needs --data")
