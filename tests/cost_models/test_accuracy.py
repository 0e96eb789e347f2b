"""What `search` says of its own accuracy comes from the published-runs benchmark's
figures, and the README quotes the same figures."""

from __future__ import annotations

import json
import re

from cost_models.accuracy import ALL, MOE, PATH, accuracy_line, load
from tests.conftest import ROOT


def test_the_figures_are_per_catalog_cluster_and_overall():
    known = load()
    assert ALL in known and known[ALL].runs >= 200
    for kind in ("", MOE):  # dense and MoE models' runs apart
        per_cluster = [a.runs for k, a in known.items()
                       if k not in (ALL, ALL + MOE) and k.endswith(MOE) == bool(kind)]
        assert sum(per_cluster) == known[ALL + kind].runs
    data = json.loads(PATH.read_text())
    assert data["command"].startswith("python benchmarks/published_runs.py")


def test_the_line_names_the_cluster_its_runs_and_the_sign(tmp_path):
    path = tmp_path / "accuracy.json"
    path.write_text(json.dumps({"measured": "2026-01-01", "clusters": {
        "h100-80gb": {"runs": 3, "mape_pct": 12.0, "signed_pct": -9.5, "sources": ["x"]},
        ALL: {"runs": 3, "mape_pct": 12.0, "signed_pct": -9.5, "sources": ["x"]}}}))
    line = accuracy_line("h100-80gb", path)
    assert line.startswith("accuracy: on 3 published h100-80gb training runs")
    assert "12.0% on average (optimistic: mean -9.5%" in line
    other = accuracy_line("my-box", path)
    assert "no published runs check the predictions for my-box" in other
    assert "all 3 published runs" in other
    assert "no published runs" in accuracy_line("h100-80gb", tmp_path / "none.json")
    moe = accuracy_line("h100-80gb", path, moe=True)  # dense runs do not vouch for MoE
    assert "no published MoE runs check the predictions for h100-80gb" in moe


def test_the_readme_quotes_todays_overall_figures():
    overall = load()[ALL]
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"against (\d+) published GPU training runs the predicted step time is off "
                  r"by ([\d.]+)% on average, and (\w+) \(the mean signed error is ([-\d.]+)%", text)
    assert m, "README states the accuracy"
    runs, mape, lean, signed = m.groups()
    assert int(runs) == overall.runs and float(mape) == round(overall.mape_pct, 1)
    assert float(signed) == round(overall.signed_pct, 1)
    assert lean == ("optimistic" if overall.signed_pct < 0 else "pessimistic")
