"""Runs without Ray: ranks as processes spawned here (`--launcher local`) or by torchrun
(`--launcher torchrun`), driven through torch's TCPStore.

The driver makes the calls a Ray driver makes on its actors (`runtime.worker.Worker`: setup,
step, save, load, shutdown): each is a pickled message under a store key per rank and call,
answered under another, with the same deadlines as under Ray. A rank's exception comes back
as its message (with the task it was running); a spawned process that exits is named with
its exit code. Under torchrun the driver is rank 0, which runs rank 0's Worker in its own
process, while the other ranks `serve` until shutdown; a process lost under torchrun is
torchrun's to handle (it stops the others). The process groups rendezvous through the same
store (under a prefix), as torch's env:// does. Nothing here imports Ray.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from piper.model_file import ModelSpec
from runtime.jobs import (
    DEADLINE_SLACK_S,
    GRACE_S,
    SETUP_MIN_S,
    Driver,
    RuntimeFailure,
    ranks_text,
    reason,
)
from runtime.plan import Plan
from runtime.training import TrainConfig
from runtime.worker import Worker

POLL_S = 0.005  # the driver looks for answers this often
LISTEN_S = 1.0  # a serving rank looks up from waiting this often (is its driver alive?)
EXIT = "exit"  # a message that ends a serving rank without a shutdown (the run stopped)


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
    def here() -> Torchrun | None:
        """None outside torchrun (no RANK / WORLD_SIZE / MASTER_ADDR in the environment)."""
        env = os.environ
        if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            return None
        store, rank, world = next(dist.rendezvous("env://"))
        store.set_timeout(datetime.timedelta(days=1))  # a serving rank waits for its driver
        return Torchrun(store, rank, world, int(env.get("LOCAL_RANK", 0)),
                        int(env.get("LOCAL_WORLD_SIZE", world)), env["MASTER_ADDR"])

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


def serve(store: Any, rank: int, world: int, *, ip: str, gpu: int, threads: int,
          alive: Any = lambda: True) -> None:
    """One rank's loop: answer the driver's calls on this rank's Worker until shutdown
    (or an exit message, or the driver gone: its store unreachable, or `alive()` false)."""
    worker: Worker | None = None
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
                worker = Worker(rank, world, *args, threads=threads, ip=ip, gpu=gpu)
                worker.store = dist.PrefixStore("piper/pg", store)
                value: Any = worker.ip
            else:
                assert worker is not None, "init first"
                value = getattr(worker, method)(*args)
            reply = ("ok", value)
        except Exception as e:  # noqa: BLE001 - the driver names the rank and the task
            where = worker.progress.now().describe() if worker else "while starting"
            reply = ("error", f"{where}: {reason(e)}")
        store.set(_key("res", rank, seq), pickle.dumps(reply))
        seq += 1
        if method == "shutdown":
            return


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


def _spawned(rank: int, world: int, port: int, parent: int, threads: int) -> None:
    """A process `ProcessJob` spawned: join the driver's store, serve, end with its driver."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=SETUP_MIN_S))
    serve(store, rank, world, ip="127.0.0.1", gpu=rank, threads=threads,
          alive=lambda: os.getppid() == parent)


class ProcessJob(Driver):
    """`runtime.launcher.Job` without Ray: one process per rank spawned on this machine, or
    (`torchrun`) the processes torchrun started, this one being rank 0."""

    def __init__(self, spec: ModelSpec, plan: Plan, *, batch_size: int, seed: int,
                 device: str = "cpu", timeout_s: float = 300.0,
                 train: TrainConfig | None = None, done: int = 0,
                 torchrun: Torchrun | None = None) -> None:
        if not plan.complete:
            raise ValueError("a simulation view of a Plan (some replicas left out) cannot run")
        self.plan, self.done, self.torchrun = plan, done, torchrun
        self._start_steps()
        world = plan.world_size
        self.procs: list = []
        self.sent = 0  # calls posted (under torchrun: counted by `Torchrun.sent`)
        self.local: Worker | None = None
        self.finished = False
        self.deadline_s = max(timeout_s, SETUP_MIN_S) + DEADLINE_SLACK_S
        try:
            if torchrun is None:
                self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True,
                                           wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=timeout_s))
                threads = max(1, (os.cpu_count() or 1) // world)
                ctx = mp.get_context("spawn")
                self.procs = [ctx.Process(target=_spawned, daemon=True, name=f"piper-rank-{r}",
                                          args=(r, world, self.store.port, os.getpid(), threads))
                              for r in range(world)]
                for p in self.procs:
                    p.start()
                self.remote = list(range(world))
            else:
                if torchrun.world != world:
                    raise RuntimeFailure(f"torchrun started {torchrun.world} processes; the "
                                         f"strategy has {world} ranks")
                self.store = torchrun.store
                threads = max(1, (os.cpu_count() or 1) // torchrun.local_world)
                self.local = Worker(0, world, spec.source, device, threads,
                                    ip=torchrun.node_ip(), gpu=torchrun.local_rank)
                self.local.store = dist.PrefixStore("piper/pg", torchrun.store)
                self.remote = list(range(1, world))
            self.nodes = tuple(self._call("init", "starting the workers",
                                          (spec.source, device), skip_local=True))
            self.call_all("setup", "setup", plan, batch_size, seed, timeout_s, train, done)
        except BaseException:
            self.close()
            raise
        self.deadline_s = timeout_s + DEADLINE_SLACK_S

    def call_all(self, method: str, what: str, *args: Any) -> list:
        out = self._call(method, what, args)
        if method == "shutdown":
            self.finished = True
            if self.torchrun is not None:
                self.torchrun.released = True  # they have ended
        return out

    def _call(self, method: str, what: str, args: tuple, skip_local: bool = False) -> list:
        seq = self._next()
        message = pickle.dumps((method, args))
        for r in self.remote:
            self.store.set(_key("cmd", r, seq), message)
        out: dict[int, Any] = {}
        if self.local is not None:
            if skip_local:
                out[0] = self.local.ip
            else:
                try:
                    out[0] = getattr(self.local, method)(*args)
                except Exception as e:  # noqa: BLE001 - named like a serving rank's
                    raise RuntimeFailure(f"rank 0 failed {self.local.progress.now().describe()}"
                                         f": {reason(e)}") from None
        out.update(self._answers(seq, what))
        return [out[r] for r in range(self.plan.world_size)]

    def _next(self) -> int:
        if self.torchrun is not None:  # shared with `Torchrun.release`
            self.torchrun.sent += 1
            return self.torchrun.sent - 1
        self.sent += 1
        return self.sent - 1

    def _answers(self, seq: int, what: str) -> dict[int, Any]:
        """Every serving rank's answer to call `seq`, or `RuntimeFailure` at the first
        failure (after `GRACE_S` for the others to fail too: the root cause leads)."""
        pending, out, errors = list(self.remote), {}, {}
        end, grace = time.monotonic() + self.deadline_s, None
        while pending:
            for r in list(pending):
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
        if self.torchrun is not None:
            with contextlib.suppress(Exception):  # torchrun stops them when rank 0 exits
                self.torchrun.release()
        for p in self.procs:
            p.join(timeout=5.0 if self.finished else 0.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self.procs = []
        if self.local is not None:
            local, self.local = self.local, None
            if not self.finished:
                local.progress.close()
