"""Write a search's outputs: best_strategy.py / .json, trials.csv, summary.txt, and the best
plan's figures (timeline.png, trace.json) with the trials' pareto.png."""

from __future__ import annotations

import csv
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from piper.model_file import ModelSpec
from planner.report.tables import predicted_line, results_table, summary_line

if TYPE_CHECKING:  # run reads a strategy's prediction here, and must not need Optuna
    from planner.search.evaluate import Evaluation
    from planner.search.records import SearchResult, TrialRecord


def strategy_header(spec: ModelSpec, cluster: str, gpus: int, batch_size: int,
                    rec: TrialRecord, script: Path, precision: str = "fp32") -> list[str]:
    args = " ".join([*(f"--model-arg {k}={v}" for k, v in spec.model_args),
                     *(f"--{k.replace('_', '-')} {v}" for k, v in spec.options)])
    base = f"{spec.path} --gpus {gpus} {args}".replace("  ", " ").strip()
    cmd = shlex.join(["piper-plan", *sys.argv[1:]]) if sys.argv[1:] else "piper-plan search"
    return [
        "Strategy found by piper-plan. Edit the directives and rerun; see docs of each directive.",
        f"model: {spec.path}" + (f" ({args})" if args else ""),
        f"cluster: {cluster}, {gpus} devices, global batch {batch_size}, {precision}",
        f"summary: {summary_line(rec.summary)}",
        f"predicted: {predicted_line(rec.predicted)}",
        f"{PREDICTED_TAG} {json.dumps(_measurable(rec.predicted))}",
        f"found by: {cmd}",
        (f"simulate: piper-plan simulate {base} --cluster {cluster} --batch-size {batch_size} "
         f"--precision {precision} --strategy {script}"),
        (f"run:      piper-plan run {base} --batch-size {batch_size} --precision {precision} "
         f"--strategy {script}"),
    ]


PREDICTED_TAG = "predicted-json:"
"""A strategy file's header line holding what the search predicted, for `run` to compare."""


def _measurable(p: dict) -> dict:
    return {"step_time_s": p["step_time_s"], "peak_memory_bytes": max(p["peak_memory_bytes"])}


def strategy_json(rec: TrialRecord) -> str:
    """A trial's Program as JSON, with what the search predicted for it."""
    return json.dumps({**json.loads(rec.program.to_json()),
                       "predicted": _measurable(rec.predicted)}, indent=1) + "\n"


def predicted_of(path: str) -> dict | None:
    """What the search predicted for a strategy file it wrote (None: a hand-written one)."""
    text = Path(path).read_text()
    if path.endswith(".json"):
        return json.loads(text).get("predicted")
    for line in text.splitlines():
        if line.startswith(f"# {PREDICTED_TAG}"):
            return json.loads(line.split(PREDICTED_TAG, 1)[1])
    return None


TRIAL_COLUMNS = ("dp", "pp", "tp", "sp", "ep", "cp", "zero", "schedule", "virtual_stages",
                 "microbatches", "recompute", "comm_stream", "bucket_mb")
"""trials.csv's strategy columns: every figure of a Program's summary."""


def write_outputs(out: Path, spec: ModelSpec, cluster: str, gpus: int, batch_size: int,
                  result: SearchResult, precision: str = "fp32") -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    best = result.best
    if best is not None:
        py, js = out / "best_strategy.py", out / "best_strategy.json"
        py.write_text(best.program.to_python(
            strategy_header(spec, cluster, gpus, batch_size, best, py, precision)))
        js.write_text(strategy_json(best))
        files.update(strategy_file=py, strategy_json=js)
    trials = out / "trials.csv"
    with trials.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", *TRIAL_COLUMNS, "step_time_s", "tokens_per_s", "mfu",
                    "max_peak_memory_bytes", "feasible"])
        for r in sorted(result.records, key=lambda r: r.number):
            s, p = r.summary, r.predicted
            w.writerow([r.number, *(s.get(c, 1 if c == "cp" else None) for c in TRIAL_COLUMNS),
                        p["step_time_s"],
                        p["tokens_per_s"], p["mfu"], max(p["peak_memory_bytes"]),
                        r.feasible])
    summary = out / "summary.txt"
    summary.write_text(
        f"{result.trials} trials, {result.feasible_trials} feasible, "
        f"{result.search_time_s:.1f} s\n\n{results_table(result.records)}\n")
    files.update(trials=trials, summary=summary)
    return files


def write_figures(out: Path, best: Evaluation, result: SearchResult, *,
                  memory_limit_bytes: int | None = None,
                  stands_for: dict[int, tuple[int, ...]] | None = None) -> dict[str, Path]:
    """timeline.png and trace.json of the best plan's simulated step; pareto.png of all
    feasible trials. Plotting imports matplotlib, so only a search that found a best pays."""
    from planner.report.plots import write_pareto, write_timeline
    from planner.report.trace import write_trace

    out.mkdir(parents=True, exist_ok=True)
    files = {"timeline": out / "timeline.png", "pareto": out / "pareto.png",
             "trace": out / "trace.json"}
    spans = best.prediction.spans
    write_timeline(spans, files["timeline"], stands_for=stands_for,
                   title=f"best strategy: {summary_line(best.summary)} "
                         f"(bubble {best.prediction.bubble_fraction * 100:.1f}%)")
    write_trace(spans, files["trace"])
    write_pareto(result.records, files["pareto"], memory_limit_bytes=memory_limit_bytes)
    return files
