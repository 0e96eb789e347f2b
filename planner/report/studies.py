"""`piper-plan show` and `export`: read a search's study back from its storage alone.

The search stores what each trial was (point, strategy summary, Program, prediction) and what
the study was about (model, gpus, batch, cluster), so a study can be listed, and any trial's
strategy written out as a script or JSON, long after the search — or while it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna

from piper.errors import PiperError
from piper.model_file import ModelSpec
from planner.report.tables import fmt_bytes, pareto, predicted_line, summary_line
from planner.search.records import TrialRecord, open_study, record, result_of


def storage_url(arg: str) -> str:
    """STORAGE as given on the command line: an Optuna URL, a .db file, or a search's --out
    folder (its study.db). A missing SQLite file is an error, not a new empty study."""
    if "://" in arg and not arg.startswith("sqlite:///"):
        return arg
    path = Path(arg.removeprefix("sqlite:///"))
    if path.is_dir():
        path = path / "study.db"
    if not path.is_file():
        raise PiperError(f"{arg}: no study storage there (give a URL such as "
                         "sqlite:///piper_plan_out/study.db, a .db file or a search's --out "
                         "folder)")
    return f"sqlite:///{path.resolve()}"


def load(storage: str, study_name: str) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return open_study(storage_url(storage), study_name, create=False)


def about(study: optuna.Study) -> str:
    a = study.user_attrs
    args = " ".join(f"{k}={v}" for k, v in a.get("model_args", []))
    return (f"study {study.study_name!r}: {a.get('model', '?')}" + (f" ({args})" if args else "")
            + f", {a.get('gpus', '?')} devices of {a.get('cluster', '?')}, global batch "
            f"{a.get('batch_size', '?')}")


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """Every trial: number, state, and its strategy, figures or reason where it has them."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"trial": t.number, "state": t.state.name,
                               "point": t.user_attrs.get("point")}
        if "summary" in t.user_attrs:
            row.update(summary=t.user_attrs["summary"], predicted=t.user_attrs["predicted"],
                       feasible=all(c <= 0 for c in t.constraints.values()))
        reason = t.user_attrs.get("pruned_reason") or t.user_attrs.get("fail_reason")
        if reason:
            row["reason"] = reason
        rows.append(row)
    return rows


def show_text(study: optuna.Study) -> str:
    rows = trial_rows(study)
    res = result_of(study, 0.0)
    lines = [about(study), (f"{len(rows)} trials: {res.trials} scored ({res.feasible_trials} "
             f"fit in memory), {res.pruned_trials} pruned, {res.failed_trials} failed"), ""]
    head = f"{'#':>5} {'state':<8} {'step ms':>11} {'peak mem':>10} fits  strategy / reason"
    lines += [head, "-" * len(head)]
    for r in rows:
        if "predicted" in r:
            p = r["predicted"]
            lines.append(f"{r['trial']:>5} {r['state']:<8} {p['step_time_s'] * 1e3:>11.2f} "
                         f"{fmt_bytes(max(p['peak_memory_bytes'])):>10} "
                         f"{'yes' if r['feasible'] else 'no ':<4} {summary_line(r['summary'])}")
        else:
            what = r.get("reason") or (_point_line(r["point"]) if r["point"] else "")
            lines.append(f"{r['trial']:>5} {r['state']:<8} {'':>11} {'':>10} {'':<4} {what}")
    lines.append("")
    if res.best is None:
        lines.append("best: none fits in memory")
    else:
        lines.append(f"best: trial {res.best.number}: {summary_line(res.best.summary)}")
        lines.append(f"      {predicted_line(res.best.predicted)}")
    front = pareto(res.records)
    lines.append(f"pareto front (step time vs peak memory, {len(front)} trials):")
    lines += [f"  trial {r.number:>4}: {r.predicted['step_time_s'] * 1e3:.2f} ms, "
              f"{fmt_bytes(max(r.predicted['peak_memory_bytes']))}  {summary_line(r.summary)}"
              for r in front]
    return "\n".join(lines)


def _point_line(point: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items())


def show_json(study: optuna.Study) -> dict[str, Any]:
    res = result_of(study, 0.0)
    return {"study": study.study_name, "about": dict(study.user_attrs),
            "trials": trial_rows(study),
            "best": None if res.best is None else _brief(res.best),
            "pareto": [_brief(r) for r in pareto(res.records)]}


def _brief(r: TrialRecord) -> dict[str, Any]:
    return {"trial": r.number, "summary": r.summary, "predicted": r.predicted}


def chosen(study: optuna.Study, trial: int | None) -> TrialRecord:
    """Trial `trial`'s strategy, or the best (fastest that fits) when None."""
    if trial is None:
        best = result_of(study, 0.0).best
        if best is None:
            raise PiperError(f"study {study.study_name!r} has no strategy that fits in memory; "
                             "pass --trial N to export another")
        return best
    trials = study.get_trials(deepcopy=False)
    if not 0 <= trial < len(trials):
        raise PiperError(f"--trial {trial}: study {study.study_name!r} has trials "
                         f"0..{len(trials) - 1}")
    t = trials[trial]
    if "program" not in t.user_attrs:
        why = t.user_attrs.get("pruned_reason") or t.user_attrs.get("fail_reason") or "no result"
        raise PiperError(f"trial {trial} has no strategy ({t.state.name.lower()}: {why})")
    return record(t)


def export_to(study: optuna.Study, trial: int | None, target: str, out: str
              ) -> tuple[Path, TrialRecord, tuple[str, ...]]:
    """Write the chosen trial as `target`'s config (`planner.report.frameworks`); returns
    the file, the trial and the notes on what the target could not express as found."""
    from piper.loading import load_model
    from planner.report.frameworks import write_config

    rec = chosen(study, trial)
    a = study.user_attrs
    try:  # the model's shape picks the target's own model definition
        spec = load_model(a.get("model_path") or a["model"],
                          tuple(tuple(x) for x in a.get("model_args", [])),
                          tuple(tuple(x) for x in a.get("options", [])))
    except (PiperError, OSError, KeyError) as e:
        raise PiperError(f"--to {target}: the study's model cannot be read to name the "
                         f"target's model ({e})") from None
    path = Path(out)
    done = write_config(target, path, rec.program, rec.summary, a["batch_size"], a["gpus"],
                        spec, a.get("precision", "bf16-mixed"))
    return path, rec, done.notes


def export(study: optuna.Study, trial: int | None, out: str) -> tuple[Path, TrialRecord]:
    """Write the chosen trial's Program to `out` (.py script with a header, or .json)."""
    from planner.report.export import strategy_header, strategy_json

    path = Path(out)
    if path.suffix not in (".py", ".json"):
        raise PiperError(f"--out {out}: must end in .py (a strategy script) or .json")
    rec = chosen(study, trial)
    if path.suffix == ".json":
        text = strategy_json(rec)
    else:
        a = study.user_attrs
        spec = ModelSpec(path=a.get("model", "MODEL.py"),
                         model_args=tuple(tuple(x) for x in a.get("model_args", [])))
        header = strategy_header(spec, a.get("cluster", "?"), a.get("gpus", 0),
                                 a.get("batch_size", 0), rec, path, a.get("precision", "fp32"))
        header = [f"found by: trial {rec.number} of study {study.study_name!r} (exported "
                  f"by {line.removeprefix('found by: ')})" if line.startswith("found by:")
                  else line for line in header]
        text = rec.program.to_python(header)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path, rec

