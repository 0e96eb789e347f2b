"""A run and a search spanning two hosts of a Ray cluster (`tests.hosts`: network, mount
and PID namespaces on this machine, token authentication on), driven from this host through
Ray Client, as from a laptop: the model file exists only here, and the second host cannot see
this checkout either (it has Python, torch and Ray alone); both reach the hosts through Ray; pp2 x dp2 reproduces single-device losses with two ranks per host; a search runs trials
on both hosts, and its best candidate runs there for real (--measure); a bad token or
address is a one-line error (exit 2); under --elastic, a host's raylet killed mid-run is
named as a lost node within 60 s, the run goes on on the host left and takes the host back
when it returns."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import optuna
import pytest

from tests.conftest import ROOT, TINY, StderrLines
from tests.hosts import Hosts

WHY_NOT = Hosts.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no hosts: {WHY_NOT}")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    mine = tmp_path_factory.mktemp("driver")  # hidden from the hosts
    model = mine / "model" / "gpt.py"
    model.parent.mkdir()
    shutil.copy(ROOT / "examples" / "gpt.py", model)
    shared = tmp_path_factory.mktemp("shared")  # storage every host mounts (for checkpoints)
    # the second host cannot see this checkout either: piper-plan travels with the job
    with Hosts(2, hidden=[mine], logs=tmp_path_factory.mktemp("hosts"),
               hidden_on={1: [ROOT]}) as h:
        h.model = str(model)
        h.home = mine
        h.shared = shared
        yield h


def cli(hosts: Hosts, *argv: str, token: str | None = None, timeout: float = 300,
        env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner.cli", *argv], check=False,
                          cwd=hosts.home,
                          env=env or hosts.env(token), capture_output=True, text=True,
                          timeout=timeout)


def test_run_spans_both_hosts_and_matches_single_device(hosts):
    r = cli(hosts, "run", hosts.model, *TINY, "--gpus", "4", "--pp", "2", "--dp", "2",
            "--device", "cpu", "--steps", "3", "--gpus-per-node", "2", "--check", "--json",
            "--address", hosts.client)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["check"]["passed"], out["check"]
    a, b = out["nodes"][0], out["nodes"][2]
    assert out["nodes"] == [a, a, b, b]  # blocks of --gpus-per-node ranks share a node
    assert {a, b} == set(hosts.ips)
    assert f"ranks 0-1 on {a}, ranks 2-3 on {b}" in r.stderr


def test_search_runs_trials_on_both_hosts_and_measures_there(hosts):
    out = hosts.home / "search"
    env = {**hosts.env(), "RAY_ADDRESS": hosts.client}  # the address from the environment
    r = cli(hosts, "search", hosts.model, *TINY, "--gpus", "4", "--trials", "8",
            "--backend", "ray", "--out", str(out), "--measure", "1", "--device", "cpu",
            "--gpus-per-node", "2", env=env)
    assert r.returncode == 0, r.stderr
    assert re.search(r"measured 1/1: trial \d+: [\d.]+ ms", r.stderr), r.stderr
    study = optuna.load_study(study_name="piper-plan", storage=f"sqlite:///{out}/study.db")
    nodes = [t.user_attrs.get("node") for t in study.trials]
    assert len(nodes) == 8 and set(nodes) == set(hosts.ips), nodes


def test_refused_token_and_foreign_address_are_one_line_errors(hosts):
    r = cli(hosts, "run", hosts.model, *TINY, "--gpus", "2", "--device", "cpu",
            "--address", hosts.gcs, token="0" * 64, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"error: the Ray cluster at {hosts.gcs} refused this machine's token: set "
        "RAY_AUTH_TOKEN"), r.stderr
    # right token, but this machine is no node of the cluster: Ray Client is the way in
    r = cli(hosts, "run", hosts.model, *TINY, "--gpus", "2", "--device", "cpu",
            "--address", hosts.gcs, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"--address ray://{hosts.ips[0]}:10001" in r.stderr.strip().splitlines()[-1]
    r = cli(hosts, "run", hosts.model, *TINY, "--gpus", "2", "--device", "cpu",
            "--address", f"{hosts.driver_ip}:1", timeout=120)  # nothing listens there
    assert r.returncode == 2
    assert re.match(r"error: cannot reach the Ray cluster \(GCS\) at ", r.stderr.strip()
                    .splitlines()[-1]), r.stderr


def test_elastic_run_outlives_a_lost_host_and_takes_it_back(hosts):
    """Last in this module: it replaces the second host. With --elastic, that host's raylet
    killed mid-run is named within 60 s, the run re-plans for the host left and goes on
    from the newest checkpoint (on storage both hosts mount); when the host comes back, the
    next checkpoint plans upward onto both again. Every step's loss is uninterrupted
    single-device training's."""
    import signal

    from piper.model_file import load_model_file, parse_model_args
    from runtime.train.reference import max_rel_diff, reference_run

    ckpt = hosts.shared / "ckpt"
    p = subprocess.Popen(
        [sys.executable, "-m", "planner.cli", "run", hosts.model, *TINY, "--device", "cpu",
         "--checkpoint-dir", str(ckpt), "--address", hosts.client, "--gpus", "4", "--pp",
         "2", "--dp", "2", "--steps", "5000", "--gpus-per-node", "2", "--checkpoint-every",
         "2", "--elastic", "--replan-budget", "10", "--json"],
        cwd=hosts.home, env=hosts.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    said = StderrLines(p)
    lost = f"elastic: node {hosts.ips[1]} lost after step "
    try:
        assert said.wait_for("step 5/", 240), str(said)
        assert hosts.kill_raylet(1), "no raylet found on the second host"
        killed = time.monotonic()
        assert said.wait_for(f"elastic: node {hosts.ips[1]} was lost", 60), str(said)
        took = time.monotonic() - killed
        assert said.wait_for(lost, 240), str(said)
        hosts.restart(1)  # the host comes back: picked up at the next checkpoint
        assert said.wait_for("elastic: 2 devices joined after step ", 240), str(said)
        assert said.wait_for("ranks on 2 nodes", 120), str(said)
        n = len([line for line in said.lines if line.startswith("step ")])
        assert said.wait_for(f"step {n + 2}/", 120), str(said)  # trains on both again
        p.send_signal(signal.SIGTERM)  # stops after the step in flight, checkpointed
        out_text, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    print(f"a lost host named in {took:.1f} s")
    assert took < 60
    assert p.returncode == 143, str(said)
    out = json.loads(out_text.strip().splitlines()[-1])
    why = [c["why"] for c in out["replans"]]
    assert why == [f"node {hosts.ips[1]} lost", "2 devices joined"], why
    assert [c["new_gpus"] for c in out["replans"]] == [2, 4]
    steps = [s["step"] for s in out["steps"]]
    assert steps == list(range(1, len(steps) + 1))
    spec = load_model_file(hosts.model, parse_model_args(TINY[1::2]))
    ref = reference_run(spec, batch_size=spec.batch_size, steps=len(steps), seed=0)
    assert max_rel_diff([s["loss"] for s in out["steps"]], [r.loss for r in ref]) <= 1e-4
    assert set(out["nodes"]) == set(hosts.ips)
    # the requeued job finishes: from the SIGTERM's checkpoint, on both hosts, exit 0
    r = cli(hosts, "run", hosts.model, *TINY, "--device", "cpu", "--checkpoint-dir",
            str(ckpt), "--address", hosts.client, "--gpus", "4", "--gpus-per-node", "2",
            "--steps", str(len(steps) + 2), "--checkpoint-every", "2", "--elastic",
            "--resume", "auto", "--check", "--json")
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout.strip().splitlines()[-1])
    assert done["check"]["passed"] and [s["step"] for s in done["steps"]] == [
        len(steps) + 1, len(steps) + 2]
