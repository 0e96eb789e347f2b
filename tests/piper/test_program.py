"""Program: JSON and Python round trips, loading strategy files, and the summary figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import piper
from piper import Order, Place, Program, Replicate, Split, schedules
from piper.dag import TrainingDAG
from piper.directives.base import from_dict
from piper.model_file import load_model_file

STAGES = {
    1: [["embed", "layer.0", "layer.1", "layer.2", "layer.3", "head"]],
    2: [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]],
    4: [["embed", "layer.0"], ["layer.1"], ["layer.2"], ["layer.3", "head"]],
}
EXAMPLE = Path("examples/strategies/gpt_tiny_1f1b.py")


@pytest.fixture(scope="module")
def dag0() -> TrainingDAG:
    cap = piper.capture(load_model_file("examples/gpt.py", (("size", "tiny"),)), 2)
    return piper.single_device_dag(cap.graph)


def run_python(source: str) -> Program:
    namespace: dict = {}
    exec(compile(source, "<strategy>", "exec"), namespace)  # noqa: S102 - our own output
    return namespace["strategy"]()


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("m", [1, 4])
def test_program_round_trips_through_json_and_python(dag0: TrainingDAG, name: str, pp: int,
                                                     dp: int, m: int) -> None:
    p = schedules.build(name, STAGES[pp], microbatches=m, dp=dp)
    from_json = Program.from_json(p.to_json())
    from_python = run_python(p.to_python())
    assert from_json == p
    assert from_python == p
    # one stage has no pipeline: 1F1B's order there is gradient accumulation's
    assert from_json.name == from_python.name == (
        schedules.NO_PIPELINE if pp == 1 and name == "1f1b" else name)
    n = p.apply(dag0).graph.number_of_nodes()
    assert from_json.apply(dag0).graph.number_of_nodes() == n
    assert from_python.apply(dag0).graph.number_of_nodes() == n


def test_directive_python_form_evaluates_to_an_equal_directive() -> None:
    env = {"Place": Place, "Split": Split, "Replicate": Replicate, "Order": Order}
    for d in [Place(("embed", "layer.*"), stage=1, device=2), Place("head", stage=0, device=0),
              Split(8), Replicate(4), Replicate(2, bucket_mb=25), Order(3, "F3.0 B3.0")]:
        assert eval(d.to_python(), env) == d
        assert from_dict(json.loads(json.dumps(d.to_dict()))) == d
    assert Replicate(4).to_python() == "Replicate(4)"  # default zero is left out
    assert Replicate(4, bucket_mb=0.5).to_python() == "Replicate(4, bucket_mb=0.5)"


def test_to_python_header_lines_become_comments() -> None:
    src = schedules.gpipe(STAGES[2], microbatches=2).to_python(header=["model: gpt", "x"])
    assert src.splitlines()[:2] == ["# model: gpt", "# x"]
    assert run_python(src).name == "gpipe"


def test_to_json_is_versioned_and_lists_directives_by_type() -> None:
    data = json.loads(schedules.one_f_one_b(STAGES[2], microbatches=4, dp=2).to_json())
    assert data["version"] == 1
    assert [d["type"] for d in data["directives"]] == ["Place", "Place", "Split", "Replicate",
                                                       "Order", "Order"]
    assert data["directives"][0] == {"type": "Place", "regions": STAGES[2][0], "stage": 0,
                                     "device": 0}


def test_program_rejects_something_that_is_not_a_directive() -> None:
    with pytest.raises(piper.PiperError, match="directive 1: .* is not a directive"):
        Program([Split(2), "Split(2)"])  # type: ignore[list-item]


# --- load ------------------------------------------------------------------------------

def test_load_reads_a_python_strategy_and_its_json_twin(tmp_path: Path) -> None:
    p = schedules.one_f_one_b(STAGES[4], microbatches=4, dp=2)
    py, js = tmp_path / "s.py", tmp_path / "s.json"
    py.write_text(p.to_python(header=["written by a test"]))
    js.write_text(p.to_json())
    assert Program.load(py) == p
    assert Program.load(str(js)) == p


def test_load_of_the_example_strategy_is_the_library_1f1b(dag0: TrainingDAG) -> None:
    p = Program.load(EXAMPLE)
    assert p == schedules.one_f_one_b(STAGES[2], microbatches=4)
    dag = p.apply(dag0)
    assert (dag.pp, dag.dp, dag.microbatches) == (2, 1, 4)


def test_load_of_python_without_strategy_raises(tmp_path: Path) -> None:
    f = tmp_path / "nostrategy.py"
    f.write_text("import piper\nSTRATEGY = None\n")
    with pytest.raises(piper.PiperError, match="must define strategy()"):
        Program.load(f)


@pytest.mark.parametrize("body, msg", [
    ("def strategy(:\n", "syntax error"),
    ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("def strategy():\n    return 42\n", "must return a piper.Program"),
    ("def strategy():\n    return {}['x']\n", "strategy\\(\\) failed: KeyError"),
])
def test_load_of_a_broken_python_strategy_raises_piper_error(tmp_path: Path, body: str,
                                                             msg: str) -> None:
    f = tmp_path / "broken.py"
    f.write_text(body)
    with pytest.raises(piper.PiperError, match=msg):
        Program.load(f)


def test_load_of_a_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(piper.PiperError, match="not found"):
        Program.load(tmp_path / "nope.py")


@pytest.mark.parametrize("text", [
    "this is not json",
    "[]",
    '{"name": "x"}',
    '{"directives": [{"type": "Shuffle"}]}',
    '{"directives": [{"type": "Split"}]}',
    '{"directives": [{"type": "Split", "microbatches": 2, "extra": 1}]}',
    '{"directives": 3}',
])
def test_load_of_garbage_json_raises_piper_error(tmp_path: Path, text: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(piper.PiperError, match="not a valid strategy JSON"):
        Program.load(f)


@pytest.mark.parametrize("text", ['{"directives": ["Split"]}', '{"directives": [null]}'])
def test_load_of_json_with_a_non_object_directive_raises_piper_error(tmp_path: Path,
                                                                    text: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(text)
    with pytest.raises(piper.PiperError):
        Program.load(f)


# --- summary ---------------------------------------------------------------------------

def test_summary_of_1f1b_gives_its_degrees_and_schedule() -> None:
    s = schedules.one_f_one_b(STAGES[2], microbatches=4, dp=2).summary()
    assert s == {"dp": 2, "pp": 2, "tp": 1, "sp": False, "ep": 1, "etp": 1, "ep_over_tp": False,
                 "capacity": 0.0,
                 "cp": 1, "zero": 0,
                 "schedule": "1f1b", "virtual_stages": 1, "microbatches": 4, "recompute": False,
                 "comm_stream": False, "bucket_mb": None}


def test_summary_of_gpipe_on_four_devices_without_replication() -> None:
    s = schedules.gpipe(STAGES[4], microbatches=8).summary()
    assert (s["dp"], s["pp"], s["microbatches"], s["schedule"]) == (1, 4, 8, "gpipe")


def test_summary_counts_virtual_stages_per_device() -> None:
    p = Program([Place(("embed", "layer.0"), stage=0, device=0),
                 Place(("layer.1",), stage=1, device=1),
                 Place(("layer.2",), stage=2, device=0),
                 Place(("layer.3", "head"), stage=3, device=1), Split(2)])
    s = p.summary()
    assert (s["pp"], s["virtual_stages"], s["microbatches"], s["schedule"]) == (2, 2, 2,
                                                                                 "custom")


def test_build_of_an_unknown_schedule_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: gpipe, 1f1b"):
        schedules.build("chimera", STAGES[2], microbatches=2)


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (4, 2), (4, 8)])
def test_1f1b_order_runs_every_task_once_and_keeps_at_most_pp_in_flight(pp: int, m: int
                                                                        ) -> None:
    for stage in range(pp):
        order = schedules.one_f_one_b_order(stage, pp, m)
        assert sorted(order) == sorted([f"F{stage}.{i}" for i in range(m)]
                                       + [f"B{stage}.{i}" for i in range(m)])
        in_flight, peak = 0, 0
        for t in order:
            in_flight += 1 if t[0] == "F" else -1
            peak = max(peak, in_flight)
            assert in_flight >= 0  # never a backward before its forward
        assert peak == min(pp - stage, m)
