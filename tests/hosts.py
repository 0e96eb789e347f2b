"""Several hosts on this one machine, for tests of a Ray cluster that spans hosts.

Each host is a Linux network namespace with its own address on a bridge in this (the
driver's) namespace, and its processes run in a private mount and PID namespace: the folders
`hidden` names (the test's own files: the model the driver ships) and Ray's state
(`/tmp/ray`, `~/.ray`) are empty tmpfs there, so nothing reaches a host except what Ray
ships. Each runs `ray start --block` with token authentication. Everything is removed on
exit, on failure too: killing a host's `unshare` kills its whole PID namespace.

Needs root (CI runs as root); `Hosts.available()` says why not where it cannot work.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

HEAD_PORT = 6390
CLIENT_PORT = 10001
START_S = 90.0  # a host's Ray gets this long to come up (a loaded 2-core machine)

_HOST_SCRIPT = """
set -e
mkdir -p /tmp/ray && mount -t tmpfs tmpfs /tmp/ray
mkdir -p "$HOME/.ray" && mount -t tmpfs tmpfs "$HOME/.ray"
for d in $PIPER_HIDE; do mount -t tmpfs tmpfs "$d"; done
exec ray start --block --disable-usage-stats "$@"
"""


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)


class Hosts:
    """`n` hosts: host 0 is the head (GCS on HEAD_PORT, Ray Client on CLIENT_PORT)."""

    def __init__(self, n: int, hidden: list[Path], logs: Path, cpus: int = 2,
                 hidden_on: dict[int, list[Path]] | None = None) -> None:
        """`hidden`: folders every host sees empty; `hidden_on`: more, per host."""
        self.n, self.hidden, self.logs, self.cpus = n, hidden, logs, cpus
        self.hidden_on = hidden_on or {}
        tag = f"{os.getpid() % 10000}{secrets.token_hex(2)}"
        self.bridge = f"pbr{tag}"
        self.names = [f"piper-{tag}-h{i}" for i in range(n)]
        self.veths = [f"pv{tag}{i}" for i in range(n)]
        net = _free_subnet()
        self.driver_ip = f"{net}.1"
        self.ips = [f"{net}.{i + 2}" for i in range(n)]
        self.token = secrets.token_hex(32)
        self.procs: list[subprocess.Popen] = []
        self.made: list[tuple[str, ...]] = []  # undo commands, last first

    @staticmethod
    def available() -> str | None:
        """None, or why hosts cannot be built here."""
        if os.geteuid() != 0:
            return "building hosts needs root (network and mount namespaces)"
        for tool in ("ip", "unshare", "ray"):
            if shutil.which(tool) is None:
                return f"building hosts needs `{tool}` on PATH"
        tag = f"{os.getpid() % 100000}"
        probes = [  # (what, make, undo): everything a host is made of, tried once
            ("a network namespace", ("ip", "netns", "add", f"piper-probe-{tag}"),
             ("ip", "netns", "del", f"piper-probe-{tag}")),
            ("a bridge", ("ip", "link", "add", f"pbp{tag}", "type", "bridge"),
             ("ip", "link", "del", f"pbp{tag}")),
            ("a veth pair", ("ip", "link", "add", f"pvp{tag}", "type", "veth", "peer", "name",
                             f"pvq{tag}"), ("ip", "link", "del", f"pvp{tag}")),
            ("mount and PID namespaces", ("unshare", "--mount", "--pid", "--fork",
                                          "--kill-child", "--mount-proc", "--propagation",
                                          "private", "sh", "-c",
                                          "mount -t tmpfs tmpfs /mnt"), None),
        ]
        for what, make, undo in probes:
            r = _sh(*make)
            if undo:
                _sh(*undo)
            if r.returncode != 0:
                return f"cannot create {what}: {r.stderr.strip()}"
        return None

    @property
    def client(self) -> str:
        return f"ray://{self.ips[0]}:{CLIENT_PORT}"

    @property
    def gcs(self) -> str:
        return f"{self.ips[0]}:{HEAD_PORT}"

    def env(self, token: str | None = None) -> dict[str, str]:
        """An environment for a driver here: the cluster's token (or `token`)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token or self.token}

    def __enter__(self) -> Self:
        try:
            self._network()
            self.logs.mkdir(parents=True, exist_ok=True)
            for i in range(self.n):
                self._start(i)
                if i == 0:
                    self._wait_port(self.ips[0], HEAD_PORT)
            self._wait_port(self.ips[0], CLIENT_PORT)
            self._wait_nodes()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:  # SIGKILL of unshare --kill-child ends its PID namespace
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        self.procs = []
        for cmd in reversed(self.made):
            _sh(*cmd)
        self.made = []

    def _network(self) -> None:
        self._do(("ip", "link", "add", self.bridge, "type", "bridge"),
                 ("ip", "link", "del", self.bridge))
        self._do(("ip", "addr", "add", f"{self.driver_ip}/24", "dev", self.bridge))
        self._do(("ip", "link", "set", self.bridge, "up"))
        for ns, veth, ip in zip(self.names, self.veths, self.ips):
            self._do(("ip", "netns", "add", ns), ("ip", "netns", "del", ns))
            self._do(("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                      "netns", ns), ("ip", "link", "del", veth))
            self._do(("ip", "link", "set", veth, "master", self.bridge))
            self._do(("ip", "link", "set", veth, "up"))
            self._do(("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0"))
            self._do(("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up"))
            self._do(("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"))

    def _do(self, cmd: tuple[str, ...], undo: tuple[str, ...] | None = None) -> None:
        r = _sh(*cmd)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
        if undo:
            self.made.append(undo)

    def _start(self, i: int) -> None:
        args = (["--head", "--port", str(HEAD_PORT), "--ray-client-server-port",
                 str(CLIENT_PORT), "--include-dashboard", "false"] if i == 0
                else ["--address", self.gcs])
        hide = [*self.hidden, *self.hidden_on.get(i, [])]
        env = {**self.env(), "PIPER_HIDE": " ".join(str(p) for p in hide)}
        log = open(self.logs / f"host{i}.log", "w")  # noqa: SIM115 - the host keeps it
        self.procs.append(subprocess.Popen(
            ["ip", "netns", "exec", self.names[i], "unshare", "--mount", "--pid", "--fork",
             "--kill-child", "--mount-proc", "--propagation", "private",
             "sh", "-c", _HOST_SCRIPT, "sh", *args, "--node-ip-address", self.ips[i],
             "--num-cpus", str(self.cpus)],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _wait_port(self, ip: str, port: int) -> None:
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a host's Ray exited: see {self.logs}")
            with contextlib.suppress(OSError), socket.create_connection((ip, port), 1.0):
                return
            time.sleep(0.5)
        raise RuntimeError(f"{ip}:{port} did not open within {START_S:.0f} s: see {self.logs}")

    def _wait_nodes(self) -> None:
        self.wait_alive(self.n)

    def wait_alive(self, n: int) -> None:
        """Until the head counts `n` live nodes: every host joined, or a lost one noticed
        (asked from a separate process: this one may be connected to another Ray)."""
        code = ("import sys; from ray._raylet import GcsClient; "
                f"n = GcsClient(address='{self.gcs}').get_all_node_info(timeout=5).values(); "
                "print(sum(1 for x in n if x.state == 0))")
        end = time.monotonic() + START_S
        while time.monotonic() < end:
            r = subprocess.run([sys.executable, "-c", code], check=False, env=self.env(),
                               capture_output=True, text=True, timeout=60)
            if r.returncode == 0 and r.stdout.strip() == str(n):
                return
            time.sleep(1.0)
        raise RuntimeError(f"the head did not count {n} live nodes within {START_S:.0f} s: "
                           f"see {self.logs}")

    def restart(self, i: int) -> None:
        """Host `i` anew: its PID namespace ended and Ray started again, joining the head
        (a replaced node coming back)."""
        old = self.procs[i]
        with contextlib.suppress(ProcessLookupError):
            old.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            old.wait(timeout=30)
        self._start(i)
        self.procs[i] = self.procs.pop()

    def kill_raylet(self, i: int) -> list[int]:
        """SIGKILL host `i`'s raylet, as when the host dies; the pids killed."""
        pids = _sh("ip", "netns", "pids", self.names[i]).stdout.split()
        out = []
        for pid in map(int, pids):
            with contextlib.suppress(OSError):
                if b"/raylet/raylet" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
                    out.append(pid)
        return out


def _free_subnet() -> str:
    """A 10.x.y.0/24 no interface of this machine uses."""
    used = _sh("ip", "-4", "-o", "addr").stdout
    for _ in range(100):
        net = f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(250) + 1}"
        if f" {net}." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet")
