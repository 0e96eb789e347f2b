"""The search: an Optuna study in SQLite, exported strategies that round-trip, and
`simulate` of the exported script predicting the same step time."""

from __future__ import annotations

import contextlib
import io
import json
import sqlite3

import pytest

from piper.program import Program
from planner.cli import main
from tests.conftest import GPT, TINY


def run_json(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    return rc, json.loads(out[0])


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("search")
    argv = ["search", GPT, *TINY, "--gpus", "4", "--trials", "12", "--seed", "3",
            "--out", str(out), "--json"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return rc, out, json.loads(buf.getvalue())


def test_search_writes_outputs_and_study(searched):
    rc, out, _ = searched
    assert rc == 0
    for name in ("best_strategy.py", "best_strategy.json", "study.db", "trials.csv",
                 "summary.txt"):
        assert (out / name).is_file(), name
    with sqlite3.connect(out / "study.db") as db:
        n = db.execute("select count(*) from trials").fetchone()[0]
    assert n == 12
    script = (out / "best_strategy.py").read_text()
    assert script.startswith("# Strategy found by piper-plan")
    assert "# predicted: step" in script and "piper-plan simulate" in script


def test_exported_script_and_json_are_the_same_program(searched):
    _, out, _ = searched
    assert Program.load(out / "best_strategy.py") == Program.load(out / "best_strategy.json")


def test_simulating_exported_strategy_gives_searched_prediction(searched, capsys):
    _, out, res = searched
    best = res["best"]
    assert best["summary"]["pp"] * best["summary"]["dp"] == 4
    assert set(best["predicted"]) == {"step_time_s", "peak_memory_bytes", "tokens_per_s", "mfu"}
    assert res["feasible_trials"] <= res["trials"] <= 12
    for f in ("best_strategy.py", "best_strategy.json"):
        rc, sim = run_json(capsys, ["simulate", GPT, *TINY, "--gpus", "4", "--strategy",
                                    str(out / f), "--json"])
        assert rc == 0
        assert sim["predicted"]["step_time_s"] == best["predicted"]["step_time_s"]
        assert sim["summary"] == best["summary"]


def test_best_is_fastest_feasible_trial(searched):
    _, out, _ = searched
    import csv

    rows = list(csv.DictReader((out / "trials.csv").open()))
    feasible = [float(r["step_time_s"]) for r in rows if r["feasible"] == "True"]
    header = (out / "best_strategy.py").read_text().splitlines()[4]
    assert header.startswith("# predicted: step")
    best_ms = float(header.split("step ")[1].split(" ms")[0])
    assert best_ms == pytest.approx(min(feasible) * 1e3, abs=0.006)


def test_resume_adds_trials_to_the_same_study(tmp_path, capsys):
    argv = ["search", GPT, *TINY, "--gpus", "2", "--trials", "4", "--out", str(tmp_path),
            "--json"]
    _, first = run_json(capsys, argv)
    _, second = run_json(capsys, argv)
    assert first["trials"] + 4 >= second["trials"] > first["trials"]
    with sqlite3.connect(tmp_path / "study.db") as db:
        assert db.execute("select count(*) from trials").fetchone()[0] == 8


def test_grid_sampler_covers_the_space(tmp_path, capsys):
    rc, res = run_json(capsys, ["search", GPT, *TINY, "--gpus", "2", "--sampler", "grid",
                                "--trials", "1000", "--out", str(tmp_path), "--json"])
    assert rc == 0
    # every feasible point of the space once: the grid is the space's enumeration
    from cost_models import CATALOG
    from piper.model_file import load_model_file
    from planner.evaluate import Evaluator
    from search_spaces import PipelineSpace
    from search_spaces.pipeline import ALL_SCHEDULES

    ev = Evaluator(load_model_file(GPT, (("size", "tiny"),)), 2, 32, CATALOG["h100-80gb"])
    space = PipelineSpace(ev.captured.graph.names, ev.region_costs(), 2, 32,
                          schedules=ALL_SCHEDULES, zeros=(0, 1, 2, 3))
    feasible = list(space.enumerate())
    assert res["trials"] == len(feasible)
    assert {p["schedule"] for p, _ in feasible} == set(ALL_SCHEDULES)
    assert {p["zero"] for p, _ in feasible} == {0, 1, 2, 3}


def test_memory_infeasible_search_exits_1(tmp_path, capsys):
    cluster = tmp_path / "small.toml"
    cluster.write_text(
        'name = "small"\ndevice = "tiny"\ngpus_per_node = 8\nmemory_bytes = 1000\n'
        'flops = 1e12\ncompute_efficiency = 0.5\nintra_node_bandwidth = 1e11\n'
        'intra_node_latency = 1e-6\ninter_node_bandwidth = 1e10\ninter_node_latency = 1e-5\n')
    rc = main(["search", GPT, *TINY, "--gpus", "2", "--trials", "3", "--cluster", str(cluster),
               "--out", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert rc == 1
    assert json.loads(captured.out)["best"] is None
    assert "no feasible strategy" in captured.err


def test_default_search_on_1b_gpt_finds_a_strategy(tmp_path, capsys):
    """The README's main command, shortened to a few trials."""
    rc, res = run_json(capsys, ["search", GPT, "--gpus", "16", "--trials", "6", "--out",
                                str(tmp_path), "--json"])
    assert rc == 0
    s = res["best"]["summary"]
    assert s["dp"] * s["pp"] == 16
    assert res["best"]["predicted"]["step_time_s"] > 0


def test_clusters_lists_catalog(capsys):
    assert main(["clusters"]) == 0
    out = capsys.readouterr().out
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu"):
        assert name in out
