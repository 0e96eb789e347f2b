"""What `simulate --timeline/--trace` and `search --out` draw: valid PNG Gantt charts and
Pareto plots, and Perfetto traces whose flow arrows join each SEND to its RECV."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from piper.program import Program
from planner.cli import main
from planner.report.plots import write_pareto
from planner.report.tables import pareto
from planner.search.loop import TrialRecord
from tests.conftest import GPT, TINY

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    height, width, _ = imread(path).shape
    assert height > 100 and width > 100


def assert_flows_join_messages(trace: dict) -> None:
    """Every message is one flow: its SEND slice starts it (`flow_out`) and its RECV slice
    on another rank ends it (`flow_in`), bound by a `bind_id` no other message uses."""
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    sends = [e for e in slices if e["name"].startswith("SEND")]
    recvs = [e for e in slices if e["name"].startswith("RECV")]
    out = {e["bind_id"]: e for e in slices if e.get("flow_out")}
    into = {e["bind_id"]: e for e in slices if e.get("flow_in")}
    assert sends and len(sends) == len(recvs)
    assert out.keys() == into.keys() and len(out) == len(sends)
    assert all(e in sends for e in out.values()) and all(e in recvs for e in into.values())
    for bind, send in out.items():
        recv = into[bind]
        assert send["pid"] != recv["pid"]
        assert send["ts"] <= recv["ts"] + recv["dur"]  # a message lands after it leaves


def test_simulate_writes_a_gantt_png_and_a_trace_with_flows(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture
                                                            ) -> None:
    png, trace = tmp_path / "timeline.png", tmp_path / "trace.json"
    rc = main(["simulate", GPT, *TINY, "--gpus", "4", "--pp", "2", "--dp", "2",
               "--schedule", "zb1p", "--microbatches", "4", "--comm-stream",
               "--timeline", str(png), "--trace", str(trace)])
    out = capsys.readouterr().out
    assert rc == 0
    assert_png(png)
    events = json.loads(trace.read_text())
    assert_flows_join_messages(events)
    assert {e["tid"] for e in events["traceEvents"] if e["ph"] == "X"} == {"compute", "comm"}
    # dp=2 on one node: the replicas run alike, so one is simulated and stands for both
    assert "bubble" in out and "rank 2 (and 1 replica alike): math" in out and "comm" in out


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("figures")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["search", GPT, *TINY, "--gpus", "4", "--trials", "4", "--seed", "1",
                   "--out", str(out), "--json"])
    assert rc == 0
    return out, json.loads(stdout.getvalue())


def test_search_writes_timeline_and_pareto_pngs(searched: tuple[Path, dict]) -> None:
    out, _ = searched
    assert_png(out / "timeline.png")
    assert_png(out / "pareto.png")


def test_search_writes_the_best_plans_trace(searched: tuple[Path, dict]) -> None:
    out, result = searched
    trace = json.loads((out / "trace.json").read_text())
    shape = result["best"]["summary"]
    ranks = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    # a Plan's ranks, pp x dp, one replica of each kind (the others run alike): every
    # pipeline device is there
    assert ranks <= set(range(shape["pp"] * shape["dp"]))
    assert {r // shape["dp"] for r in ranks} == set(range(shape["pp"]))
    if shape["pp"] > 1:
        assert_flows_join_messages(trace)


def record(number: int, step_ms: float, peak_mib: int) -> TrialRecord:
    summary = {"dp": 1, "pp": 2, "tp": 1, "ep": 1, "zero": 0, "schedule": "1f1b",
               "virtual_stages": 1, "microbatches": 4, "recompute": False,
               "comm_stream": False}
    return TrialRecord(number, summary, Program([]), {
        "step_time_s": step_ms / 1e3, "peak_memory_bytes": [peak_mib * 2**20, 0],
        "tokens_per_s": 1.0, "mfu": 0.1}, True)


def test_pareto_front_keeps_every_trade_off_between_time_and_memory() -> None:
    trade_offs = [record(i, 10.0 * (i + 1), 10 - i) for i in range(4)]  # slower, smaller
    dominated = record(9, 25.0, 10)  # slower and larger than trial 1
    assert [r.number for r in pareto([*trade_offs, dominated])] == [0, 1, 2, 3]


def test_pareto_png_draws_trials_of_any_scale(tmp_path: Path) -> None:
    records = [record(i, 10.0 * (i + 1), 10 - i) for i in range(4)]
    write_pareto(records, tmp_path / "p.png", memory_limit_bytes=80 * 2**30)
    write_pareto([], tmp_path / "empty.png")
    assert_png(tmp_path / "p.png")
    assert_png(tmp_path / "empty.png")


def test_pareto_labels_do_not_overlap(tmp_path: Path) -> None:
    """A front of many close points (a long label each): every label box is clear of the
    others."""
    front = [record(i, 10.0 + 0.05 * i, 40 - i) for i in range(12)]
    for r in front:
        r.summary.update(pp=4, schedule="interleaved-1f1b", virtual_stages=2, dp=64, tp=8)
    boxes = write_pareto(front, tmp_path / "p.png")
    assert len(boxes) == 12
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)
    assert_png(tmp_path / "p.png")
