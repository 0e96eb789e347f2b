"""The SearchSpace contract: define-by-run `suggest(trial)` and plain enumeration for grid."""

from __future__ import annotations

import abc
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from piper.errors import PiperError
from piper.program import Program


class Infeasible(PiperError):
    """The sampled point violates a constraint of the space (e.g. a divisibility rule).

    A PiperError, so a strategy given by hand that breaks a rule is a one-line bad-input error.
    """


class TrialLike(Protocol):
    """The slice of `optuna.trial.Trial` a space needs (so this package never imports optuna)."""

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any: ...

    def suggest_float(self, name: str, low: float, high: float) -> float: ...


class SearchSpace(abc.ABC):
    """A set of Programs, each named by a point (grid parameter -> plain value)."""

    @abc.abstractmethod
    def sample(self, trial: TrialLike) -> dict[str, Any]:
        """A point chosen define-by-run through `trial` (keys as in `grid()`)."""

    @abc.abstractmethod
    def grid(self) -> Mapping[str, Sequence[Any]]:
        """Every parameter with all its values; their product covers every point."""

    @abc.abstractmethod
    def program(self, **params: Any) -> Program:
        """The Program for one point given as plain values; raises `Infeasible`."""

    def suggest(self, trial: TrialLike) -> Program:
        """The Program of `sample(trial)`; raises `Infeasible` for a point that breaks a rule."""
        return self.program(**self.sample(trial))

    def check(self, **params: Any) -> None:
        """Raise `Infeasible` if the point breaks a rule (spaces override it with something
        cheaper than building the Program)."""
        self.program(**params)

    def variants(self, point: dict[str, Any]) -> list[dict[str, Any]]:
        """`point` and the points that differ from it only in choices a search settles per
        point, by scoring each, rather than by sampling (none here)."""
        return [point]

    def points(self) -> list[dict[str, Any]]:
        """Every feasible point, in grid order (what `--sampler grid` walks)."""
        grid = self.grid()
        keys = list(grid)
        out = []
        for values in itertools.product(*(grid[k] for k in keys)):
            point = dict(zip(keys, values, strict=True))
            try:
                self.check(**point)
            except Infeasible:
                continue
            out.append(point)
        return out

    def enumerate(self) -> Iterator[tuple[dict[str, Any], Program]]:
        """Every feasible point with its Program, in grid order."""
        for point in self.points():
            yield point, self.program(**point)
