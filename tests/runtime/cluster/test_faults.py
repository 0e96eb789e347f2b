"""Runtime faults end in a clear exit, never a hang: a worker killed mid-step (exit 3, naming
the rank and its task, within 60 s), a worker that stops answering (the process groups'
timeout, exit 3), Ctrl-C (every worker stopped, exit 130), and `piper-plan run` leaves no
process behind. Real processes, real signals; nothing here is mocked."""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import ray

from planner.cli import main
from runtime.cluster.progress import BOARD_PREFIX, Progress, read
from tests.conftest import GPT, ROOT, TINY, StderrLines

RUN = ["run", GPT, *TINY, "--gpus", "2", "--dp", "2", "--microbatches", "4", "--device", "cpu",
       "--steps", "1500", "--json"]  # more steps than the test waits for, bounded if it fails


def _reports() -> dict[int, Progress]:
    """The ranks' reports on the progress board of the job running in this process's Ray."""
    for name in ray.util.list_named_actors():
        if name.startswith(BOARD_PREFIX):
            try:
                return read(ray.get_actor(name), timeout_s=1.0)
            except ValueError:  # the job ended meanwhile
                pass
    return {}


class Saboteur(threading.Thread):
    """Waits until `rank` is inside step `at_step` (read from the job's progress board),
    then does `act(progress)` once and remembers when."""

    def __init__(self, rank: int, at_step: int, act, in_task: bool = False) -> None:
        super().__init__(daemon=True)
        self.rank, self.at_step, self.act = rank, at_step, act
        self.in_task = in_task  # wait until the rank is inside a task, not between tasks
        self.progress: Progress | None = None
        self.pids: list[int] = []
        self.at: float | None = None
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            reports = _reports()
            p = reports.get(self.rank)
            if (p and p.phase.startswith("step") and int(p.phase.split()[1]) >= self.at_step
                    and (p.tasks or not self.in_task)):
                self.pids = [q.pid for r in range(2) if (q := reports.get(r))]
                self.progress, self.at = p, time.perf_counter()
                self.act(p)
                return
            time.sleep(0.02)


def _gone(pid: int, within_s: float) -> bool:
    """The process has exited (a zombie awaiting its parent counts as exited)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _run_with(saboteur: Saboteur, capsys, argv: list[str]) -> tuple[int, str, float]:
    saboteur.start()
    t0 = time.perf_counter()
    try:
        rc = main(argv)
    finally:
        saboteur.stop = True
    assert saboteur.at is not None, "the run ended before the fault was injected"
    print(f"fault injected {saboteur.at - t0:.1f} s after the run started")
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1], time.perf_counter() - saboteur.at


def test_killed_worker_is_named_with_its_task_within_60s(ray_session, capsys):
    s = Saboteur(rank=1, at_step=1, act=lambda p: os.kill(p.pid, signal.SIGKILL),
                 in_task=True)
    rc, line, detect_s = _run_with(s, capsys, RUN)
    print(f"detected a killed worker in {detect_s:.2f} s")
    assert rc == 3
    assert re.match(rf"error: rank 1 \(pid {s.progress.pid}\) died during step \d+ while "
                    r"running task \S+: its worker process exited unexpectedly", line), line
    assert detect_s < 60
    assert all(_gone(pid, 30) for pid in s.pids), "the surviving rank was killed too"


def _with_rank_1_stopped(capsys, argv: list[str]) -> tuple[int, str, float, int]:
    """`_run_with` a Saboteur that stops rank 1 (SIGSTOP) inside step 1, killed after;
    (exit code, last line, seconds to detection, rank 1's pid)."""
    s = Saboteur(rank=1, at_step=1, act=lambda p: os.kill(p.pid, signal.SIGSTOP))
    try:
        rc, line, detect_s = _run_with(s, capsys, argv)
    finally:
        if s.progress:
            os.kill(s.progress.pid, signal.SIGKILL)
    return rc, line, detect_s, s.progress.pid


def test_hung_worker_hits_the_process_group_timeout(ray_session, capsys):
    """A stopped rank is reported, naming it, within the timeout plus the driver's slack.

    Where the stop lands decides who notices: inside a step before its collectives, the
    partner's all-reduce times out (--timeout reaches the process groups) and the message
    names the silent rank too; after them (in the update), the partner finishes the step and
    the driver's deadline for the step (timeout + 10 s) names the silent rank itself."""
    rc, line, detect_s, _ = _with_rank_1_stopped(capsys, [*RUN, "--timeout", "3"])
    print(f"detected a hung worker in {detect_s:.2f} s (timeout 3 s)")
    assert rc == 3
    by_partner = re.match(r"error: rank 0 failed during step \d+( while running task \S+)?: "
                          r"RuntimeError: .*[Tt]imed out", line)
    by_driver = re.match(r"error: rank 1 did not finish step \d+ within 13s: rank 1 during "
                         r"step \d+", line)
    assert by_partner or by_driver, line
    if by_partner:
        assert re.search(r"still running: rank 1 during step \d+", line), line
    assert detect_s < 3 + 10 + 2


def test_stopped_worker_is_named_within_the_hang_timeout(ray_session, capsys):
    """A rank that stops (SIGSTOP) sends no heartbeat: the driver names it after
    --hang-timeout, long before the process groups' 300 s timeout."""
    rc, line, detect_s, pid = _with_rank_1_stopped(capsys, [*RUN, "--hang-timeout", "6"])
    print(f"named a stopped worker in {detect_s:.2f} s (hang timeout 6 s)")
    assert rc == 3
    assert re.match(rf"error: rank 1 \(pid {pid}\) stopped responding during step "
                    r"\d+.*: no word from it in \d+ s \(hang timeout 6 s\); still running: "
                    r"rank 0 during step", line), line
    assert detect_s < 6 + 2 * 1 + 5


def test_a_step_that_stops_moving_is_named_within_the_hang_timeout(ray_session, capsys,
                                                                   tmp_path):
    """Every rank alive and reporting, none moving on (a loss that blocks, as a collective
    that never completes would): named after --hang-timeout, with where each rank is."""
    flag = tmp_path / "stall"
    argv = ["run", str(ROOT / "tests" / "models" / "stalls.py"), *TINY, "--model-arg",
            f"stall_file={flag}", *RUN[4:], "--hang-timeout", "4"]
    s = Saboteur(rank=0, at_step=2, act=lambda p: flag.touch())
    rc, line, detect_s = _run_with(s, capsys, argv)
    print(f"named a stalled step in {detect_s:.2f} s (hang timeout 4 s)")
    assert rc == 3
    assert re.match(r"error: no rank moved on in 4 s of step \d+ \(hang timeout\): rank 0 "
                    r"during step \d+ while running task \S+; rank 1 during step", line), line
    assert detect_s < 4 + 2 * 1 + 5


def test_ctrl_c_stops_after_the_step_and_every_worker(ray_session, capsys):
    """Ctrl-C: the step in flight finishes, the run says where it stopped (exit 130), every
    worker ends; the run's own handler is gone afterwards."""
    # interrupt_main does nothing unless a Python handler is in place
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    s = Saboteur(rank=0, at_step=1, act=lambda p: _thread.interrupt_main())
    rc, line, _ = _run_with(s, capsys, RUN)
    assert rc == 130 and re.match(r"stopped by SIGINT after step \d+; nothing saved", line), line
    assert len(s.pids) == 2
    assert all(_gone(pid, 30) for pid in s.pids)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _marked(marker: str) -> list[int]:
    """Processes whose environment carries `marker` (inherited from the CLI we started)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "environ").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return [pid for pid in out if not _gone(pid, 0.01)]


def test_interrupted_cli_run_leaves_no_process_behind():
    """`piper-plan run` starts its own Ray; after Ctrl-C (the step finished, then the run
    stops) no raylet, GCS or worker is left."""
    marker = f"PIPER_TEST_MARK={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    p = subprocess.Popen([sys.executable, "-m", "planner.cli", *RUN], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said = StderrLines(p)
    try:
        said.wait_for("step 2/", 120)
        assert p.poll() is None, str(said)
        assert len(_marked(marker)) > 3, "Ray's processes and the workers are up"
        p.send_signal(signal.SIGINT)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, str(said)
    assert said.all()[-1].startswith("stopped by SIGINT after step"), str(said)
    end = time.monotonic() + 20
    while _marked(marker) and time.monotonic() < end:
        time.sleep(0.2)
    assert _marked(marker) == []


def test_killed_worker_then_resume_loses_no_step(ray_session, capsys, tmp_path):
    """A rank killed mid-training ends the run (exit 3, naming it); the same command with
    --resume continues from the newest complete checkpoint: no step lost or repeated, the
    same losses as uninterrupted single-device training."""
    ckpt = tmp_path / "ckpt"
    argv = [*RUN, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    s = Saboteur(rank=1, at_step=5, act=lambda p: os.kill(p.pid, signal.SIGKILL),
                 in_task=True)
    rc, line, _ = _run_with(s, capsys, argv)
    assert rc == 3 and line.startswith("error: rank 1"), line
    done = max(int(d.name.split("-")[1]) for d in ckpt.glob("step-*"))
    assert done >= 4 and done % 2 == 0
    steps = argv.index("--steps") + 1
    argv[steps] = str(done + 2)
    rc = main([*argv, "--resume", "--check"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["check"]["passed"]
    assert [s["step"] for s in out["steps"]] == [done + 1, done + 2]


def test_elastic_run_goes_on_past_a_hang_from_its_checkpoint(ray_session, capsys, tmp_path):
    """--elastic: a rank stopped mid-run is named within --hang-timeout, the run re-plans
    for the devices it has and goes on from the newest checkpoint; every step's loss is
    single-device training's (--check), and the change is recorded."""
    logs = tmp_path / "logs"
    argv = [*RUN[:-3], "--steps", "30", "--json", "--elastic", "--hang-timeout", "6",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
            "--replan-budget", "5", "--log-dir", str(logs), "--check"]
    s = Saboteur(rank=1, at_step=3, act=lambda p: os.kill(p.pid, signal.SIGSTOP))
    s.start()
    try:
        rc = main(argv)
    finally:
        s.stop = True
        if s.progress:  # the run's teardown killed it already, unless it failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.progress.pid, signal.SIGKILL)
    cap = capsys.readouterr()
    assert s.at is not None, "the run ended before the fault was injected"
    assert rc == 0, cap.err
    out = json.loads(cap.out.strip().splitlines()[-1])
    assert out["check"]["passed"] and [x["step"] for x in out["steps"]] == list(range(1, 31))
    assert re.search(r"elastic: rank 1 \(pid \d+\) stopped responding", cap.err), cap.err
    (change,) = out["replans"]
    assert change["step"] % 2 == 0 and change["new_gpus"] == 2
    assert re.search(rf"elastic: a hang after step \d+: from the checkpoint of step "
                     rf"{change['step']}", cap.err), cap.err
    events = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if "loss" in e] == list(range(1, 31))
    assert [e["event"] for e in events if "event" in e] == ["replan"]
