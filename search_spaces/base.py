"""The SearchSpace contract: define-by-run `suggest(trial)` and plain enumeration for grid."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from piper.program import Program


class Infeasible(Exception):
    """The sampled point violates a constraint of the space (e.g. a divisibility rule)."""


class TrialLike(Protocol):
    """The slice of `optuna.trial.Trial` a space needs (so this package never imports optuna)."""

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any: ...


class SearchSpace(abc.ABC):
    @abc.abstractmethod
    def suggest(self, trial: TrialLike) -> Program:
        """A Program for this trial; raises `Infeasible` for a point that breaks a rule."""

    @abc.abstractmethod
    def grid(self) -> Mapping[str, Sequence[Any]]:
        """Every parameter with all its values (for `--sampler grid`)."""

    @abc.abstractmethod
    def program(self, **params: Any) -> Program:
        """The Program for one point given as plain values; raises `Infeasible`."""

    def enumerate(self) -> Iterator[tuple[dict[str, Any], Program]]:
        """Every feasible point with its Program, in grid order."""
        grid = self.grid()
        keys = list(grid)

        def rec(i: int, acc: dict[str, Any]) -> Iterator[tuple[dict[str, Any], Program]]:
            if i == len(keys):
                try:
                    yield dict(acc), self.program(**acc)
                except Infeasible:
                    return
                return
            for v in grid[keys[i]]:
                acc[keys[i]] = v
                yield from rec(i + 1, acc)

        yield from rec(0, {})
