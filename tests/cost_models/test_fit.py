"""Fitting recovers the figures that generated synthetic timings, and says when it cannot."""

from __future__ import annotations

import random

import pytest

from cost_models.comm import ring_all_gather_time, ring_all_reduce_time
from cost_models.fit import (
    CommSample,
    MatmulSample,
    OptimizerSample,
    OverheadSample,
    fit_alpha_beta,
    fit_matmul_curve,
    fit_optimizer,
    fit_per_op,
    median_by,
)
from piper.errors import PiperError

SIZES = [2**k for k in range(10, 24, 2)]
ALPHA, BETA = 85e-6, 1.7e9


def _timings(kind: str, ranks: tuple[int, ...], noise: float = 0.0,
             seed: int = 0) -> list[CommSample]:
    rng = random.Random(seed)
    out = []
    for p in ranks:
        for n in SIZES:
            if kind == "all_reduce":
                t = ring_all_reduce_time(n, p, latency=ALPHA, bandwidth=BETA)
            elif kind == "p2p":
                t = ALPHA + n / BETA
            else:
                t = ring_all_gather_time(n, p, latency=ALPHA, bandwidth=BETA)
            for _ in range(5):
                out.append(CommSample(kind, p, n, t * (1 + rng.uniform(-noise, noise))))
    return out


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "p2p"])
def test_alpha_beta_fit_recovers_exact_figures_from_noise_free_timings(kind: str) -> None:
    ab = fit_alpha_beta(_timings(kind, (2, 4)))
    assert ab.latency == pytest.approx(ALPHA, rel=1e-6)
    assert ab.bandwidth == pytest.approx(BETA, rel=1e-6)


def test_alpha_beta_fit_stays_within_a_few_percent_under_10_percent_noise() -> None:
    samples = median_by(_timings("all_reduce", (2, 3, 4), noise=0.10, seed=7))
    ab = fit_alpha_beta(samples)
    assert ab.latency == pytest.approx(ALPHA, rel=0.05)
    assert ab.bandwidth == pytest.approx(BETA, rel=0.05)


def test_median_by_keeps_one_sample_per_size() -> None:
    samples = median_by(_timings("p2p", (2,), noise=0.2))
    assert len(samples) == len(SIZES)
    assert [s.nbytes for s in samples] == SIZES


def test_alpha_beta_fit_needs_two_message_sizes() -> None:
    with pytest.raises(PiperError, match="two or more message sizes"):
        fit_alpha_beta([CommSample("all_reduce", 4, 1024, 1e-4)] * 3)


def test_matmul_curve_recovers_rate_and_half_size() -> None:
    rate, fixed = 4e10, 3e-6  # so half = fixed x rate = 120,000 FLOPs
    samples = [MatmulSample(2.0 * n**3, fixed + 2.0 * n**3 / rate) for n in (16, 64, 256, 512)]
    curve = fit_matmul_curve(samples)
    assert curve.rate == pytest.approx(rate, rel=1e-6)
    assert curve.half == pytest.approx(fixed * rate, rel=1e-6)


def test_matmul_curve_refuses_timings_that_do_not_grow() -> None:
    with pytest.raises(PiperError, match="do not grow"):
        fit_matmul_curve([MatmulSample(1e3, 2e-3), MatmulSample(1e6, 1e-3)])


def test_optimizer_fit_separates_per_tensor_cost_from_bandwidth() -> None:
    per_tensor, bw, per_param = 40e-6, 8e9, 28
    samples = [OptimizerSample(k, n, k * per_tensor + n * per_param / bw)
               for k, n in ((1, 60_000), (1, 30_000), (12, 12_000), (2, 4_600), (3, 4_200))]
    got_tensor, got_bw = fit_optimizer(samples, per_param)
    assert got_tensor == pytest.approx(per_tensor, rel=1e-6)
    assert got_bw == pytest.approx(bw, rel=1e-6)


def test_per_op_fit_is_the_slope_through_the_origin() -> None:
    samples = [OverheadSample(ops, ops * 2e-5) for ops in (4, 21, 21, 1)]
    assert fit_per_op(samples) == pytest.approx(2e-5, rel=1e-9)
    assert fit_per_op(iter(samples)) == pytest.approx(2e-5, rel=1e-9)
    assert fit_per_op([OverheadSample(0, 1.0)]) == 0.0
