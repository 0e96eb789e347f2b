"""The search loop: an Optuna study (SQLite) over a SearchSpace, scored by simulation.

Two objectives, both minimised: predicted step time and peak memory (max over ranks), with
"fits the device" as a constraint (`trial.set_constraint`) that every sampler reads. The best
strategy is the fastest that fits; the fits-and-not-dominated trials are the Pareto front.
A point that cannot fit by the memory formulas alone (`Evaluator.peak_memory_bound`) is
pruned before it is scheduled or simulated, which on large models is most of them.

Nothing is lost to a fault: a trial that raises (a bug, MemoryError) is recorded as failed with
its reason (user attr `fail_reason`) and the search goes on; a search killed outright is
resumed by the same command: the study in the same storage keeps every finished trial, and
`trials` more are added to it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna

from cost_models import predicted_json
from piper.errors import PiperError
from planner.search.evaluate import Evaluator
from planner.search.records import (
    OBJECTIVES,
    SearchResult,
    TrialRecord,
    open_study,
    result_of,
)
from planner.search.samplers import PointsSampler, make_sampler
from search_spaces import Infeasible, SearchSpace

__all__ = ["OBJECTIVES", "SearchResult", "TrialRecord", "run_search", "score"]

HEARTBEAT_S = 10  # a RUNNING trial silent for twice this long was killed: it is marked failed
GIB = 1024**3


class DoesNotFit(Infeasible):
    """The point's memory, by formula alone, exceeds the device."""


@dataclass(frozen=True)
class Scored:
    """What a trial stores: plain JSON values, so both backends can ship and save them."""

    point: dict[str, Any]
    summary: dict[str, Any]
    program: dict[str, Any]
    predicted: dict[str, Any]

    @property
    def values(self) -> tuple[float, float]:
        return (self.predicted["step_time_s"], float(max(self.predicted["peak_memory_bytes"])))


def score(evaluator: Evaluator, space: SearchSpace, point: dict[str, Any]) -> Scored:
    """Simulate the Program of `point`, and of each of its `variants` (e.g. bucket sizes)
    that fits, keeping the fastest; `Infeasible` (`DoesNotFit`) for a point that breaks a
    rule (none of its variants fits the device) — both are cheap to find out. Variants
    differ in how communication overlaps and, with ZeRO, in the unsharded gradient a
    microbatch holds (units), so each has its bound. `Scored.point` stays the sampled
    point (what samplers key on); summary and Program are the variant's."""
    capacity = evaluator.cluster.memory_bytes
    programs = [space.program(**p) for p in space.variants(point)]
    bounds = [evaluator.peak_memory_bound(p) for p in programs]
    if min(bounds) > capacity:
        raise DoesNotFit(f"needs {min(bounds) / GIB:.1f} GiB on some rank (memory formulas), "
                         f"more than the device's {capacity / GIB:.0f} GiB")
    # the first fastest: a bucket size is kept only where it wins
    ev = min((evaluator.evaluate(p) for p, b in zip(programs, bounds, strict=True)
              if b <= capacity), key=lambda e: e.prediction.step_time_s)
    return Scored(dict(point), ev.summary, json.loads(ev.program.to_json()),
                  predicted_json(ev.prediction))


def fits(evaluator: Evaluator, space: SearchSpace) -> Callable[[dict[str, Any]], bool]:
    """Whether a point can fit the device by the memory formulas (milliseconds, no
    simulation), in some variant; a point whose bound cannot be computed is let through,
    for its trial to say why."""
    capacity = evaluator.cluster.memory_bytes

    def admissible(point: dict[str, Any]) -> bool:
        try:
            return min(evaluator.peak_memory_bound(space.program(**p))
                       for p in space.variants(point)) <= capacity
        except Exception:  # noqa: BLE001 - the trial reports it
            return True
    return admissible


def starting_points(space: SearchSpace, sampler: str, trials: int, earlier: int,
                    admissible: Callable[[dict[str, Any]], bool] = lambda p: True
                    ) -> list[dict[str, Any]]:
    """The trial parameters of the expert defaults a new study starts from (those that can
    fit by the memory formulas, `admissible`; at most a quarter of its trials; none for a
    grid, which tries everything, or a resumed study)."""
    defaults = getattr(space, "expert_defaults", None)
    if sampler == "grid" or earlier or defaults is None:
        return []
    fitting = [p for p in defaults() if admissible(p)]
    return [space.params_of(p) for p in fitting[:max(1, trials // 4)]]


def run_search(evaluator: Evaluator, space: SearchSpace, *, trials: int, timeout: float | None,
               sampler: str, storage: str, study_name: str, seed: int | None,
               progress: bool = True) -> SearchResult:
    """Add `trials` trials to the study (or stop at `timeout`), scoring each by simulation; a
    study already in `storage` is resumed, not restarted."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # failed trials: our one line, below
    check_not_empty(space)
    study = open_study(_storage(storage), study_name, create=True)
    describe(study, evaluator)
    earlier = len(study.trials)
    # a resumed TPE must not replay the first run's random start from the same seed
    admissible = fits(evaluator, space)
    study.sampler = make_sampler(sampler, space, None if seed is None else seed + earlier,
                                 trials, admissible=admissible)
    capacity = evaluator.cluster.memory_bytes
    start = time.perf_counter()
    if isinstance(study.sampler, PointsSampler):
        trials = min(trials, len(study.sampler))
    if earlier:
        finished = sum(t.state.is_finished() for t in study.trials)
        print(f"resuming study {study_name!r}: {finished} finished trials kept, {trials} more",
              file=sys.stderr, flush=True)
    grid = space.grid() if sampler == "grid" else None
    for params in starting_points(space, sampler, trials, earlier, admissible):
        study.enqueue_trial(params)
    terms = getattr(space, "terms", lambda: None)()
    same = SameStrategy(study.get_trials(deepcopy=False))

    def objective(trial: optuna.Trial) -> tuple[float, float]:
        try:
            point = ({k: trial.suggest_categorical(k, list(v)) for k, v in grid.items()}
                     if grid is not None else space.sample(trial))
            trial.set_user_attr("point", point)
            s = score(evaluator, space, point)
        except Infeasible as e:
            trial.set_user_attr("pruned_reason", str(e))
            if isinstance(e, DoesNotFit):
                trial.set_user_attr("over_memory", True)
            raise optuna.TrialPruned(str(e)) from None
        except Exception as e:  # MemoryError too: record why, and go on with the next trial
            lines = str(e).strip().splitlines()
            reason = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
            trial.set_user_attr("fail_reason", reason)
            print(f"trial {trial.number} failed: {reason} (recorded in the study; the search "
                  "goes on)", file=sys.stderr, flush=True)
            raise
        store(trial, s, capacity)
        set_strategy_params(trial, s.summary, terms)
        same.mark(trial, trial.number, s.program)
        return s.values

    # optimize() rather than ask/tell: the grid sampler stops the study from its callback.
    study.optimize(objective, n_trials=trials, timeout=timeout, catch=(Exception,),
                   show_progress_bar=progress)
    skipped = getattr(study.sampler, "skipped", 0)
    if skipped:
        print(f"the sampler passed over {skipped} points that cannot fit in memory (by the "
              "memory formulas, without a trial)", file=sys.stderr, flush=True)
    result = result_of(study, time.perf_counter() - start)
    return dataclasses.replace(result, over_memory=result.over_memory + skipped,
                               proposed=result.proposed + skipped)


def strategy_params(summary: dict[str, Any], terms: dict[str, list[Any]] | None
                    ) -> dict[str, tuple[Any, optuna.distributions.CategoricalDistribution]]:
    """The strategy's own terms (dp, pp, tp, ..., bucket) as Optuna parameters: value and a
    distribution over every value the space has, so optuna-dashboard's tables, slice and
    importance plots read in degrees and schedules. The samplers ask positions (`*_quantile`,
    `search_spaces.conditional`); these are recorded beside them, never sampled."""
    out = {}
    for name, values in (terms or {}).items():
        v = summary.get(name)
        if v in values:
            out[name] = (v, optuna.distributions.CategoricalDistribution(values))
    return out


def set_strategy_params(trial: optuna.Trial, summary: dict[str, Any],
                        terms: dict[str, list[Any]] | None) -> None:
    """`strategy_params` on a running trial (those the sampler did not ask itself)."""
    for name, (v, dist) in strategy_params(summary, terms).items():
        if name in trial.params:
            continue  # asked by the sampler (a categorical, or the grid's)
        try:
            trial.storage.set_trial_param(trial._trial_id, name, dist.to_internal_repr(v), dist)
        except ValueError:  # a study of an older space: a label is not worth a failed trial
            pass


class SameStrategy:
    """The first trial of each Program: a later trial of an equal Program (a sampler asking
    a point again) is marked `same_as` it, and reports show the strategy once."""

    def __init__(self, trials: list[optuna.trial.FrozenTrial]) -> None:
        self.first: dict[str, int] = {}
        for t in sorted(trials, key=lambda t: t.number):
            if "program" in t.user_attrs and "same_as" not in t.user_attrs:
                self.first.setdefault(_key(t.user_attrs["program"]), t.number)

    def mark(self, trial: Any, number: int, program: dict[str, Any]) -> None:
        first = self.first.setdefault(_key(program), number)
        if first != number:
            trial.set_user_attr("same_as", first)


def _key(program: dict[str, Any]) -> str:
    return json.dumps(program, sort_keys=True)


def store(trial: optuna.Trial, s: Scored, capacity: int) -> None:
    """Save a scored point on its trial (what `records.record` reads back)."""
    trial.set_user_attr("summary", s.summary)
    trial.set_user_attr("program", s.program)
    trial.set_user_attr("predicted", s.predicted)
    trial.set_constraint("memory", s.values[1] - capacity)


def describe(study: optuna.Study, evaluator: Evaluator) -> None:
    """What the study is about, for `show`, `export` and the dashboard."""
    with warnings.catch_warnings():  # "experimental" since optuna 3.2, still there in 5
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(list(OBJECTIVES))
    spec = evaluator.spec
    about = {"model": spec.path, "model_path": spec.source[0],
             "model_args": [list(a) for a in spec.model_args],
             "options": [list(a) for a in spec.options],
             "gpus": evaluator.gpus, "batch_size": evaluator.batch_size,
             "cluster": evaluator.cluster.name, "precision": evaluator.precision,
             "memory_bytes": evaluator.cluster.memory_bytes}
    had = study.user_attrs
    if study.trials and "model" in had:
        which = "model_path" if "model_path" in had else "model"  # resolved, where kept
        differ = [k for k in (which, "model_args", "gpus", "batch_size", "cluster",
                              "precision") if had.get(k) != about[k]]
        if differ:  # its trials are strategies of another problem: never mix, never drop
            was = ", ".join(f"{k} {had.get(k)!r}" for k in differ)
            raise PiperError(f"study {study.study_name!r} already holds a search of another "
                             f"problem ({was}; this one: "
                             + ", ".join(f"{k} {about[k]!r}" for k in differ)
                             + "): pass another --out or --study-name")
    for k, v in about.items():
        if had.get(k) != v:
            study.set_user_attr(k, v)


def _storage(url: str) -> optuna.storages.BaseStorage:
    """SQL storages get a heartbeat, so a trial left RUNNING by a killed search is failed
    (and counted as finished) instead of lingering."""
    if url.split(":", 1)[0].split("+")[0] in ("sqlite", "postgresql", "mysql"):
        with warnings.catch_warnings():  # heartbeats are "experimental" since optuna 2.9
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return open_storage(url, heartbeat_interval=HEARTBEAT_S)
    return open_storage(url)


def open_storage(url: str, **kwargs: Any) -> optuna.storages.BaseStorage:
    """The storage at `url` (`--storage`); one that cannot be opened is bad input."""
    try:
        if kwargs:
            return optuna.storages.RDBStorage(url, **kwargs)
        return optuna.storages.get_storage(url)
    except Exception as e:  # noqa: BLE001 - SQLAlchemy and drivers raise many kinds
        lines = str(e).strip().splitlines()
        raise PiperError(f"--storage {url}: Optuna cannot open it ({type(e).__name__}: "
                         f"{lines[0] if lines else ''}); give a database URL such as "
                         "sqlite:///study.db or postgresql://user@host/db") from None


def check_not_empty(space: SearchSpace) -> None:
    """Every point infeasible (say --gpus far beyond the batch) is bad input: say so now,
    rather than spend every trial finding out."""
    if space.points():
        return
    first: str | None = None
    grid = space.grid()
    keys = list(grid)
    flat = getattr(space, "flat_schedule", None)  # pp=1 points under the others' names
    for values in itertools.product(*(grid[k] for k in keys)):  # are refused for that alone
        point = dict(zip(keys, values))
        if flat and point.get("pp") == 1 and point.get("schedule") != flat:
            continue
        try:
            space.check(**point)
        except Infeasible as e:
            first = f"{', '.join(f'{k}={v}' for k, v in point.items())}: {e}"
            break
    gpus, batch = getattr(space, "gpus", "?"), getattr(space, "batch_size", "?")
    raise PiperError(f"no strategy in the search space is valid for --gpus {gpus} and batch "
                     f"size {batch}; e.g. {first or 'the space is empty'}")
