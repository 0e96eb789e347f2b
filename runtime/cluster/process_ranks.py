"""Ranks as processes, reached through torch's TCPStore: spawned on this machine, or the
processes torchrun started. No Ray.

Each rank hosts one object (a `runtime.cluster.worker.Worker`, a profile's probe) built by a factory
the driver names, and answers the driver's calls on it: each call is a pickled message under
a store key per rank and call, answered under another (`serve`). The driver (`Ranks`) waits
for every answer with a deadline; a rank's exception comes back as its message (with the task
it was running, if its host reports progress), and a spawned process that exits is named with
its exit code. Under torchrun the driver is rank 0, which hosts rank 0's object in its own
process while the other ranks serve; a process lost under torchrun is torchrun's to handle
(it stops the others). The hosts' process groups rendezvous through the same store, as
torch's env:// does (`Here`, `store` given to each factory).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.cluster.jobs import GRACE_S, SETUP_MIN_S, RuntimeFailure, ranks_text, reason

POLL_S = 0.005  # driver and ranks look for messages this often
# what a rank needs before it can serve: imported once by the fork server, which every
# spawned rank is forked from, instead of once per rank (2.3 s of CPU each: torch, export)
PRELOAD = ("torch", "torch.export", "torch._dynamo", "torch.distributed.checkpoint",
           "runtime.cluster.worker", "runtime.cluster.forkserver_signals")
LISTEN_S = 1.0  # a serving rank asks this often whether its driver is alive
EXIT = "exit"  # a message that ends a serving rank without a shutdown (the run stopped)
SHUTDOWN = "shutdown"  # the last call a host answers


@dataclass(frozen=True)
class Here:
    """Where a rank runs: its node's address (what gloo binds), its CUDA device index, and
    the CPU threads it may use."""

    ip: str
    gpu: int
    threads: int


Factory = Callable[..., Any]
"""`factory(rank, world, here, store, *args)`: a rank's host (a module-level function, so
that it pickles by name)."""


@dataclass
class Torchrun:
    """This process's place in a torchrun launch (its environment) and the store that
    torchrun's rendezvous gives every rank (`torch.distributed.rendezvous("env://")`)."""

    store: Any
    rank: int
    world: int
    local_rank: int
    local_world: int
    master: str
    sent: int = field(default=0)  # calls the driver (rank 0) has posted so far
    released: bool = field(default=False)  # the others were shut down or let go

    @staticmethod
    def from_env() -> Torchrun | None:
        """None outside torchrun (no RANK / WORLD_SIZE / MASTER_ADDR in the environment)."""
        env = os.environ
        if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            return None
        store, rank, world = next(dist.rendezvous("env://"))
        store.set_timeout(datetime.timedelta(days=1))  # a serving rank waits for its driver
        return Torchrun(store, rank, world, int(env.get("LOCAL_RANK", 0)),
                        int(env.get("LOCAL_WORLD_SIZE", world)), env["MASTER_ADDR"])

    def place(self) -> Here:
        return Here(self.node_ip(), self.local_rank,
                    max(1, (os.cpu_count() or 1) // self.local_world))

    def node_ip(self) -> str:
        """The address this node reaches the master from (what gloo should bind)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((self.master, 9))  # UDP: nothing is sent
                return s.getsockname()[0]
            except OSError:
                return "127.0.0.1"

    def release(self) -> None:
        """Rank 0 stopped before its job shut the others down: let them go (exit 0)."""
        if self.released:
            return
        self.released = True
        message = pickle.dumps((EXIT, ()))
        for r in range(1, self.world):
            self.store.set(_key("cmd", r, self.sent), message)
        self.sent += 1


def _key(kind: str, rank: int, seq: int) -> str:
    return f"piper/{kind}/{rank}/{seq}"


def serve(store: Any, rank: int, world: int, here: Here,
          alive: Callable[[], bool] = lambda: True) -> None:
    """One rank's loop: build its host at "init", answer the driver's calls on it until
    shutdown (or an exit message, or the driver gone: store unreachable, `alive()` false)."""
    host: Any = None
    seq = 0
    while True:
        key = _key("cmd", rank, seq)
        if not _arrives(store, key, alive):
            return
        method, args = pickle.loads(store.get(key))
        store.delete_key(key)
        if method == EXIT:
            return
        try:
            if method == "init":
                factory, more = args
                host = factory(rank, world, here, store, *more)
                value: Any = here.ip
            else:
                value = getattr(host, method)(*args)
            reply = ("ok", value)
        except Exception as e:  # noqa: BLE001 - the driver names the rank and the task
            reply = ("error", f"{_where(host, method)}: {reason(e)}")
        store.set(_key("res", rank, seq), pickle.dumps(reply))
        seq += 1
        if method == SHUTDOWN:
            return


def _where(host: Any, method: str) -> str:
    progress = getattr(host, "progress", None)
    return progress.now().describe() if progress is not None else f"during {method}"


def _arrives(store: Any, key: str, alive: Any) -> bool:
    """Wait for `key` (polled: a timed-out `wait` logs a warning each time); False if the
    driver is gone."""
    look = time.monotonic() + LISTEN_S
    while True:
        try:
            if store.check([key]):
                return True
        except (RuntimeError, OSError):
            return False  # the store's host is gone
        if time.monotonic() >= look:
            if not alive():
                return False
            look = time.monotonic() + LISTEN_S
        time.sleep(POLL_S)


def prestart(preload: tuple[str, ...] = PRELOAD) -> Any:
    """Start the fork server the ranks of `Ranks` come from, importing `preload` (and
    nothing of the driver's `__main__`) while the driver goes on planning: a rank starts as
    a fork of a process that already imported torch, and ends without tearing it down.
    Idempotent; returns the multiprocessing context."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))  # no effect once the server runs
    forkserver.ensure_running()
    return ctx


def _spawned(rank: int, world: int, port: int, threads: int, env: dict[str, str]) -> None:
    """A process `Ranks` started: join the driver's store, serve, end with its driver (the
    fork server it came from ends with the driver, which makes this process an orphan).
    `env`: the driver's environment when it started the rank (the fork server has its own
    from when it started)."""
    parent = os.getppid()
    # Ctrl-C in a terminal reaches the whole process group, a scheduler's SIGTERM the whole
    # job: the driver alone decides (it finishes the step in flight, saves, then kills the
    # ranks; an orphaned rank ends by itself)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=SETUP_MIN_S))
    serve(store, rank, world, Here("127.0.0.1", rank, threads),
          alive=lambda: os.getppid() == parent)


class _Call(threading.Thread):
    """Rank 0's part of a call under torchrun, on a thread of its own (a daemon: a rank 0
    stopped by another rank's failure must not keep the process alive)."""

    def __init__(self, host: Any, method: str, args: tuple) -> None:
        super().__init__(daemon=True, name=f"piper-rank-0-{method}")
        self.host, self.method, self.args = host, method, args
        self.value: Any = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.value = getattr(self.host, self.method)(*self.args)
        except Exception as e:  # noqa: BLE001 - named like a serving rank's
            self.error = f"{_where(self.host, self.method)}: {reason(e)}"


class Ranks:
    """The driver's side: `world` ranks spawned here, or (`torchrun`) torchrun's processes
    with rank 0 hosted in this one. `start` builds every host, `call_all` calls a method on
    all of them and returns their results in rank order, or raises `RuntimeFailure`."""

    def __init__(self, world: int, timeout_s: float, torchrun: Torchrun | None = None) -> None:
        self.world, self.torchrun = world, torchrun
        self.procs: list = []
        self.sent = 0  # calls posted (under torchrun: counted by `Torchrun.sent`)
        self.local: Any = None
        self.finished = False
        self.deadline_s = timeout_s
        if torchrun is None:
            self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True,
                                       wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=timeout_s))
            threads = max(1, (os.cpu_count() or 1) // world)
            ctx = prestart()
            self.procs = [ctx.Process(target=_spawned, daemon=True, name=f"piper-rank-{r}",
                                      args=(r, world, self.store.port, threads,
                                            dict(os.environ)))
                          for r in range(world)]
            for p in self.procs:
                p.start()
            self.remote = list(range(world))
        else:
            if torchrun.world != world:
                raise RuntimeFailure(f"torchrun started {torchrun.world} processes; this "
                                     f"run has {world} ranks")
            self.store = torchrun.store
            self.remote = list(range(1, world))

    def start(self, factory: Factory, *args: Any) -> tuple[str, ...]:
        """Build every rank's host; returns each rank's node address."""
        seq = self._post("init", (factory, args))
        out: dict[int, Any] = {}
        if self.torchrun is not None:
            here = self.torchrun.place()
            try:
                self.local = factory(0, self.world, here, self.store, *args)
            except Exception as e:  # noqa: BLE001 - named like a serving rank's
                raise RuntimeFailure(f"rank 0 failed while starting: {reason(e)}") from None
            out[0] = here.ip
        out.update(self._answers(seq, "starting the workers"))
        return tuple(out[r] for r in range(self.world))

    def call_all(self, method: str, what: str, *args: Any) -> list:
        seq = self._post(method, args)
        local = None
        if self.local is not None:  # rank 0's part runs beside the wait for the others, so
            local = _Call(self.local, method, args)  # a rank failing while rank 0 waits in
            local.start()  # a collective for it is reported at once, not at a timeout
        out = self._answers(seq, what, local)
        if method == SHUTDOWN:
            self.finished = True
            if self.torchrun is not None:
                self.torchrun.released = True  # they have ended
        return [out[r] for r in range(self.world)]

    def _post(self, method: str, args: tuple) -> int:
        if self.torchrun is not None:  # shared with `Torchrun.release`
            seq = self.torchrun.sent
            self.torchrun.sent += 1
        else:
            seq = self.sent
            self.sent += 1
        message = pickle.dumps((method, args))
        for r in self.remote:
            self.store.set(_key("cmd", r, seq), message)
        return seq

    def _answers(self, seq: int, what: str, local: _Call | None = None) -> dict[int, Any]:
        """Every rank's answer to call `seq` (rank 0's from `local`, if it runs here), or
        `RuntimeFailure` at the first failure (after `GRACE_S` for the others to fail too:
        the root cause leads)."""
        pending, out, errors = list(self.remote), {}, {}
        if local is not None:
            pending.insert(0, 0)
        end, grace = time.monotonic() + self.deadline_s, None
        while pending:
            if local is not None and 0 in pending and not local.is_alive():
                pending.remove(0)
                if local.error is None:
                    out[0] = local.value
                else:
                    errors[0] = local.error
            for r in [r for r in pending if r != 0 or local is None]:
                key = _key("res", r, seq)
                if self.store.check([key]):
                    status, value = pickle.loads(self.store.get(key))
                    self.store.delete_key(key)
                    pending.remove(r)
                    if status == "ok":
                        out[r] = value
                    else:
                        errors[r] = value
            died = self._died(pending, seq)
            now = time.monotonic()
            if (errors or died) and grace is None:
                grace = now + GRACE_S
            if grace is not None and (now >= grace or not pending):
                raise RuntimeFailure(self._failure(errors, self._died(pending, seq), pending,
                                                  what))
            if now >= end:
                raise RuntimeFailure(f"{ranks_text(pending)} did not finish {what} within "
                                     f"{self.deadline_s:.0f}s")
            time.sleep(POLL_S)
        return out

    def _died(self, ranks: list[int], seq: int) -> dict[int, int]:
        """Serving ranks whose spawned process ended without answering call `seq`, with
        its exit code (one that answered shutdown ends at once, and is not dead)."""
        if not self.procs:
            return {}
        return {r: self.procs[r].exitcode for r in ranks if self.procs[r].exitcode is not None
                and not self.store.check([_key("res", r, seq)])}

    def _failure(self, errors: dict[int, str], died: dict[int, int], pending: list[int],
                 what: str) -> str:
        parts = [f"rank {r} died during {what}: its worker process exited with code {c}"
                 for r, c in died.items()]
        parts += [f"rank {r} failed {msg}" for r, msg in errors.items()]
        still = [r for r in pending if r not in died]
        msg = "; then ".join(parts)
        return msg + (f"; still running: {ranks_text(still)}" if still else "")

    def close(self) -> None:
        """Let torchrun's ranks go, or end the spawned processes (killed unless they shut
        down), and close rank 0's host if it never did."""
        if self.torchrun is not None:
            with contextlib.suppress(Exception):  # torchrun stops them when rank 0 exits
                self.torchrun.release()
        for p in self.procs:
            p.join(timeout=5.0 if self.finished else 0.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self.procs = []
        local, self.local = self.local, None
        if local is not None and not self.finished and hasattr(local, "progress"):
            local.progress.close()
