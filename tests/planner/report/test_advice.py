"""Warnings a search gives when the planner is not what limits the result (`planner.report.advice`):
one line each on stderr, and a list in --json."""

from __future__ import annotations

import json

from piper.dag import Kind
from planner.cli import main
from planner.report.advice import warnings_for
from planner.search.records import SearchResult
from runtime.lowering.dryrun import Span
from runtime.lowering.plan import Task
from tests.conftest import GPT, TINY

PIPELINE = {"pp": 4, "dp": 1}
FLAT = {"pp": 1, "dp": 8}


def result(proposed: int = 10, over_memory: int = 0) -> SearchResult:
    return SearchResult(None, 0, 0, 0.0, (), over_memory=over_memory, proposed=proposed)


def spans(busy: float) -> list[Span]:
    """One rank computing `busy` of a 1 s step, idle the rest."""
    return [Span(0, "compute", Task(Kind.FWD, 0, 0), 0.0, busy),
            Span(0, "compute", Task(Kind.UPDATE, 0), 0.999, 1.0)]


def test_nothing_to_say_about_a_search_that_is_not_held_back():
    assert warnings_for(gpus=8, batch=32, result=result(), best_spans=spans(0.9),
                        best_summary=PIPELINE, memory_bytes=2**30) == []


def test_a_batch_that_caps_data_parallelism_says_which_batch_would_not():
    (w,) = warnings_for(gpus=1024, batch=32, result=result(), best_spans=[],
                        best_summary=None, memory_bytes=2**30)
    assert w.startswith("the global batch of 32 samples caps data parallelism at dp=32 of "
                        "the 1024 devices")
    assert w.endswith("--batch-size 1024 (a multiple of 1024) would let every device hold "
                      "a replica")


def test_idle_devices_are_named_with_what_shrinks_the_idle_time():
    (w,) = warnings_for(gpus=8, batch=32, result=result(), best_spans=spans(0.3),
                        best_summary=PIPELINE, memory_bytes=2**30)
    assert w.startswith("the best strategy leaves its devices idle 70% of the step (70% "
                        "waiting, 0% in exposed communication)") and "microbatches" in w


def test_a_memory_bound_that_rejects_most_points_says_so():
    (w,) = warnings_for(gpus=8, batch=32, result=result(10, 7), best_spans=[],
                        best_summary=None, memory_bytes=80 * 2**30)
    assert w.startswith("the memory bound rejected 7 of the 10 points proposed (70%): few "
                        "strategies fit 80 GiB per device")


def test_search_prints_each_warning_once_and_lists_them_in_json(capsys, tmp_path):
    rc = main(["search", GPT, *TINY, "--gpus", "8", "--batch-size", "4", "--trials", "4",
               "--out", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert rc == 0
    said = [line.removeprefix("warning: ") for line in captured.err.splitlines()
            if line.startswith("warning: ")]
    assert said == out["warnings"] and said
    assert said[0].startswith("the global batch of 4 samples caps data parallelism at dp=4 "
                              "of the 8 devices")
    assert isinstance(out["best"]["unused"], list)
    s = out["best"]["summary"]
    assert ("no pipeline (pp=1: one stage, no pipeline schedule)" in out["best"]["unused"]) == \
        (s["pp"] == 1)
