"""How far the GPU catalog's predictions are from published training runs, per catalog
cluster: the figures `benchmarks/published_runs.py --accuracy` measured (kept in
`accuracy.json` beside this module), so that `search` says beside what it priced how much
to trust it (a prediction ranks strategies within this error; it is not a promise)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PATH = Path(__file__).with_name("accuracy.json")
ALL = "all"
"""The key of the figures over every published run."""
MOE = " moe"
"""Suffix of the keys of mixture-of-experts models' figures ("h100-80gb moe", "all moe"):
their runs are priced by other mechanisms (routed experts, all-to-alls), so their error
is kept apart."""


@dataclass(frozen=True)
class Accuracy:
    """Predicted against published step time over `runs` runs: mean absolute error and
    mean signed error (negative: the prediction is faster than the run was), in percent."""

    runs: int
    mape_pct: float
    signed_pct: float
    sources: tuple[str, ...]
    measured: str  # the date of the benchmark run

    def line(self, cluster: str) -> str:
        lean = "optimistic" if self.signed_pct < 0 else "pessimistic"
        return (f"accuracy: on {self.runs} published {cluster} training runs the predicted "
                f"step time is off by {self.mape_pct:.1f}% on average ({lean}: mean "
                f"{self.signed_pct:+.1f}%; {', '.join(self.sources)}; measured "
                f"{self.measured}): read the step times as a ranking, not a promise")


def load(path: Path = PATH) -> dict[str, Accuracy]:
    """Cluster name (or `ALL`) -> its figures; empty if never measured."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {k: Accuracy(v["runs"], v["mape_pct"], v["signed_pct"], tuple(v["sources"]),
                        data["measured"]) for k, v in data["clusters"].items()}


def accuracy_line(cluster: str, path: Path = PATH, moe: bool = False) -> str:
    """What `search` prints about the predictions for `cluster` (a catalog name, or the
    name a cluster file gives itself); `moe`: for a model with routed experts."""
    known = load(path)
    kind = MOE if moe else ""
    if cluster + kind in known:
        return known[cluster + kind].line(f"{'MoE ' if moe else ''}{cluster}")
    overall = known.get(ALL + kind)
    said = (f"; over all {overall.runs} published{' MoE' if moe else ''} runs on the "
            f"catalog's GPUs: {overall.mape_pct:.1f}% ({overall.signed_pct:+.1f}%)"
            if overall else "")
    return (f"accuracy: no published{' MoE' if moe else ''} runs check the predictions for "
            f"{cluster}{said}: read the step times as a ranking, not a promise")
