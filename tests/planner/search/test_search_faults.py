"""A search loses nothing to faults: a trial that raises (MemoryError included) is recorded as
failed with its reason and the search goes on; a search killed with SIGKILL resumes from its
SQLite study with every finished trial kept."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time

import optuna

from cost_models import CATALOG
from piper.model_file import load_model_file, parse_model_args
from piper.program import Program
from planner.search.evaluate import Evaluation, Evaluator
from planner.search.loop import run_search
from search_spaces import PipelineSpace
from tests.conftest import GPT, ROOT, TINY


class OutOfMemoryOnPP2(Evaluator):
    """A real evaluator, except that two-stage pipelines run out of memory while scored."""

    def evaluate(self, program: Program) -> Evaluation:
        if program.summary()["pp"] == 2:
            raise MemoryError("simulated: the simulator ran out of host memory")
        return super().evaluate(program)


def test_failed_trials_are_recorded_with_their_reason_and_the_search_goes_on(tmp_path,
                                                                             capsys):
    spec = load_model_file(GPT, parse_model_args(["size=tiny"]))
    ev = OutOfMemoryOnPP2(spec, 4, 32, CATALOG["cpu"])
    space = PipelineSpace(ev.captured.graph.names, ev.region_costs(), 4, 32,
                          schedules=("1f1b",), max_microbatches=4)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    result = run_search(ev, space, trials=100, timeout=None, sampler="grid", storage=storage,
                        study_name="s", seed=0, progress=False)
    trials = optuna.load_study(study_name="s", storage=storage).trials
    failed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(trials) == 3 * 3, "pp in {1, 2, 4} x microbatches in {1, 2, 4}: all tried"
    assert {t.params["pp"] for t in failed} == {2} and len(failed) == 3
    assert all(t.user_attrs["fail_reason"] == "MemoryError: simulated: the simulator ran out "
               "of host memory" for t in failed)
    assert result.failed_trials == 3 and result.trials == 6
    assert result.best is not None and result.best.summary["pp"] != 2
    err = capsys.readouterr().err
    assert err.count("failed: MemoryError") == 3 and "Traceback" not in err


def _finished(db) -> dict[int, tuple]:
    """number -> (state, params, value) of every finished trial in the study file (not one
    running, nor one waiting: the expert defaults a new study enqueues)."""
    if not db.exists():
        raise sqlite3.OperationalError("no study yet")
    with sqlite3.connect(db) as c:
        rows = c.execute("select t.trial_id, t.number, t.state, v.value from trials t left "
                         "join trial_values v on v.trial_id = t.trial_id "
                         "where t.state not in ('RUNNING', 'WAITING')").fetchall()
        params = c.execute("select trial_id, param_name, param_value from trial_params"
                           ).fetchall()
    by_id = {}
    for tid, name, value in params:
        by_id.setdefault(tid, {})[name] = value
    return {n: (state, by_id.get(tid, {}), v) for tid, n, state, v in rows}


def _completed(db) -> int:
    try:
        return sum(s == "COMPLETE" for s, _, _ in _finished(db).values())
    except sqlite3.OperationalError:  # not created yet, or being written
        return 0


def test_killed_search_resumes_with_every_finished_trial(tmp_path):
    out = tmp_path / "out"
    db = out / "study.db"
    cmd = [sys.executable, "-m", "planner.cli", "search", GPT, *TINY, "--gpus", "4",
           "--trials", "16", "--cluster", "cpu", "--seed", "1", "--out", str(out), "--json"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and p.poll() is None:
            if _completed(db) >= 2:
                break
            time.sleep(0.05)
        assert p.poll() is None, "the first search ended before it could be killed"
        print(f"killed after {len(_finished(db))} finished trials")
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    before = _finished(db)
    assert sum(s == "COMPLETE" for s, _, _ in before.values()) >= 2
    assert len(before) < 16, "killed part way"

    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode in (0, 1), r.stderr
    assert f"resuming study 'piper-plan': {len(before)} finished trials kept" in r.stderr
    after = _finished(db)
    assert len(after) >= len(before) + 16, "the rerun added its trials to the same study"
    assert all(after[n] == t for n, t in before.items()), "every finished trial is kept"
    res = json.loads(r.stdout)
    assert res["trials"] == sum(s == "COMPLETE" for s, _, _ in after.values())
