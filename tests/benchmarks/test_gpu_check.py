"""`benchmarks/gpu_check.py` runs as it will find the GPU machine: no Ray, no Optuna, nothing
installed, the project from its source tree (here on the CPU, at the tiny size)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, without_ray


def test_gpu_check_runs_without_ray_optuna_or_an_install(tmp_path):
    env = without_ray(tmp_path)
    env["PYTHONPATH"] = str(tmp_path / "site")  # the script finds the source tree itself
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--device", "cpu", "--size", "tiny", "--steps", "2", "--out",
                           str(out)], check=False, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert {g["m"] for g in report["gemm_grid"]} and report["memory_bound"]
    rows = {r["strategy"]: r for r in report["strategies"]}
    assert len(rows) == 2 and all("measured_s" in r and "predicted_s" in r
                                  for r in rows.values()), rows
    assert "| strategy |" in proc.stdout
