"""Fitting measured timings to the cost models' forms, with scipy.

Every model here is linear in its unknowns, t = sum_i x_i a_i with x_i >= 0, so each fit is
one non-negative least-squares problem (`scipy.optimize.nnls`). Rows are divided by the
measured time: timings span orders of magnitude, and a 10% miss on a 50 us message matters
as much to a schedule of many small messages as a 10% miss on a 50 ms one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from cost_models.cluster import AlphaBeta
from piper.errors import PiperError

P2P = "p2p"


@dataclass(frozen=True, slots=True)
class CommSample:
    """One timed communication: `kind` (a `comm.COLLECTIVES` name or "p2p") of `nbytes`
    (the full tensor) over a group of `ranks`."""

    kind: str
    ranks: int
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class MatmulSample:
    """One timed matmul of `flops` FLOPs."""

    flops: float
    seconds: float
    low_precision: bool = False


@dataclass(frozen=True, slots=True)
class OptimizerSample:
    """One timed optimizer step over `tensors` parameter tensors of `params` elements."""

    tensors: int
    params: int
    seconds: float


@dataclass(frozen=True, slots=True)
class OverheadSample:
    """Seconds left of a timed chunk once its matmuls are priced, and its other ops."""

    ops: int
    seconds: float


@dataclass(frozen=True, slots=True)
class MatmulCurve:
    """t(f) = fixed + f / rate: `rate` the achieved peak, `half` = fixed x rate the size at
    which a matmul reaches half of it (`ClusterSpec.matmul_half_flops`)."""

    rate: float
    half: float


def steps_and_volume(kind: str, ranks: int) -> tuple[float, float]:
    """The ring form of `kind` over p ranks: (latency steps, multiple of n / beta)."""
    p = ranks
    if kind == P2P:
        return 1.0, 1.0
    if p <= 1:
        return 0.0, 0.0
    if kind == "all_reduce":
        return 2.0 * (p - 1), 2.0 * (p - 1) / p
    if kind in ("all_gather", "reduce_scatter"):
        return float(p - 1), (p - 1) / p
    raise ValueError(f"unknown communication kind {kind!r}")


def fit_alpha_beta(samples: Iterable[CommSample]) -> AlphaBeta:
    """Latency and bandwidth of one kind's ring form, from timings at several sizes (and,
    better, several group sizes, which separate the per-step latency from the size term)."""
    rows, times = [], []
    for s in samples:
        steps, volume = steps_and_volume(s.kind, s.ranks)
        if steps == 0 or s.seconds <= 0:
            continue
        rows.append((steps, volume * s.nbytes))
        times.append(s.seconds)
    if len({r[1] for r in rows}) < 2:
        raise PiperError("fitting alpha-beta needs timings at two or more message sizes")
    latency, inv_bw = _nnls(rows, times)
    return AlphaBeta(latency=latency, bandwidth=1 / inv_bw if inv_bw > 0 else math.inf)


def fit_matmul_curve(samples: Iterable[MatmulSample]) -> MatmulCurve:
    """The achieved-FLOP/s curve by matmul size: t = fixed + f / rate."""
    rows, times = [], []
    for s in samples:
        if s.seconds > 0:
            rows.append((1.0, s.flops))
            times.append(s.seconds)
    if len({r[1] for r in rows}) < 2:
        raise PiperError("fitting the matmul curve needs timings at two or more sizes")
    fixed, inv_rate = _nnls(rows, times)
    if inv_rate <= 0:
        raise PiperError("matmul timings do not grow with size; cannot fit a FLOP rate")
    return MatmulCurve(rate=1 / inv_rate, half=fixed / inv_rate)


def fit_optimizer(samples: Iterable[OptimizerSample],
                  bytes_per_param: float) -> tuple[float, float | None]:
    """(seconds per parameter tensor, memory bytes/s) of an optimizer step,
    t = tensors x overhead + params x bytes_per_param / bandwidth; None: no bandwidth seen."""
    rows, times = [], []
    for s in samples:
        if s.seconds > 0:
            rows.append((float(s.tensors), s.params * bytes_per_param))
            times.append(s.seconds)
    if len(rows) < 2:
        raise PiperError("fitting the optimizer step needs two or more timings")
    per_tensor, inv_bw = _nnls(rows, times)
    return per_tensor, (1 / inv_bw if inv_bw > 0 else None)


def fit_per_op(samples: Iterable[OverheadSample]) -> float:
    """Seconds per op: least squares through the origin of leftover time on op count."""
    kept = [s for s in samples if s.ops > 0 and s.seconds > 0]
    rows = [(float(s.ops),) for s in kept]
    times = [s.seconds for s in kept]
    if not rows:
        return 0.0
    return _nnls(rows, times)[0]


def median_by(samples: Iterable[CommSample]) -> list[CommSample]:
    """One sample per (kind, ranks, nbytes): the median of repeated timings."""
    groups: dict[tuple[str, int, int], list[float]] = {}
    for s in samples:
        groups.setdefault((s.kind, s.ranks, s.nbytes), []).append(s.seconds)
    return [CommSample(k, p, n, statistics.median(ts)) for (k, p, n), ts in sorted(groups.items())]


def _nnls(rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float]:
    a = np.asarray(rows, dtype=float)
    t = np.asarray(times, dtype=float)
    # relative error: divide each row by its measured time
    x, _ = optimize.nnls(a / t[:, None], np.ones_like(t))
    return [float(v) for v in x]
