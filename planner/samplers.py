"""The samplers `--sampler` names, and the exhaustive one that walks only feasible points.

Optuna's GridSampler walks the full product of the parameter lists, most of which breaks a
divisibility rule; `PointsSampler` walks the list the space says is feasible, each point
once, under the same parameter names (so the study reads the same in optuna-dashboard).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from search_spaces import SearchSpace

SAMPLERS = ("tpe", "gp", "nsga2", "grid")
TPE_STARTUP = 8
"""Random trials before TPE models the results: fewer than Optuna's 10, because every
sample is already valid (no trials are spent learning the rules)."""


def make_sampler(name: str, space: SearchSpace, seed: int | None, trials: int
                 ) -> optuna.samplers.BaseSampler:
    """The sampler for `--sampler name`; all of them read `trial.constraints` (memory)."""
    if name == "tpe":
        # multivariate: the degrees interact (pp x microbatches sets the bubble)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True,
                                          n_startup_trials=min(TPE_STARTUP, max(1, trials // 3)))
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=min(10, max(1, trials // 3)))
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed,
                                             population_size=max(4, min(50, trials // 4)))
    if name == "grid":
        return PointsSampler(space.grid(), space.points(), seed=seed)
    raise ValueError(f"unknown sampler {name!r}; known: {', '.join(SAMPLERS)}")


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
            study.stop()
