"""Runs without Ray: `run --launcher local` (processes spawned here) and `--launcher
torchrun` (the real torchrun starting the processes) train like single-device PyTorch, resume
checkpoints written under Ray, report a rank that dies, and need neither Ray nor Optuna."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from planner.cli import main
from runtime.cluster.process_ranks import Ranks
from tests.conftest import GPT, ROOT, TINY, without_ray

TRAIN = ["--clip-grad", "0.05", "--lr-schedule", "cosine", "--warmup", "2"]
STRATEGIES = {
    "pp2": ["--gpus", "2", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b"],
    "dp2_zero3": ["--gpus", "2", "--dp", "2", "--zero", "3", "--microbatches", "2"],
    "tp2": ["--gpus", "2", "--tp", "2", "--microbatches", "2"],
}
def torchrun(argv: list[str], env: dict[str, str] | None = None,
             nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "planner.cli", *argv]
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def last_json(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert lines, "no output"
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", ["dp2_zero3", "tp2"])  # pp2: in the run without Ray below
def test_local_launcher_trains_like_one_device(capsys, case):
    rc = main(["run", GPT, *TINY, *STRATEGIES[case], *TRAIN, "--steps", "3",
               "--launcher", "local", "--check", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["check"]["passed"], out.get("check")
    assert [s["step"] for s in out["steps"]] == [1, 2, 3]


@pytest.mark.parametrize("case", ["pp2", "tp2"])
def test_torchrun_launcher_trains_like_one_device(case):
    # tp2 leaves --launcher out: a process torchrun started runs under it
    flag = ["--launcher", "torchrun"] if case == "pp2" else []
    proc = torchrun(["run", GPT, *TINY, *STRATEGIES[case], *TRAIN, "--steps", "3", *flag,
                     "--check", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = last_json(proc.stdout)
    assert out["check"]["passed"] and out["check"]["max_rel_diff"] <= 1e-4
    assert len(proc.stdout.strip().splitlines()) == 1, "rank 0 alone prints"
    assert proc.stderr.count("step 3/3") == 1, "rank 0 alone reports progress"


def test_a_checkpoint_saved_under_ray_resumes_under_torchrun(ray_session, capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = ["run", GPT, *TINY, *STRATEGIES["pp2"], *TRAIN, "--checkpoint-dir", str(ckpt)]
    assert main([*first, "--steps", "2", "--json"]) == 0
    capsys.readouterr()
    # resumed under another strategy and launcher: dp2 ZeRO-3 in torchrun's processes
    proc = torchrun(["run", GPT, *TINY, *STRATEGIES["dp2_zero3"], *TRAIN, "--steps", "4",
                     "--checkpoint-dir", str(ckpt), "--resume", "--launcher", "torchrun",
                     "--check", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = last_json(proc.stdout)
    assert [s["step"] for s in out["steps"]] == [3, 4], "no step lost or repeated"
    assert out["check"]["passed"] and out["check"]["max_rel_diff"] <= 1e-4
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-0000002", "step-0000004"]


def test_bad_input_under_torchrun_is_said_once_and_no_rank_hangs():
    proc = torchrun(["run", GPT, *TINY, "--gpus", "4", "--dp", "4", "--launcher", "torchrun"])
    assert proc.returncode != 0
    # said once, by rank 0 (torchrun then reports its child's exit code its own way)
    assert proc.stderr.count("error: --gpus 4, but torchrun started 2 processes") == 1


def test_a_rank_failing_mid_step_under_torchrun_is_named_by_rank_0():
    proc = torchrun(["run", str(ROOT / "tests" / "models" / "fails_on_rank.py"), *TINY,
                     *STRATEGIES["pp2"], "--steps", "2", "--launcher", "torchrun"],
                    env={**os.environ, "PIPER_TEST_FAIL_RANK": "1"})
    assert proc.returncode != 0
    assert ("error: rank 1 failed during step 1 while running task F1.0: RuntimeError: "
            "injected failure on rank 1") in proc.stderr, proc.stderr[-2000:]


def test_torchrun_launcher_outside_torchrun_says_how_to_start_it(capsys, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert main(["run", GPT, *TINY, "--gpus", "2", "--pp", "2", "--launcher", "torchrun"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --launcher torchrun: no torchrun")


def _children() -> dict[int, tuple[int, bytes]]:
    """pid: (parent pid, command line) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            out[int(entry.name)] = (ppid, (entry / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    return out


def _ranks() -> list[int]:
    """Pids of this process's ranks: the children of its fork server."""
    procs = _children()
    servers = {pid for pid, (ppid, cmd) in procs.items()
               if ppid == os.getpid() and b"forkserver" in cmd}
    return sorted(pid for pid, (ppid, _) in procs.items() if ppid in servers)


class _Probe:
    """A rank's host that says what its process had imported before the host was built."""

    def __init__(self) -> None:
        self.imported = "torch._dynamo" in sys.modules and "runtime.cluster.worker" in sys.modules

    def shutdown(self) -> bool:
        return self.imported


def _probe(rank: int, world: int, here: object, store: object) -> _Probe:
    return _Probe()


def test_local_ranks_start_with_the_runtime_imported_once_for_all():
    # torch, torch.export and the runtime take 2.3 s of CPU to import: a rank is a fork of a
    # server that imported them once (its parent), not a fresh interpreter importing them
    ranks = Ranks(2, 60.0)
    try:
        ranks.start(_probe)
        assert ranks.call_all("shutdown", "probing") == [True, True]
        assert all(p.pid in _ranks() or p.exitcode is not None for p in ranks.procs)
    finally:
        ranks.close()


def test_a_local_rank_killed_mid_run_is_named_and_nothing_is_left(capsys):
    killed: list[int] = []

    def sabotage() -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            ranks = _ranks()
            if len(ranks) == 2:
                time.sleep(8.0)  # set up, and some steps in
                os.kill(ranks[1], signal.SIGKILL)
                killed.append(ranks[1])
                return
            time.sleep(0.2)
        for pid in _ranks():  # never found: end the run anyway (the test then fails)
            os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=sabotage, daemon=True)
    t.start()
    start = time.monotonic()
    rc = main(["run", GPT, *TINY, *STRATEGIES["dp2_zero3"], "--steps", "100000",
               "--launcher", "local"])
    t.join(timeout=5)
    err = capsys.readouterr().err
    assert killed and rc == 3, err[-2000:]
    assert "rank 1 died" in err and "exited with code -9" in err
    assert time.monotonic() - start < 120
    assert not _ranks(), "every rank process was ended"


def test_simulate_profile_and_a_local_run_need_neither_ray_nor_optuna(tmp_path):
    env = without_ray(tmp_path)
    base = [sys.executable, "-m", "planner.cli"]
    sim = subprocess.run([*base, "simulate", GPT, *TINY, "--gpus", "2", "--pp", "2"],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert sim.returncode == 0 and "predicted:" in sim.stdout, sim.stderr[-2000:]
    run = subprocess.run([*base, "run", GPT, *TINY, *STRATEGIES["pp2"], "--steps", "2",
                          "--launcher", "local", "--check"],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0 and "check: passed" in run.stdout, run.stderr[-2000:]
    prof = subprocess.run([*base, "profile", GPT, *TINY, "--gpus", "2", "--device", "cpu",
                           "--launcher", "local", "--out", str(tmp_path / "here.toml")],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert prof.returncode == 0 and (tmp_path / "here.toml").exists(), prof.stderr[-2000:]
    search = subprocess.run([*base, "search", GPT, *TINY, "--gpus", "2"], check=False,
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert search.returncode == 2
    assert search.stderr.strip().splitlines()[-1].startswith("error: search needs optuna")
