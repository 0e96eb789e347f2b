"""The search loop: an Optuna study (SQLite) over a SearchSpace, scored by simulation."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import optuna

from cost_models import predicted_json
from piper.program import Program
from planner.evaluate import Evaluation, Evaluator
from search_spaces import Infeasible, SearchSpace

SAMPLERS = ("tpe", "grid")


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial as the reports see it."""

    number: int
    summary: dict[str, Any]
    program: Program
    predicted: dict[str, Any]
    feasible: bool


@dataclass(frozen=True)
class SearchResult:
    best: TrialRecord | None
    trials: int
    feasible_trials: int
    search_time_s: float
    records: tuple[TrialRecord, ...]


def make_sampler(name: str, space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)  # reads trial.set_constraint
    if name == "grid":
        return optuna.samplers.GridSampler(dict(space.grid()), seed=seed)
    raise ValueError(f"unknown sampler {name!r}; known: {', '.join(SAMPLERS)}")


def run_search(evaluator: Evaluator, space: SearchSpace, *, trials: int, timeout: float | None,
               sampler: str, storage: str, study_name: str, seed: int | None,
               progress: bool = True) -> SearchResult:
    """Ask the sampler for `trials` points (or until `timeout`), score each by simulation."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=storage, study_name=study_name, direction="minimize",
                                sampler=make_sampler(sampler, space, seed), load_if_exists=True)
    capacity = evaluator.cluster.memory_bytes
    start = time.perf_counter()
    if sampler == "grid":
        trials = min(trials, _grid_size(space))

    def objective(trial: optuna.Trial) -> float:
        try:
            ev: Evaluation = evaluator.evaluate(space.suggest(trial))
        except Infeasible as e:
            trial.set_user_attr("pruned_reason", str(e))
            raise optuna.TrialPruned(str(e)) from None
        pred = predicted_json(ev.prediction)
        trial.set_user_attr("summary", ev.summary)
        trial.set_user_attr("program", json.loads(ev.program.to_json()))
        trial.set_user_attr("predicted", pred)
        trial.set_constraint("memory", float(max(pred["peak_memory_bytes"]) - capacity))
        return ev.prediction.step_time_s

    # optimize() rather than ask/tell: GridSampler stops the study from inside its callback.
    study.optimize(objective, n_trials=trials, timeout=timeout, show_progress_bar=progress)
    records = tuple(_record(t) for t in study.trials
                    if t.state == optuna.trial.TrialState.COMPLETE and "program" in t.user_attrs)
    feasible = [r for r in records if r.feasible]
    best = min(feasible, key=lambda r: r.predicted["step_time_s"], default=None)
    return SearchResult(best, len(records), len(feasible), time.perf_counter() - start, records)


def _record(t: optuna.trial.FrozenTrial) -> TrialRecord:
    prog = Program.from_json(json.dumps(t.user_attrs["program"]))
    return TrialRecord(t.number, t.user_attrs["summary"], prog, t.user_attrs["predicted"],
                       all(c <= 0 for c in t.constraints.values()))


def _grid_size(space: SearchSpace) -> int:
    n = 1
    for v in space.grid().values():
        n *= len(v)
    return n


