"""A search's results as the reports read them, and the study they are read back from.

Everything a report needs is stored on each Optuna trial (user attrs `point`, `summary`,
`program`, `predicted`; the memory constraint), and what the search was about on the study
(model, gpus, batch, cluster), so `piper-plan show` and `export` work from the storage alone
and optuna-dashboard shows the same study.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import optuna

from piper.errors import PiperError
from piper.program import Program

OBJECTIVES = ("step_time_s", "peak_memory_bytes")
"""What the study minimises, in order; memory (max over ranks) also carries the constraint
that it fits the device."""


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
    failed_trials: int = 0  # trials that raised; their reasons are in the study
    pruned_trials: int = 0  # invalid points and points that cannot fit (analytical bound)
    repeats: int = 0  # trials of a strategy an earlier trial scored (`same_as`), in `trials`
    over_memory: int = 0  # points rejected by the memory bound (pruned, or passed over)
    proposed: int = 0  # points the sampler proposed: every trial, and those passed over


def open_study(storage: str | optuna.storages.BaseStorage, study_name: str, *,
               create: bool) -> optuna.Study:
    """The study `study_name` in `storage`; with `create`, made if missing. A study of
    another shape (say single-objective, from an older piper-plan) is a one-line error."""
    try:
        if create:
            study = optuna.create_study(storage=storage, study_name=study_name,
                                        directions=["minimize"] * len(OBJECTIVES),
                                        load_if_exists=True)
        else:
            study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        raise PiperError(f"no study {study_name!r} in {_url(storage)}; it has: "
                         f"{', '.join(names) or 'no studies'}") from None
    except ValueError as e:
        raise PiperError(f"{_url(storage)}: {e}") from None
    if len(study.directions) != len(OBJECTIVES):
        raise PiperError(f"study {study_name!r} in {_url(storage)} has "
                         f"{len(study.directions)} objective(s), not ({', '.join(OBJECTIVES)});"
                         " pass another --study-name or --storage")
    return study


def _url(storage: str | optuna.storages.BaseStorage) -> str:
    return storage if isinstance(storage, str) else getattr(storage, "url", type(storage).__name__)


def record(t: optuna.trial.FrozenTrial) -> TrialRecord:
    prog = Program.from_json(json.dumps(t.user_attrs["program"]))
    return TrialRecord(t.number, t.user_attrs["summary"], prog, t.user_attrs["predicted"],
                       all(c <= 0 for c in t.constraints.values()))


def _scored(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    return [t for t in trials
            if t.state == optuna.trial.TrialState.COMPLETE and "program" in t.user_attrs]


def records_of(study: optuna.Study) -> tuple[TrialRecord, ...]:
    """Every completed trial with a scored Program, in trial order, each strategy once (a
    trial marked `same_as` an earlier one repeats it)."""
    return _records(study.get_trials(deepcopy=False))


def _records(trials: list[optuna.trial.FrozenTrial]) -> tuple[TrialRecord, ...]:
    return tuple(record(t) for t in _scored(trials) if "same_as" not in t.user_attrs)


def result_of(study: optuna.Study, search_time_s: float) -> SearchResult:
    """Best = the fastest trial that fits in memory."""
    trials = study.get_trials(deepcopy=False)  # once: each read may be a database query
    records = _records(trials)
    feasible = [r for r in records if r.feasible]
    best = min(feasible, key=lambda r: (r.predicted["step_time_s"], r.number), default=None)
    states = [t.state for t in trials]
    scored = len(_scored(trials))
    over = sum(1 for t in trials if t.state == optuna.trial.TrialState.PRUNED
               and t.user_attrs.get("over_memory"))
    return SearchResult(best, scored, len(feasible), search_time_s, records,
                        states.count(optuna.trial.TrialState.FAIL),
                        states.count(optuna.trial.TrialState.PRUNED), scored - len(records),
                        over, sum(t.state.is_finished() for t in trials))
