"""`piper-plan profile` end to end: real Ray workers and gloo on 2 CPU ranks time the tiny
GPT's chunks and the collectives, and the TOML written is one `simulate --cluster` accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cost_models import load_cluster
from planner.cli import main
from tests.conftest import GPT, TINY


def test_profile_writes_a_cluster_that_simulate_accepts(ray_session, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "box.toml"
    rc = main(["profile", GPT, *TINY, "--gpus", "2", "--device", "cpu", "--out", str(out),
               "--json"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    report = json.loads(printed.out)
    assert report["cluster_file"] == str(out)
    assert set(report["fit_error_percent"]) >= {"matmul", "optimizer", "all_reduce",
                                                "all_gather", "reduce_scatter", "p2p",
                                                "chunks"}
    spec = load_cluster(str(out))
    assert spec.name == "box" and spec.gpus_per_node == 2
    assert "measured by `piper-plan profile`" in spec.source
    assert spec.flops > 1e8  # any CPU core does a few GFLOP/s in a 384^3 matmul
    assert spec.op_overhead_s > 0 and spec.backward_op_overhead_s > 0
    # a real run's time between tasks: more than nothing, less than a millisecond-scale
    # chunk of this tiny model would take many times over
    assert 0 < spec.task_overhead_s < 0.05
    # and how much slower compute runs in a real step than the probes time it alone
    assert 0.2 < spec.runtime_compute_factor < 20
    assert 0 < spec.cores_per_node <= 2
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        ab = getattr(spec, kind)
        assert ab is not None and ab.latency > 0 and ab.bandwidth > 0, kind
    rc = main(["simulate", GPT, *TINY, "--gpus", "2", "--dp", "2", "--cluster", str(out),
               "--json"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    step = json.loads(printed.out)["predicted"]["step_time_s"]
    # the fitted all-reduce alone is a floor: the model's gradients over 2 ranks
    assert step > spec.all_reduce.latency


@pytest.mark.parametrize(("args", "problem"), [
    (["--gpus", "2", "--out", "box.json"], ".toml"),
    (["--gpus", "1", "--out", "box.toml"], "--gpus >= 2"),
    (["--gpus", "2", "--out", "no/such/folder/box.toml"], "does not exist"),
    (["--gpus", "2"], "--out"),
])
def test_profile_bad_input_is_one_error_line_and_exit_2(
        args: list[str], problem: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    rc = main(["profile", GPT, *TINY, "--device", "cpu", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error:") and problem in err[0]
