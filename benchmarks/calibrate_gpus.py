"""Fit the GPU coefficient no source publishes, per GPU generation, on published runs.

    python benchmarks/calibrate_gpus.py [--write benchmarks/data/calibration_rows.json]

Every exact dense row of `benchmarks/published_runs.py` (rows marked `~` used something the
simulator does not express, and would bias the fit; mixture-of-experts rows are reported
apart) is simulated twice: at full clock and
at a lower one (`cost_models.gpu_fit`). The fit of `sustained_clock` per generation is
printed with its in-sample error and its leave-one-source-out error
(each source predicted with coefficients fitted on the others); the values go into
`cost_models.catalog.FITTED` by hand, and `--write` stores the simulated rows so that
`tests/cost_models/test_gpu_fit.py` refits them and checks the catalog holds the fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published_runs as pr

from cost_models import ClusterSpec
from cost_models.gpu_fit import (
    SLOW_STEP,
    CalibrationRow,
    by_generation,
    leave_one_source_out,
    mape,
)

TABLE = Path(__file__).resolve().parent / "data" / "calibration_rows.json"


def generation(cluster: str) -> str:
    return "a100" if cluster.startswith("a100") else "h100"


def _at(slowdown: float):
    def adjust(c: ClusterSpec) -> ClusterSpec:
        return dataclasses.replace(c, sustained_clock=1 / (1 + slowdown))
    return adjust


def simulate_rows(runs: list[pr.Run]) -> list[CalibrationRow]:
    evaluators = pr.Evaluators()
    rows = []
    for run in runs:
        base, slow = (pr.simulate(run, evaluators, _at(s)).predicted_s
                      for s in (0.0, SLOW_STEP))
        rows.append(CalibrationRow(run.source, run.label, generation(run.cluster),
                                   run.published_s, base, slow))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", type=Path, nargs="?", const=TABLE,
                   help=f"store the simulated rows (default {TABLE})")
    args = p.parse_args()
    # mixture-of-experts rows are reported apart (their own mechanisms) and stay out
    runs = [r for make in pr.SOURCES.values() for r in make() if not r.approx and not r.moe]
    start = time.perf_counter()
    rows = simulate_rows(runs)
    print(f"{len(rows)} exact rows simulated twice in {time.perf_counter() - start:.0f} s")
    fits = by_generation(rows)
    for gen, f in fits.items():
        mine = [r for r in rows if r.generation == gen]
        print(f"{gen}: sustained_clock {f.sustained_clock:.3f}; in-sample MAPE "
              f"{mape(mine, f):.1f}% ({len(mine)} rows)")
    print("leave-one-source-out MAPE (each source under coefficients fitted on the others):")
    for (gen, source), err in leave_one_source_out(rows).items():
        n = sum(1 for r in rows if r.generation == gen and r.source == source)
        print(f"  {gen} {source:<14} {err:5.1f}%  ({n} rows)")
    if args.write:
        args.write.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=0))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
