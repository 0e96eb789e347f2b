"""The samplers `--sampler` names, and the exhaustive one that walks only feasible points.

Optuna's GridSampler walks the full product of the parameter lists, most of which breaks a
divisibility rule; `PointsSampler` walks the list the space says is feasible, each point
once, under the same parameter names (so the study reads the same in optuna-dashboard).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution
from optuna.trial import FrozenTrial, TrialState

from search_spaces import SearchSpace

TPE_STARTUP = 8
"""Random trials before TPE models the results: fewer than Optuna's 10, because every
sample is already valid (no trials are spent learning the rules)."""


def make_sampler(name: str, space: SearchSpace, seed: int | None, trials: int,
                 admissible: Callable[[dict[str, Any]], bool] | None = None
                 ) -> optuna.samplers.BaseSampler:
    """The sampler for `--sampler name`; all of them read `trial.constraints` (memory).
    `admissible(point)` (cheap: the memory formulas) says which points are worth a trial."""
    base: optuna.samplers.BaseSampler
    if name == "tpe":
        # multivariate: the degrees interact (pp x microbatches sets the bubble)
        base = optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                          n_startup_trials=min(TPE_STARTUP, max(1, trials // 3)))
    elif name == "gp":
        base = optuna.samplers.GPSampler(seed=seed, n_startup_trials=min(10, max(1, trials // 3)))
    elif name == "nsga2":
        base = optuna.samplers.NSGAIISampler(seed=seed,
                                             population_size=max(4, min(50, trials // 4)))
    if name in ("tpe", "gp", "nsga2"):
        if isinstance(space, Invertible):
            return DistinctSampler(base, space, seed, trials, admissible)
        return base
    if name == "grid":
        return PointsSampler(space.grid(), space.points(), seed=seed)
    raise ValueError(f"unknown sampler {name!r}; known: tpe, gp, nsga2, grid")


def _stop(study: optuna.Study) -> None:
    """End `study.optimize` early; under Ray Tune (ask/tell, no optimize) `num_samples`
    bounds the trials instead, and Optuna refuses a stop outside optimize."""
    try:
        study.stop()
    except RuntimeError:
        pass


def _key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


class PointsSampler(optuna.samplers.BaseSampler):
    """Each of `points` once (in an order shuffled by `seed`, so a search cut short by
    `--timeout` still saw a spread of the space), then the study stops. Points already in
    the study (a resumed search) are not repeated."""

    def __init__(self, grid: Mapping[str, Sequence[Any]], points: Sequence[Mapping[str, Any]],
                 seed: int | None = None) -> None:
        self._space = {k: CategoricalDistribution(list(v)) for k, v in grid.items()}
        self._points = [dict(p) for p in points]
        random.Random(seed).shuffle(self._points)
        self._taken: set[tuple] | None = None
        self._next = 0

    def __len__(self) -> int:
        return len(self._points)

    def _visited(self, study: optuna.Study) -> set[tuple]:
        if self._taken is None:  # once per run: reading every trial back is O(trials)
            self._taken = {_key(t.params) for t in study.get_trials(deepcopy=False)
                           if t.params and t.state != TrialState.WAITING}
        return self._taken

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return dict(self._space)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        point = self._next_free(study)
        if point is None:
            return {}  # exhausted: the study stops after this trial
        self._visited(study).add(_key(point))
        return dict(point)

    def _next_free(self, study: optuna.Study) -> dict[str, Any] | None:
        taken = self._visited(study)
        while self._next < len(self._points) and _key(self._points[self._next]) in taken:
            self._next += 1  # points are taken in order, so the cursor never goes back
        return self._points[self._next] if self._next < len(self._points) else None

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        raise ValueError(f"{param_name!r} is not a parameter of the grid "
                         f"({', '.join(self._space)})")

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        if self._next_free(study) is None:
            _stop(study)


@runtime_checkable
class Invertible(Protocol):
    """A space whose sampled points map back to trial parameters (`PipelineSpace`)."""

    def sample(self, trial: Any) -> dict[str, Any]: ...

    def params_of(self, point: dict[str, Any]) -> dict[str, Any]: ...

    def parameters(self) -> dict[str, list[Any] | None]: ...

    def points(self) -> list[dict[str, Any]]: ...


RIDERS = frozenset({"microbatches", "comm_stream"})
"""Choices a neighbour may change besides its one move (`DistinctSampler._neighbour`)."""


class DistinctSampler(optuna.samplers.BaseSampler):
    """`base`, except that it proposes only points the study has not scored yet and that
    are `admissible` (fit in memory, by formula).

    Scores are deterministic, so a repeated point teaches the model nothing and spends a
    trial: TPE re-proposes its favourite region often (about half of 80 trials, measured
    on the Llama-7B space). And on a large model most points cannot fit: three in four on
    Llama-7B over 16 H100s, which the memory formulas tell in milliseconds. Each trial here
    asks `base` up to RETRIES times for such a point, then takes a random one (also during
    `base`'s random start), and proposes it in the parameters the space samples by
    (`params_of`), so the model learns from what ran.
    """

    RETRIES = 8
    POLISH = 0.25
    """The last quarter of a run's trials try the unseen neighbours of the best point so far
    (one choice changed): the model finds the right region, this settles the details."""
    TIE = 0.005
    """Points this close to the fastest count as equally fastest for the polish."""

    def __init__(self, base: optuna.samplers.BaseSampler, space: Invertible,
                 seed: int | None = None, trials: int | None = None,
                 admissible: Callable[[dict[str, Any]], bool] | None = None) -> None:
        self._base, self._space = base, space
        self._admissible = admissible
        self._verdicts: dict[tuple, bool] = {}
        self.skipped = 0
        """Points passed over because they are not admissible (they cannot fit)."""
        self._rng = random.Random(seed)
        self._points = space.points()
        self._budget = trials
        self._first: int | None = None
        self._seen: set[tuple] | None = None
        self._full: dict[str, BaseDistribution] | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Ray Tune pickles its searcher (with this sampler) to checkpoint it; the memory
        test is a closure over the evaluator and stays behind (a restored sampler proposes
        without it, and the objective still prunes what cannot fit)."""
        return {**self.__dict__, "_admissible": None}

    def _visited(self, study: optuna.Study) -> set[tuple]:
        if self._seen is None:  # a resumed study: what earlier runs scored counts too
            self._seen = {_key(t.user_attrs["point"]) for t in study.get_trials(deepcopy=False)
                          if "point" in t.user_attrs}
        return self._seen

    def _distributions(self) -> dict[str, BaseDistribution]:
        """Every parameter the space asks, with its distribution (fixed for a space)."""
        if self._full is None:
            self._full = {k: FloatDistribution(0.0, 1.0) if v is None
                          else CategoricalDistribution(v)
                          for k, v in self._space.parameters().items()}
        return self._full

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return dict(self._distributions())

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        seen = self._visited(study)
        if self._first is None:
            self._first = trial.number
        if self._budget and trial.number - self._first >= (1 - self.POLISH) * self._budget:
            point = self._neighbour(study, seen)
            if point is not None:
                seen.add(_key(point))
                return self._space.params_of(point)
        inner = self._base.infer_relative_search_space(study, trial)
        for _ in range(self.RETRIES if inner else 0):
            params = self._base.sample_relative(study, trial, inner)
            if set(params) != set(search_space):
                break  # base is still in its random start: pick an unseen point below
            point = self._point(params)
            if point is not None and _key(point) not in seen and self._ok(point):
                seen.add(_key(point))
                return params
        point = self._first_ok([p for p in self._points if _key(p) not in seen])
        if point is None:
            return {}  # every admissible point scored: base's own (repeated) choice
        seen.add(_key(point))
        return self._space.params_of(point)

    def _ok(self, point: dict[str, Any]) -> bool:
        if self._admissible is None:
            return True
        k = _key(point)
        if k not in self._verdicts:
            self._verdicts[k] = self._admissible(point)
            self.skipped += not self._verdicts[k]
        return self._verdicts[k]

    def _first_ok(self, candidates: list[dict[str, Any]]) -> dict[str, Any] | None:
        """A random admissible one of `candidates` (judged lazily: each costs a bound)."""
        order = list(candidates)
        self._rng.shuffle(order)
        return next((p for p in order if self._ok(p)), None)

    def _neighbour(self, study: optuna.Study, seen: set[tuple]) -> dict[str, Any] | None:
        """An unseen point one choice away from the fastest points that fit: those within
        `TIE` of the fastest, which are often many (a plateau of equally good strategies),
        any of which may be the one next to a better point; then, if all of their neighbours
        are seen, the next fastest. The choices in `RIDERS` may move along: the microbatch
        count (the replica's share of the batch ties it to the degrees) and the comm stream
        (the other way to hide the gradient collectives, which the ZeRO stage and dp decide
        between: on GPT-1B x16 the optimum is ZeRO-0 with bucketed all-reduces on the
        compute stream, two moves from ZeRO-1 on a comm stream, and neither move alone is
        faster)."""
        fits = sorted((t.values[0], t.number, t.user_attrs["point"])
                      for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                      if "point" in t.user_attrs and all(c <= 0 for c in t.constraints.values()))
        if not fits:
            return None
        top = [p for t, _, p in fits if t <= fits[0][0] * (1 + self.TIE)]
        tiers = [top, *([p] for _, _, p in fits[len(top):])]
        for sources in tiers:
            near = [p for p in self._points if _key(p) not in seen
                    and any(len({k for k in p.keys() | b.keys() if p.get(k) != b.get(k)}
                                - RIDERS) <= 1 for b in sources)]
            point = self._first_ok(near)
            if point is not None:
                return point
        return None

    def _point(self, params: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self._space.sample(optuna.trial.FixedTrial(params))
        except Exception:  # noqa: BLE001 - a dead end of the space: not a point
            return None

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._base.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self._base.after_trial(study, trial, state, values)
        seen = self._visited(study)
        if all(_key(p) in seen or self._verdicts.get(_key(p)) is False for p in self._points):
            _stop(study)  # nothing new left to score

    def reseed_rng(self) -> None:
        self._base.reseed_rng()
