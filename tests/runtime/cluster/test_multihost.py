"""A run and a search spanning two hosts of a Ray cluster (`tests.hosts`: network, mount
and PID namespaces on this machine, token authentication on), driven from this host through
Ray Client, as from a laptop: the model file exists only here, and the second host cannot see
this checkout either (it has Python, torch and Ray alone); both reach the hosts through Ray; pp2 x dp2 reproduces single-device losses with two ranks per host; a search runs trials
on both hosts, and its best candidate runs there for real (--measure); a bad token or
address is a one-line error (exit 2); a host's raylet killed mid-run is reported as a lost
node within 60 s (exit 3), and the run resumes on the host left."""

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


def test_lost_host_is_named_within_60s_and_the_run_resumes_on_the_other(hosts):
    """Last in this module: the second host is gone after it. The checkpoints are on storage
    both hosts mount; the resumed run trains on the host that is left, under another
    strategy, to the losses of uninterrupted single-device training."""
    ckpt = hosts.shared / "ckpt"
    common = [hosts.model, *TINY, "--device", "cpu", "--checkpoint-dir", str(ckpt),
              "--address", hosts.client]
    p = subprocess.Popen(
        [sys.executable, "-m", "planner.cli", "run", *common, "--gpus", "4", "--pp", "2",
         "--dp", "2", "--steps", "2000", "--gpus-per-node", "2", "--checkpoint-every", "2"],
        cwd=hosts.home, env=hosts.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    said = StderrLines(p)
    try:
        said.wait_for("step 5/", 240)
        assert p.poll() is None, str(said)
        assert hosts.kill_raylet(1), "no raylet found on the second host"
        killed = time.monotonic()
        p.wait(timeout=90)
        took = time.monotonic() - killed
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    print(f"a lost host reported in {took:.1f} s")
    assert p.returncode == 3, str(said)
    last = said.all()[-1]
    assert re.match(rf"error: node {re.escape(hosts.ips[1])} was lost \(ranks (0, 1|2, 3)\)",
                    last), last
    assert took < 60
    done = max(int(d.name.split("-")[1]) for d in ckpt.glob("step-*"))
    hosts.wait_alive(1)  # the cluster knows its node is gone: the resumed run is placed anew
    r = cli(hosts, "run", *common, "--gpus", "2", "--dp", "2", "--steps", str(done + 2),
            "--resume", "--check", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["check"]["passed"] and [s["step"] for s in out["steps"]] == [done + 1, done + 2]
    assert set(out["nodes"]) == {hosts.ips[0]}
