"""Fitting the GPU coefficient nothing publishes, globally per GPU generation.

One figure of the catalog has no published value: the share of the best-shape rates
(`compute_efficiency`, `attention_efficiency`, measured on one kernel at a time) that math
sustains through a whole training step (`ClusterSpec.sustained_clock`: power and thermal
limits on real data, and what eager kernels lose between them). It is fitted per GPU
generation (A100, H100), never per row or per source, on published runs
(`benchmarks/calibrate_gpus.py` simulates them), by least squares on the log of predicted
over published step time, each source weighted equally so one large table (MosaicML's) does
not decide alone.

A row enters as its simulated step time at full clock and at one lower clock
(`CalibrationRow`): compute time scales with the slowdown 1/clock - 1 and the rest of the
step does not, so a row's time is close to linear in the slowdown over the range fitted.
`benchmarks/published_runs.py` then checks the fitted value with full simulations.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from scipy.optimize import least_squares

SLOW_STEP = 0.25
"""How far the calibration moves the slowdown 1/clock - 1 to measure a row's slope (clock
0.8)."""
MAX_SLOWDOWN = 1.0
"""The fit's range: clock 1 down to 0.5."""


@dataclass(frozen=True)
class CalibrationRow:
    """One published run, simulated three times."""

    source: str
    label: str
    generation: str
    published_s: float
    base_s: float
    """At clock 1."""
    slow_s: float
    """At slowdown `SLOW_STEP`."""

    def predicted(self, slowdown: float) -> float:
        return self.base_s + (self.slow_s - self.base_s) * slowdown / SLOW_STEP


@dataclass(frozen=True)
class Fit:
    sustained_clock: float

    @property
    def slowdown(self) -> float:
        return 1 / self.sustained_clock - 1


def fit(rows: Sequence[CalibrationRow]) -> Fit:
    """Least squares of log(predicted / published), each source weighted equally (a row's
    squared residual counts 1 / its source's rows)."""
    per_source: dict[str, int] = defaultdict(int)
    for r in rows:
        per_source[r.source] += 1
    weights = [1 / math.sqrt(per_source[r.source]) for r in rows]

    def residuals(x: Sequence[float]) -> list[float]:
        return [w * math.log(max(r.predicted(x[0]), 1e-12) / r.published_s)
                for r, w in zip(rows, weights, strict=True)]

    res = least_squares(residuals, x0=[0.2], bounds=([0.0], [MAX_SLOWDOWN]))
    return Fit(1 / (1 + float(res.x[0])))


def by_generation(rows: Sequence[CalibrationRow]) -> dict[str, Fit]:
    gens: dict[str, list[CalibrationRow]] = defaultdict(list)
    for r in rows:
        gens[r.generation].append(r)
    return {g: fit(rs) for g, rs in sorted(gens.items())}


def mape(rows: Sequence[CalibrationRow], f: Fit) -> float:
    """Mean absolute percentage error of the linear model at `f`."""
    return 100 * statistics.fmean(
        abs(r.predicted(f.slowdown) / r.published_s - 1) for r in rows)


def leave_one_source_out(rows: Sequence[CalibrationRow]) -> dict[tuple[str, str], float]:
    """(generation, source) -> MAPE of that source's rows under coefficients fitted on the
    generation's other sources (skipped where no other source is left)."""
    out = {}
    for gen in sorted({r.generation for r in rows}):
        mine = [r for r in rows if r.generation == gen]
        for source in sorted({r.source for r in mine}):
            rest = [r for r in mine if r.source != source]
            if rest:
                out[gen, source] = mape([r for r in mine if r.source == source], fit(rest))
    return out
