"""Define-by-run sampling over the feasible points of a space, and nothing else.

A plain product of choices (pp x microbatches x schedule x ZeRO ...) is mostly invalid:
most microbatch counts do not divide the batch left to a replica, ZeRO needs replicas, and
so on; a sampler that proposes such points wastes most of its trials learning the rules.
Here each dimension is asked for in turn among the values that still have a feasible
completion, so every sample is valid by construction.

Samplers (TPE, GP, NSGA-II) need one distribution per parameter name across trials, while
the valid values of a dimension change with what was chosen before. So:
- categorical dimensions (schedule, ZeRO stage, recompute) come first and always offer the
  same values: those appearing in some feasible point;
- ordinal dimensions (degrees, microbatch counts) are suggested as a position in [0, 1]
  (`<name>_quantile`) mapped onto the values valid in this context, smallest first, so
  "near the top" means the same thing whatever the context left valid.
A dimension with a single value in the whole space is not asked for at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from search_spaces.base import Infeasible, TrialLike


@dataclass(frozen=True)
class Dimension:
    name: str
    ordinal: bool
    """Numbers where nearby values behave alike: sampled by position, not by identity."""


def quantile_name(name: str) -> str:
    return f"{name}_quantile"


def sample(trial: TrialLike, dims: Sequence[Dimension], points: Sequence[tuple[Any, ...]]
           ) -> dict[str, Any]:
    """One feasible point (dimension name -> value) chosen through `trial`; each tuple of
    `points` gives the values of `dims`, in order."""
    if not points:
        raise Infeasible("the search space has no feasible point")
    chosen: dict[str, Any] = {}
    rest = list(points)
    for i, d in enumerate(dims):
        everywhere = _distinct([p[i] for p in points], d.ordinal)
        here = _distinct([p[i] for p in rest], d.ordinal)
        if len(everywhere) == 1:
            value = everywhere[0]
        elif d.ordinal:
            u = trial.suggest_float(quantile_name(d.name), 0.0, 1.0)
            value = here[min(int(u * len(here)), len(here) - 1)]
        else:
            value = trial.suggest_categorical(d.name, everywhere)
            if value not in here:  # rare: e.g. a ZeRO stage no degree left here allows
                context = ", ".join(f"{k}={v}" for k, v in chosen.items())
                raise Infeasible(f"{d.name}={value} has no valid point with {context}")
        chosen[d.name] = value
        rest = [p for p in rest if p[i] == value]
    return chosen


def _distinct(values: list[Any], ordinal: bool) -> list[Any]:
    unique = list(dict.fromkeys(values))
    return sorted(unique) if ordinal else unique


def params_for(dims: Sequence[Dimension], points: Sequence[tuple[Any, ...]],
               point: tuple[Any, ...]) -> dict[str, Any]:
    """The trial parameters `sample` turns into `point` (its inverse): a sampler can propose
    a chosen point, e.g. one not tried yet, in the parameters it models."""
    params: dict[str, Any] = {}
    rest = list(points)
    for i, d in enumerate(dims):
        everywhere = _distinct([p[i] for p in points], d.ordinal)
        here = _distinct([p[i] for p in rest], d.ordinal)
        if len(everywhere) > 1:
            if d.ordinal:
                params[quantile_name(d.name)] = (here.index(point[i]) + 0.5) / len(here)
            else:
                params[d.name] = point[i]
        rest = [p for p in rest if p[i] == point[i]]
    return params


def parameters(dims: Sequence[Dimension], points: Sequence[tuple[Any, ...]]
               ) -> dict[str, list[Any] | None]:
    """Every parameter `sample` asks: categorical ones with their choices, in the order it
    offers them; position parameters (floats in [0, 1]) with None."""
    out: dict[str, list[Any] | None] = {}
    for i, d in enumerate(dims):
        everywhere = _distinct([p[i] for p in points], d.ordinal)
        if len(everywhere) > 1:
            out[quantile_name(d.name) if d.ordinal else d.name] = (
                None if d.ordinal else everywhere)
    return out
