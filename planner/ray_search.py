"""`--backend ray`: the same space and scoring, with trials spread over a Ray cluster.

Ray Tune drives the loop; its `OptunaSearch` asks the same define-by-run space through an
Optuna study in the same storage, so the study, the reports and `piper-plan show` read the
same as with the embedded backend. Each Tune trial scores one point with `search.score` on
whichever node runs it: the evaluator travels once through Ray's object store, with the
model already captured for every tensor/expert-parallel degree of the space, so no worker
traces the model again (each worker re-imports the model file, which must be at the same
path on every node).

Trials run concurrently, so a seed fixes the sampler's stream but not which results it has
seen when it asks: the embedded backend is the reproducible one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

import optuna
from ray import tune
from ray.tune.search.optuna import OptunaSearch

from planner.evaluate import Evaluator
from planner.records import OBJECTIVES, SearchResult, open_study, result_of
from planner.samplers import PointsSampler, make_sampler
from planner.search import (
    Scored,
    _check_not_empty,
    describe,
    fits,
    score,
    starting_points,
    store,
)
from planner.space import viable
from runtime.launcher import ensure_ray
from search_spaces import Infeasible, SearchSpace

CPUS_PER_TRIAL = 0.5
"""A trial is one single-threaded simulation; half a CPU lets two share a core's slack."""


def run_ray_search(evaluator: Evaluator, space: SearchSpace, *, trials: int,
                   timeout: float | None, sampler: str, storage: str, study_name: str,
                   seed: int | None, address: str | None, out: str) -> SearchResult:
    """Add `trials` trials to the study through Ray Tune (local Ray started on demand, or
    the cluster at `address`)."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    _check_not_empty(space)
    started = ensure_ray(address)
    try:
        # no heartbeat (it needs Study.optimize); RDB storages pickle with the searcher
        db = optuna.storages.get_storage(storage)
        study = open_study(db, study_name, create=True)  # checks its shape before Tune does
        describe(study, evaluator)
        earlier = len(study.trials)
        admissible = fits(evaluator, space)
        smp = make_sampler(sampler, space, None if seed is None else seed + earlier, trials,
                           admissible=admissible)
        if isinstance(smp, PointsSampler):
            trials = min(trials, len(smp))
        viable(space, evaluator)  # every slice captured here, once, before it ships
        define = _Define(space, dict(space.grid()) if sampler == "grid" else None)
        searcher = _Searcher(define, metric=list(OBJECTIVES), mode=["min"] * len(OBJECTIVES),
                             sampler=smp, study_name=study_name, storage=db, seed=seed,
                             capacity=evaluator.cluster.memory_bytes,
                             points_to_evaluate=starting_points(
                                 space, sampler, trials, earlier, admissible) or None)
        trainable = tune.with_resources(
            tune.with_parameters(_trial, evaluator=evaluator, space=space),
            {"cpu": CPUS_PER_TRIAL})
        start = time.perf_counter()
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(search_alg=searcher, num_samples=trials,
                                        time_budget_s=timeout),
            run_config=tune.RunConfig(name=study_name, verbose=0,
                                      storage_path=os.path.abspath(os.path.join(out, "ray"))),
        )
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # no banner: logs are ours
        # Tune installs a SIGINT handler of its own (a graceful stop) and leaves it behind
        # when no signal came: put ours back, so a later Ctrl-C interrupts again
        handler = signal.getsignal(signal.SIGINT)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # --json: stdout carries one object
                tuner.fit()
        finally:
            signal.signal(signal.SIGINT, handler)
        return result_of(open_study(db, study_name, create=False),
                         time.perf_counter() - start)
    finally:
        if started:
            import ray

            ray.shutdown()


class _Define:
    """The define-by-run space Tune's OptunaSearch asks (a class: the searcher is pickled)."""

    def __init__(self, space: SearchSpace, grid: dict[str, Any] | None) -> None:
        self.space, self.grid = space, grid

    def __call__(self, trial: Any) -> dict[str, Any]:
        point = ({k: trial.suggest_categorical(k, list(v)) for k, v in self.grid.items()}
                 if self.grid is not None else self.space.sample(trial))
        return {"point": point}


def _trial(config: dict[str, Any], evaluator: Evaluator, space: SearchSpace) -> dict[str, Any]:
    """One Tune trial: score the point; what happened travels in `piper` as JSON text (Tune
    flattens nested results), with NaN metrics for a point without figures (Tune wants every
    metric in every result)."""
    nan = {k: float("nan") for k in OBJECTIVES}
    try:
        s = score(evaluator, space, config["point"])
    except Infeasible as e:
        return {**nan, "piper": json.dumps({"pruned_reason": str(e)})}
    except Exception as e:  # noqa: BLE001 - recorded on the trial, as the embedded loop does
        lines = str(e).strip().splitlines()
        reason = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        return {**nan, "piper": json.dumps({"fail_reason": reason})}
    return {**dict(zip(OBJECTIVES, s.values, strict=True)),
            "piper": json.dumps({"point": s.point, "summary": s.summary, "program": s.program,
                                 "predicted": s.predicted})}


class _Searcher(OptunaSearch):
    """OptunaSearch that stores on each Optuna trial what the embedded loop stores (point,
    summary, Program, prediction, memory constraint), and prunes or fails it likewise."""

    def __init__(self, *args: Any, capacity: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._capacity = capacity

    def on_trial_complete(self, trial_id: str, result: dict | None = None,
                          error: bool = False) -> None:
        if trial_id in self._completed_trials:
            return
        ot_trial = self._ot_trials[trial_id]
        outcome = json.loads((result or {}).get("piper") or "{}")
        if "predicted" in outcome:
            s = Scored(outcome["point"], outcome["summary"], outcome["program"],
                       outcome["predicted"])
            ot_trial.set_user_attr("point", s.point)
            store(ot_trial, s, self._capacity)
            self._ot_study.tell(ot_trial, list(s.values))
        elif "pruned_reason" in outcome:
            ot_trial.set_user_attr("pruned_reason", outcome["pruned_reason"])
            self._ot_study.tell(ot_trial, state=optuna.trial.TrialState.PRUNED)
        else:
            reason = outcome.get("fail_reason", "the Tune trial raised (see Ray's logs)")
            ot_trial.set_user_attr("fail_reason", reason)
            print(f"trial {ot_trial.number} failed: {reason} (recorded in the study; the "
                  "search goes on)", file=sys.stderr, flush=True)
            self._ot_study.tell(ot_trial, state=optuna.trial.TrialState.FAIL)
        self._completed_trials.add(trial_id)
