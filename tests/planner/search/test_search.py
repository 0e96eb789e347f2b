"""The search: an Optuna study in SQLite, exported strategies that round-trip, and
`simulate` of the exported script predicting the same step time."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import sqlite3

import optuna
import pytest

from piper.program import Program
from planner.cli import main
from tests.conftest import GPT, ROOT, TINY


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
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = main(argv)
    (out / "stderr.txt").write_text(err.getvalue())  # what the user saw
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
    assert best["summary"]["pp"] * best["summary"]["dp"] * best["summary"]["tp"] == 4
    assert set(best["predicted"]) == {"step_time_s", "peak_memory_bytes", "ranks", "tokens_per_s",
                                      "mfu"}
    assert res["feasible_trials"] <= res["trials"] <= 12
    # the best's peak, by what holds it (weights, gradients, optimizer, activations, ...)
    mem = best["memory"]
    parts = ("weights", "gradients", "optimizer", "activations", "temporaries", "buffers")
    assert sum(mem[k] for k in parts) == max(best["predicted"]["peak_memory_bytes"])
    for f in ("best_strategy.py", "best_strategy.json"):
        rc, sim = run_json(capsys, ["simulate", GPT, *TINY, "--gpus", "4", "--strategy",
                                    str(out / f), "--json"])
        assert rc == 0
        assert sim["predicted"]["step_time_s"] == best["predicted"]["step_time_s"]
        assert sim["summary"] == best["summary"]


def test_strategy_files_carry_the_prediction_run_compares_with(searched):
    """`run --strategy` shows, beside its first step, what the search predicted."""
    from planner.report.export import predicted_of

    _, out, res = searched
    want = res["best"]["predicted"]
    for f in ("best_strategy.py", "best_strategy.json"):
        got = predicted_of(str(out / f))
        assert got == {"step_time_s": want["step_time_s"],
                       "peak_memory_bytes": max(want["peak_memory_bytes"])}, f
    script = (out / "best_strategy.py").read_text()
    assert "--precision bf16-mixed --strategy" in script, "a GPU cluster plans bf16-mixed"
    assert predicted_of(str(ROOT / "examples" / "strategies" / "gpt_tiny_1f1b.py")) is None


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


def test_a_study_of_another_problem_is_refused_not_overwritten(tmp_path, capsys):
    """The default study in one --out folder holds one problem: a second model there is a
    one-line error (exit 2), and the first search's trials and description stay."""
    argv = ["search", GPT, *TINY, "--gpus", "2", "--trials", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    capsys.readouterr()
    llama = str(ROOT / "examples" / "llama.py")
    assert main(["search", llama, *TINY, "--gpus", "2", "--trials", "2", "--out",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: study 'piper-plan' already holds a search of another "
                          "problem (model_path "), err
    assert err.endswith("pass another --out or --study-name")
    study = optuna.load_study(study_name="piper-plan", storage=f"sqlite:///{tmp_path}/study.db")
    assert len(study.trials) == 2 and study.user_attrs["model_path"].endswith("gpt.py")


def test_grid_sampler_covers_the_space(tmp_path, capsys):
    rc, res = run_json(capsys, ["search", GPT, *TINY, "--gpus", "2", "--sampler", "grid",
                                "--batch-size", "4", "--trials", "1000", "--out", str(tmp_path),
                                "--json"])
    assert rc == 0
    # every valid point of the space once, and nothing else: the grid walks the space's points
    from cost_models import CATALOG
    from piper.model_file import load_model_file
    from planner.search.evaluate import Evaluator
    from planner.search.space import search_space
    from search_spaces.pipeline import ALL_SCHEDULES

    ev = Evaluator(load_model_file(GPT, (("size", "tiny"),)), 2, 4, CATALOG["h100-80gb"])
    points = search_space(ev, 8)[0].points()
    study = optuna.load_study(study_name="piper-plan", storage=f"sqlite:///{tmp_path}/study.db")
    tried = [{k: t.params[k] for k in points[0]} for t in study.trials]  # the grid's terms
    assert sorted(map(_key, tried)) == sorted(map(_key, points))
    assert res["trials"] == sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert {p["schedule"] for p in points} == {*ALL_SCHEDULES, "none"}
    assert {p["zero"] for p in points} == {0, 1, 2, 3}


def _key(params: dict) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in params.items()))  # recompute: bool or str


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
    assert s["dp"] * s["pp"] * s["tp"] == 16
    assert res["best"]["predicted"]["step_time_s"] > 0


def test_clusters_lists_catalog(capsys):
    assert main(["clusters"]) == 0
    out = capsys.readouterr().out
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu"):
        assert name in out
    # the 16-bit peak a user plans with, not the fp32 one
    assert "312.0 TFLOP/s bf16" in out and "989.0 TFLOP/s bf16" in out


def test_clusters_toml_prints_an_entry_to_edit(capsys, tmp_path):
    import dataclasses

    from cost_models import CATALOG, load_cluster

    assert main(["clusters", "h100-80gb", "--toml"]) == 0
    path = tmp_path / "four_nics.toml"
    path.write_text(capsys.readouterr().out.replace(
        "inter_node_bandwidth = 47000000000.0", "inter_node_bandwidth = 23500000000.0"))
    mine = load_cluster(str(path))
    assert mine == dataclasses.replace(CATALOG["h100-80gb"], name="four_nics",
                                       inter_node_bandwidth=23.5e9)


def test_study_minimises_step_time_and_memory_with_a_memory_constraint(searched):
    _, out, res = searched
    study = optuna.load_study(study_name="piper-plan", storage=f"sqlite:///{out}/study.db")
    assert study.directions == [optuna.study.StudyDirection.MINIMIZE] * 2
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert done and all(set(t.constraints) == {"memory"} for t in done)
    assert all(t.values[1] == max(t.user_attrs["predicted"]["peak_memory_bytes"]) for t in done)
    front = [(p["predicted"]["step_time_s"], max(p["predicted"]["peak_memory_bytes"]))
             for p in res["pareto"]]
    assert front == sorted(front) and res["best"]["predicted"]["step_time_s"] == front[0][0]
    assert all(b[1] < a[1] for a, b in itertools.pairwise(front)), "each trades time for memory"


def test_show_lists_every_trial_the_best_and_the_pareto_front(searched, capsys):
    _, out, res = searched
    rc, shown = run_json(capsys, ["show", str(out), "--json"])
    assert rc == 0 and len(shown["trials"]) == 12
    assert shown["best"]["summary"] == res["best"]["summary"]
    assert [p["trial"] for p in shown["pareto"]] == [p["trial"] for p in res["pareto"]]
    assert shown["about"]["gpus"] == 4 and shown["about"]["cluster"] == "h100-80gb"
    assert main(["show", f"sqlite:///{out}/study.db"]) == 0
    text = capsys.readouterr().out
    assert f"best: trial {shown['best']['trial']}:" in text and "pareto front" in text


def test_exported_trials_round_trip_to_the_same_program_and_prediction(searched, tmp_path,
                                                                      capsys):
    _, out, _ = searched
    _, shown = run_json(capsys, ["show", str(out), "--json"])
    scored = [t for t in shown["trials"] if "predicted" in t]
    for trial in (None, scored[0]["trial"]):  # the best (default) and a chosen one
        files = []
        for ext in ("py", "json"):
            f = tmp_path / f"t{trial}.{ext}"
            argv = ["export", str(out / "study.db"), "--out", str(f)]
            assert main(argv + ([] if trial is None else ["--trial", str(trial)])) == 0
            files.append(f)
        assert Program.load(files[0]) == Program.load(files[1])
        want = shown["best"] if trial is None else scored[0]
        assert Program.load(files[1]) == Program.from_json(json.dumps(_program(out, want)))
        for f in files:
            _, sim = run_json(capsys, ["simulate", GPT, *TINY, "--gpus", "4", "--strategy",
                                       str(f), "--json"])
            assert sim["predicted"]["step_time_s"] == want["predicted"]["step_time_s"]


def _program(out, trial: dict) -> dict:
    study = optuna.load_study(study_name="piper-plan", storage=f"sqlite:///{out}/study.db")
    return study.trials[trial["trial"]].user_attrs["program"]


@pytest.mark.parametrize("argv, needle", [
    (["export", "{out}", "--trial", "999", "--out", "{tmp}/s.py"], "--trial 999: study"),
    (["export", "{out}", "--out", "{tmp}/s.txt"], "must end in .py"),
    (["show", "{tmp}/nothing.db"], "no study storage there"),
    (["show", "{out}", "--study-name", "other"], "no study 'other'"),
])
def test_bad_show_and_export_input_is_one_error_line(searched, tmp_path, capsys, argv, needle):
    _, out, _ = searched
    rc = main([a.format(out=out, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_search_with_a_seed_is_reproducible(tmp_path):
    from cost_models import CATALOG
    from piper.model_file import load_model_file
    from planner.search.evaluate import Evaluator
    from planner.search.loop import run_search
    from planner.search.space import search_space

    ev = Evaluator(load_model_file(GPT, (("size", "tiny"),)), 4, 32, CATALOG["h100-80gb"])
    space, _ = search_space(ev, 8)
    runs = []
    for k in range(2):
        storage = f"sqlite:///{tmp_path}/{k}.db"
        run_search(ev, space, trials=12, timeout=None, sampler="tpe", storage=storage,
                   study_name="s", seed=7, progress=False)
        study = optuna.load_study(study_name="s", storage=storage)
        runs.append([(t.params, t.values) for t in study.trials])
    assert runs[0] == runs[1]
    assert len({json.dumps(p, sort_keys=True) for p, _ in runs[0]}) == 12, "no point twice"


@pytest.mark.parametrize("sampler", ["gp", "nsga2"])
def test_every_sampler_searches_valid_points(sampler, tmp_path):
    from cost_models import CATALOG
    from piper.model_file import load_model_file
    from planner.search.evaluate import Evaluator
    from planner.search.loop import run_search
    from planner.search.space import search_space

    ev = Evaluator(load_model_file(GPT, (("size", "tiny"),)), 4, 32, CATALOG["h100-80gb"])
    space, _ = search_space(ev, 8)
    res = run_search(ev, space, trials=8, timeout=None, sampler=sampler,
                     storage=f"sqlite:///{tmp_path}/s.db", study_name="s", seed=0,
                     progress=False)
    assert res.best is not None and res.trials + res.pruned_trials == 8
    assert res.failed_trials == 0


def test_score_keeps_the_fastest_bucket_size_of_a_point():
    """Bucket sizes are scored per point (`PipelineSpace.variants`), not sampled: the
    trial keeps the sampled point and gets the fastest variant's Program and prediction."""
    import dataclasses

    from cost_models import CATALOG
    from piper.model_file import load_model_file
    from planner.search.evaluate import Evaluator
    from planner.search.loop import score
    from planner.search.space import search_space

    # a slow network: an all-reduce started inside the last backward saves real time
    cluster = dataclasses.replace(CATALOG["h100-80gb"], intra_node_bandwidth=1e8)
    ev = Evaluator(load_model_file(GPT, (("size", "tiny"),)), 4, 32, cluster)
    space, _ = search_space(ev, 8)
    point = {"pp": 1, "microbatches": 2, "schedule": "none", "zero": 0, "recompute": False,
             "comm_stream": False}
    variants = space.variants(point)
    assert [v.get("bucket_mb", 0) for v in variants] == [0, 25, 100]
    times = [ev.evaluate(space.program(**v)).prediction.step_time_s for v in variants]
    s = score(ev, space, point)
    assert s.point == point
    assert s.predicted["step_time_s"] == min(times)
    fastest = variants[times.index(min(times))]
    assert s.summary["bucket_mb"] == (fastest.get("bucket_mb") or None)
    # a ZeRO point's bucket variants are its units; one replica has no variants at all
    assert [v.get("bucket_mb", 0) for v in space.variants({**point, "zero": 2})] == [0, 25, 100]
    one = Evaluator(ev.spec, 1, 32, cluster)
    alone = {**point, "zero": 0}
    assert search_space(one, 8)[0].variants(alone) == [alone]


def test_a_new_study_starts_from_the_expert_defaults_and_beats_them(tmp_path):
    """FSDP, and FSDP with TP over a node, are tried first (torchtitan's defaults), so the
    pick is never slower than them in the simulator; a resumed study does not repeat them."""
    from cost_models import CATALOG
    from piper.model_file import load_model_file
    from planner.search.evaluate import Evaluator
    from planner.search.loop import run_search, score, starting_points
    from planner.search.space import search_space

    ev = Evaluator(load_model_file(GPT, (("size", "tiny"),)), 4, 32, CATALOG["h100-80gb"])
    space, _ = search_space(ev, 8)
    defaults = space.expert_defaults()
    assert max(space.tps) > 1
    assert {(p["pp"], p["zero"], p.get("tp", 1)) for p in defaults} == {
        (1, 3, 1), (1, 3, max(space.tps))}
    storage = f"sqlite:///{tmp_path}/s.db"
    res = run_search(ev, space, trials=12, timeout=None, sampler="tpe", storage=storage,
                     study_name="s", seed=0, progress=False)
    study = optuna.load_study(study_name="s", storage=storage)
    first = defaults[:3]
    assert [t.user_attrs["point"] for t in study.trials[:3]] == first
    assert res.best is not None
    assert all(res.best.predicted["step_time_s"]
               <= score(ev, space, p).predicted["step_time_s"] for p in first)
    assert starting_points(space, "tpe", 4, earlier=12) == []
    assert starting_points(space, "grid", 12, earlier=0) == []


def test_simulate_prices_tensor_parallelism_across_nodes_instead_of_refusing_it(capsys):
    """tp 16 over two 8-GPU nodes (as published Megatron runs did) simulates, with a
    warning, its every-layer collectives over the network: slower than tp 8 in a node."""
    common = ["simulate", GPT, *TINY, "--model-arg", "heads=16", "--model-arg", "dim=512",
              "--gpus", "16", "--cluster", "a100-80gb", "--json"]
    assert main([*common, "--tp", "16"]) == 0
    printed = capsys.readouterr()
    across = json.loads(printed.out)
    assert across["summary"]["tp"] == 16
    assert "warning: --tp 16 spans nodes of cluster a100-80gb" in printed.err
    rc, inside = run_json(capsys, [*common, "--tp", "8", "--dp", "2"])
    assert rc == 0
    assert across["predicted"]["step_time_s"] > inside["predicted"]["step_time_s"]


def test_every_output_names_a_strategy_the_same_way(searched):
    """trials.csv, summary.txt's table, the study and best_strategy.py agree on each
    strategy (a pp=1 strategy's schedule is `none` in each), and trials.csv has every
    figure of the summary."""
    import csv

    from planner.report.export import TRIAL_COLUMNS

    _, out, res = searched
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert set(TRIAL_COLUMNS) <= set(rows[0]) and {"tp", "sp", "ep", "zero", "recompute"} <= set(
        rows[0])
    study = optuna.load_study(study_name="piper-plan", storage=f"sqlite:///{out}/study.db")
    names = {t.number: t.user_attrs["program"]["name"] for t in study.trials
             if "program" in t.user_attrs}
    for r in rows:
        assert r["schedule"] == names[int(r["trial"])]
        assert (r["schedule"] == "none") == (r["pp"] == "1"), r
    assert any(r["pp"] == "1" for r in rows) and any(r["pp"] != "1" for r in rows)
    by_trial = {r["trial"]: r for r in rows}
    table = [line.split() for line in (out / "summary.txt").read_text().splitlines()
             if line.strip()[:1].isdigit() and len(line.split()) > 8]
    assert table
    for cells in table:  # trial dp pp tp ep cp zero mb schedule ...
        assert cells[8] == by_trial[cells[0]]["schedule"], cells
    best = res["best"]
    assert f"name={best['program']['name']!r}" in (out / "best_strategy.py").read_text()
    wrote = [line for line in (out / "stderr.txt").read_text().splitlines()
             if line.startswith("wrote ")]
    assert len(wrote) == 1 and "trials.csv" in wrote[0] and "summary.txt" in wrote[0]
    assert best["summary"]["schedule"] == best["program"]["name"]


def test_search_says_how_accurate_its_cluster_is(searched):
    _, _, res = searched
    assert res["accuracy"].startswith("accuracy: on ") and "published" in res["accuracy"]
