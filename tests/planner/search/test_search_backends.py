"""The Ray Tune backend and `--measure`: the same space and outputs as the embedded search,
trials spread over Ray; the best few predicted strategies run for real and re-ranked."""

from __future__ import annotations

import json
import signal

import optuna

from planner.cli import main
from tests.conftest import GPT, TINY


def run_json(capsys, argv):
    rc = main(argv)
    captured = capsys.readouterr()
    out = captured.out.strip().splitlines()
    assert len(out) == 1, (captured.out, captured.err[-3000:])
    return rc, json.loads(out[0]), captured.err


def test_ray_backend_writes_the_same_outputs_and_study(ray_session, tmp_path, capsys):
    handler = signal.getsignal(signal.SIGINT)
    rc, res, _ = run_json(capsys, ["search", GPT, *TINY, "--gpus", "2", "--trials", "3",
                                   "--backend", "ray", "--out", str(tmp_path), "--json"])
    assert rc == 0 and ray_session.is_initialized(), "a Ray it did not start stays up"
    assert signal.getsignal(signal.SIGINT) is handler, "Tune's Ctrl-C handler was left behind"
    for name in ("best_strategy.py", "best_strategy.json", "trials.csv", "summary.txt"):
        assert (tmp_path / name).is_file(), name
    study = optuna.load_study(study_name="piper-plan", storage=f"sqlite:///{tmp_path}/study.db")
    assert len(study.trials) == 3 and all(t.state.is_finished() for t in study.trials)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert res["trials"] == len(done) > 0
    assert all({"point", "summary", "program", "predicted"} <= set(t.user_attrs) for t in done)
    assert all(set(t.constraints) == {"memory"} for t in done)
    best = min((t for t in done if t.constraints["memory"] <= 0), key=lambda t: t.values[0])
    assert res["best"]["summary"] == best.user_attrs["summary"]
    assert_strategy_params(done)


TERMS = ("dp", "pp", "tp", "sp", "ep", "zero", "schedule", "virtual_stages", "microbatches",
         "recompute", "comm_stream", "bucket_mb")


def assert_strategy_params(trials) -> None:
    """What optuna-dashboard tabulates and plots (a trial's params) names the strategy in
    its own terms, equal to its summary, with one distribution per name across trials."""
    for t in trials:
        assert {k: t.params[k] for k in TERMS} == {k: t.user_attrs["summary"][k]
                                                   for k in TERMS}, t.number
    for k in TERMS:
        assert len({repr(t.distributions[k]) for t in trials}) == 1, k


def test_embedded_study_speaks_in_strategy_terms_and_marks_repeats(tmp_path, capsys):
    """The embedded backend keeps the same params; pp=1 points have the one schedule; a
    point asked again (samplers do repeat themselves) is marked `same_as` the first."""
    argv = ["search", GPT, *TINY, "--gpus", "2", "--trials", "6", "--out", str(tmp_path),
            "--json", "--seed", "1"]
    assert run_json(capsys, argv)[0] == 0
    study = optuna.load_study(study_name="piper-plan", storage=f"sqlite:///{tmp_path}/study.db")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert_strategy_params(done)
    assert all(t.params["schedule"] == "none" for t in done if t.params["pp"] == 1)
    # the same point again, as a sampler may ask it: scored once more, marked as a repeat
    first = done[0]
    study.enqueue_trial(first.params)
    argv[argv.index("--trials") + 1] = "1"
    assert run_json(capsys, argv)[0] == 0
    last = optuna.load_study(study_name="piper-plan",
                             storage=f"sqlite:///{tmp_path}/study.db").trials[-1]
    assert last.user_attrs.get("same_as") == first.number


def test_measure_runs_the_best_four_and_reranks_them(ray_session, tmp_path, capsys):
    rc, res, err = run_json(capsys, ["search", GPT, *TINY, "--gpus", "4", "--device", "cpu",
                                     "--measure", "4", "--trials", "16", "--out",
                                     str(tmp_path), "--json"])
    assert rc == 0
    measured = res["measured"]
    assert len(measured) == 4 and len({m["trial"] for m in measured}) == 4
    assert all(m["error"] is None and m["measured_step_time_s"] > 0 for m in measured)
    times = [m["measured_step_time_s"] for m in measured]
    assert times == sorted(times), "re-ranked by measured median step time"
    assert res["best"]["summary"] == measured[0]["summary"]
    assert res["best"]["measured"]["step_time_s"] == times[0]
    predicted = sorted(p["predicted_step_time_s"] for p in measured)
    assert all(m["predicted_step_time_s"] > 0 for m in measured) and predicted
    assert "predicted ms" in err and "measured ms" in err  # side by side on stderr
