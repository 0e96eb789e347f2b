"""`--backend ray`: the same space and scoring, with trials spread over a Ray cluster.

Ray Tune drives the loop; its `OptunaSearch` asks the same define-by-run space through an
Optuna study in the same storage, so the study, the reports and `piper-plan show` read the
same as with the embedded backend. Each Tune trial scores one point with `search.score` on
whichever node runs it: the evaluator travels once through Ray's object store, with the
model already captured for every tensor/expert-parallel degree of the space, so no worker
traces the model again (each worker re-imports the model file, which a cluster run ships
with the job: `runtime.cluster.join`). Each trial records the node it ran on (`node`).

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

from planner.search.evaluate import Evaluator
from planner.search.loop import (
    DoesNotFit,
    SameStrategy,
    Scored,
    check_not_empty,
    describe,
    fits,
    open_storage,
    score,
    set_strategy_params,
    starting_points,
    store,
    strategy_params,
)
from planner.search.records import OBJECTIVES, SearchResult, open_study, result_of
from planner.search.samplers import PointsSampler, make_sampler
from planner.search.space import viable
from runtime.cluster.join import connect, disconnect
from search_spaces import Infeasible, SearchSpace

CPUS_PER_TRIAL = 0.5
"""A trial is one single-threaded simulation; half a CPU lets two share a core's slack."""


def run_ray_search(evaluator: Evaluator, space: SearchSpace, *, trials: int,
                   timeout: float | None, sampler: str, storage: str, study_name: str,
                   seed: int | None, address: str | None, out: str) -> SearchResult:
    """Add `trials` trials to the study through Ray Tune (local Ray started on demand, or
    the cluster at `address`)."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    check_not_empty(space)
    started = connect(address, ship=[evaluator.spec.source[0]])
    try:
        # no heartbeat (it needs Study.optimize); RDB storages pickle with the searcher
        db = open_storage(storage)
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
        # through Ray Client the searcher runs on the head: a SQLite file here is out of its
        # reach, so it works on a copy there (a database server it reaches directly)
        copy = _client() and storage.startswith("sqlite")
        terms = getattr(space, "terms", lambda: None)()
        searcher = _Searcher(define, metric=list(OBJECTIVES), mode=["min"] * len(OBJECTIVES),
                             sampler=smp, study_name=study_name,
                             storage=_on_head(db, study_name) if copy else db, seed=seed,
                             capacity=evaluator.cluster.memory_bytes, terms=terms,
                             points_to_evaluate=starting_points(
                                 space, sampler, trials, earlier, admissible) or None)
        trainable = tune.with_resources(
            tune.with_parameters(_trial, evaluator=evaluator, space=space),
            {"cpu": CPUS_PER_TRIAL})
        start = time.perf_counter()
        tuner = tune.Tuner(
            trainable,
            tune_config=tune.TuneConfig(search_alg=searcher, num_samples=trials,
                                        time_budget_s=timeout,
                                        reuse_actors=_one_node()),
            run_config=tune.RunConfig(
                name=study_name, verbose=0,  # Tune's own folder: on the head, under client
                storage_path=None if _client() else os.path.abspath(os.path.join(out, "ray"))),
        )
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # no banner: logs are ours
        # Tune installs a SIGINT handler of its own (a graceful stop) and leaves it behind
        # when no signal came: put ours back, so a later Ctrl-C interrupts again
        handler = signal.getsignal(signal.SIGINT)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # --json: stdout carries one object
                results = tuner.fit()
        finally:
            signal.signal(signal.SIGINT, handler)
        if copy:
            _bring_back(results, db, study_name, evaluator.cluster.memory_bytes, terms)
        return result_of(open_study(db, study_name, create=False),
                         time.perf_counter() - start)
    finally:
        if started:
            disconnect()


class _Define:
    """The define-by-run space Tune's OptunaSearch asks (a class: the searcher is pickled)."""

    def __init__(self, space: SearchSpace, grid: dict[str, Any] | None) -> None:
        self.space, self.grid = space, grid

    def __call__(self, trial: Any) -> dict[str, Any]:
        point = ({k: trial.suggest_categorical(k, list(v)) for k, v in self.grid.items()}
                 if self.grid is not None else self.space.sample(trial))
        # the Optuna trial's own terms too: a searcher on another node (`_bring_back`)
        return {"point": point, "params": dict(trial.params),
                "distributions": {k: optuna.distributions.distribution_to_json(d)
                                  for k, d in trial.distributions.items()}}


def _trial(config: dict[str, Any], evaluator: Evaluator, space: SearchSpace) -> dict[str, Any]:
    """One Tune trial: score the point; what happened travels in `piper` as JSON text (Tune
    flattens nested results), with NaN metrics for a point without figures (Tune wants every
    metric in every result)."""
    import ray

    nan = {k: float("nan") for k in OBJECTIVES}
    node = ray.util.get_node_ip_address()  # where it ran, kept on the Optuna trial
    try:
        s = score(evaluator, space, config["point"])
    except Infeasible as e:
        return {**nan, "piper": json.dumps({"pruned_reason": str(e), "node": node,
                                            "over_memory": isinstance(e, DoesNotFit)})}
    except Exception as e:  # noqa: BLE001 - recorded on the trial, as the embedded loop does
        lines = str(e).strip().splitlines()
        reason = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        return {**nan, "piper": json.dumps({"fail_reason": reason, "node": node})}
    return {**dict(zip(OBJECTIVES, s.values, strict=True)),
            "piper": json.dumps({"point": s.point, "summary": s.summary, "program": s.program,
                                 "predicted": s.predicted, "node": node})}


class _Searcher(OptunaSearch):
    """OptunaSearch that stores on each Optuna trial what the embedded loop stores (point,
    summary, Program, prediction, memory constraint), and prunes or fails it likewise."""

    def __init__(self, *args: Any, capacity: int, terms: dict[str, list[Any]] | None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._capacity = capacity
        self._terms = terms
        self._same = SameStrategy(self._ot_study.get_trials(deepcopy=False))

    def on_trial_complete(self, trial_id: str, result: dict | None = None,
                          error: bool = False) -> None:
        if trial_id in self._completed_trials:
            return
        ot_trial = self._ot_trials[trial_id]
        outcome = json.loads((result or {}).get("piper") or "{}")
        state, values = _settle(ot_trial, outcome, self._capacity)
        if state == optuna.trial.TrialState.COMPLETE:
            set_strategy_params(ot_trial, outcome["summary"], self._terms)
            self._same.mark(ot_trial, ot_trial.number, outcome["program"])
        if state == optuna.trial.TrialState.FAIL and not _client():
            _said_failed(ot_trial.number, ot_trial.user_attrs["fail_reason"])
        self._ot_study.tell(ot_trial, values, state=state)
        self._completed_trials.add(trial_id)


def _settle(trial: Any, outcome: dict[str, Any], capacity: int
            ) -> tuple[optuna.trial.TrialState, list[float] | None]:
    """A Tune trial's outcome as the embedded loop keeps it: the attributes set on `trial`
    (an Optuna trial, or `_Attrs`), and the state and values to tell."""
    if "node" in outcome:
        trial.set_user_attr("node", outcome["node"])
    if "predicted" in outcome:
        s = Scored(outcome["point"], outcome["summary"], outcome["program"],
                   outcome["predicted"])
        trial.set_user_attr("point", s.point)
        store(trial, s, capacity)
        return optuna.trial.TrialState.COMPLETE, list(s.values)
    if "pruned_reason" in outcome:
        trial.set_user_attr("pruned_reason", outcome["pruned_reason"])
        if outcome.get("over_memory"):
            trial.set_user_attr("over_memory", True)
        return optuna.trial.TrialState.PRUNED, None
    trial.set_user_attr("fail_reason", outcome.get("fail_reason",
                                                   "the Tune trial raised (see Ray's logs)"))
    return optuna.trial.TrialState.FAIL, None


def _said_failed(number: int, reason: str) -> None:
    print(f"trial {number} failed: {reason} (recorded in the study; the search goes on)",
          file=sys.stderr, flush=True)


def _one_node() -> bool:
    """On one node, starting an actor per trial costs more than the trial (a 64-trial
    search: 227 s against 40 s reusing them); on a cluster a fresh actor per trial is what
    lets Ray place trials on every node (reused ones stay where the first ones started)."""
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive")) <= 1


def _client() -> bool:
    """Joined through Ray Client: Tune then runs its loop (and our searcher) on the head
    node, where this machine's files (a SQLite study) are not."""
    from ray.util.client import ray as client

    return client.is_connected()


class _Attrs:
    """What `_settle` sets, kept for `optuna.trial.create_trial`."""

    def __init__(self) -> None:
        self.user_attrs: dict[str, Any] = {}
        self.constraints: dict[str, float] = {}

    def set_user_attr(self, key: str, value: Any) -> None:
        self.user_attrs[key] = value

    def set_constraint(self, key: str, value: float) -> None:
        self.constraints[key] = value


def _on_head(db: Any, study_name: str) -> optuna.storages.BaseStorage:
    """An in-memory copy of the study, which travels to the head with the searcher: the
    sampler there sees every earlier trial, and the trials it adds come back in Tune's
    results (`_bring_back`)."""
    here = optuna.load_study(study_name=study_name, storage=db)
    mem = optuna.storages.InMemoryStorage()
    copy = optuna.create_study(storage=mem, study_name=study_name, directions=here.directions)
    for k, v in here.user_attrs.items():
        copy.set_user_attr(k, v)
    copy.add_trials([t for t in here.trials if t.state.is_finished()])
    return mem


def _bring_back(results: Any, db: Any, study_name: str, capacity: int,
                terms: dict[str, list[Any]] | None) -> None:
    """The head's trials into this machine's study, as the searcher told them there."""
    study = optuna.load_study(study_name=study_name, storage=db)
    same = SameStrategy(study.get_trials(deepcopy=False))
    for r in results:
        config = r.config or {}
        if "params" not in config:
            continue  # never asked (Tune stopped first)
        attrs = _Attrs()
        outcome = json.loads((r.metrics or {}).get("piper") or "{}")
        state, values = _settle(attrs, outcome, capacity)
        params = dict(config["params"])
        dists = {k: optuna.distributions.json_to_distribution(v)
                 for k, v in config["distributions"].items()}
        if state == optuna.trial.TrialState.COMPLETE:
            for name, (v, dist) in strategy_params(outcome["summary"], terms).items():
                if name not in params:
                    params[name], dists[name] = v, dist
            same.mark(attrs, len(study.trials), outcome["program"])
        study.add_trial(optuna.trial.create_trial(
            state=state, values=values, params=params, distributions=dists,
            user_attrs=attrs.user_attrs, constraints=attrs.constraints or None))
        if state == optuna.trial.TrialState.FAIL:
            _said_failed(len(study.trials) - 1, attrs.user_attrs["fail_reason"])
