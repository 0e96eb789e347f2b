"""The GPU coefficient fitted per generation: the fit recovers a known coefficient, and the
catalog holds what a refit of the stored published rows gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cost_models.catalog import FITTED
from cost_models.gpu_fit import (
    SLOW_STEP,
    CalibrationRow,
    by_generation,
    fit,
    leave_one_source_out,
)

TABLE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "calibration_rows.json"


def _row(source: str, base: float, per_slow: float, slowdown: float) -> CalibrationRow:
    """A row whose published time is what the linear model gives at a known slowdown."""
    return CalibrationRow(source, "", "x", base + per_slow * slowdown / SLOW_STEP, base,
                          base + per_slow)


def test_the_fit_recovers_the_coefficient_the_rows_were_made_with() -> None:
    rows = [_row(s, b, c, 0.3) for s, (b, c) in zip("aabbbcc", [(1, .2), (2, .5), (1, .2),
                                                                (4, 1), (3, .6), (1, .1),
                                                                (2, .4)])]
    assert fit(rows).sustained_clock == pytest.approx(1 / 1.3, rel=1e-4)
    # each source predicted from the others: exact rows are predicted exactly
    assert all(err < 1e-3 for err in leave_one_source_out(rows).values())


def test_the_catalog_holds_the_fit_of_the_stored_published_rows() -> None:
    rows = [CalibrationRow(**r) for r in json.loads(TABLE.read_text())]
    assert {r.generation for r in rows} == {"a100", "h100"}
    for gen, f in by_generation(rows).items():
        assert FITTED[gen]["sustained_clock"] == pytest.approx(f.sustained_clock, abs=0.002)
        assert 0.5 <= f.sustained_clock <= 1
