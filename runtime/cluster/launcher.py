"""Driver side of a real run: start one Ray actor per rank for a lowered Plan
(`runtime.lowering.lower`), run the steps and gather losses, times and memory.

Ranks run wherever Ray puts their blocks (`runtime.cluster.placement`), on this machine or on the
nodes of a cluster (`runtime.cluster.join`); rank 0 opens the rendezvous on its own node, and
each rank reports what it is doing through the job's progress board (`runtime.cluster.progress`),
so a rank or node lost is named with its task."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from piper.errors import PiperError
from piper.model_file import ModelSpec
from runtime.cluster import progress
from runtime.cluster.jobs import (
    DEADLINE_SLACK_S,
    GRACE_S,
    SETUP_MIN_S,
    Driver,
    RunResult,
    RuntimeFailure,
    StepResult,
    check_machine,
    describe_nodes,
    ranks_text,
    reason,
)
from runtime.cluster.join import cluster_address, connect, disconnect, remote_source
from runtime.cluster.placement import Placement, default_per_node, place, rank_resources
from runtime.cluster.progress import Progress
from runtime.cluster.worker import Worker
from runtime.lowering.plan import Plan
from runtime.train.data import parse_blend
from runtime.train.training import TrainConfig

__all__ = ["Job", "RunResult", "RuntimeFailure", "StepResult", "check_workers",
           "describe_nodes", "run"]

POLL_S = 1.0  # the driver looks up from waiting this often (Ctrl-C, deadlines, hangs)
HANG_MIN_S = 60.0  # a live rank reports every second: a minute of silence is a hang
HANG_STEPS = 20  # ... as is a step in which nothing moves for 20 median steps


class _RayWorker(Worker):
    """A Worker in a Ray actor: its node's address as Ray knows it."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, ip=ray.util.get_node_ip_address(), **kw)  # type: ignore[arg-type]


RemoteWorker = ray.remote(_RayWorker)


def check_workers(world: int, device: str, address: str | None) -> None:
    """Refuse a run this machine cannot host, before anything is built or started: Ray would
    otherwise leave the extra workers pending (a hang) or start them until memory runs out."""
    if cluster_address(address):
        return  # a cluster's capacity is checked once joined (`_check_cluster`)
    check_machine(world, device, "--address joins a Ray cluster with more")


def _check_cluster(world: int, device: str) -> None:
    if device == "cuda":
        have = int(ray.cluster_resources().get("GPU", 0))
        if world > have:
            raise PiperError(f"--gpus {world} needs {world} GPUs; the Ray cluster has {have}")


def run(spec: ModelSpec, plan: Plan, *, batch_size: int, steps: int, seed: int,
        device: str = "cpu", address: str | None = None, timeout_s: float = 300.0,
        train: TrainConfig | None = None, per_node: int | None = None) -> RunResult:
    """Train `steps` steps of `plan` on real worker processes (a `Job` from start to end).

    `timeout_s` bounds every collective and P2P transfer (the process groups' timeout); the
    driver waits a little longer for each phase, so a hang is reported by the rank that
    waited. A rank that dies or fails stops the run at once: every worker is killed and a
    `RuntimeFailure` names the rank and the task it was running. So does Ctrl-C
    (KeyboardInterrupt, re-raised). A Ray instance this call started is shut down.
    """
    with Job(spec, plan, batch_size=batch_size, seed=seed, device=device, address=address,
             timeout_s=timeout_s, train=train, per_node=per_node) as job:
        for _ in range(steps):
            job.step()
        return job.finish()


class Job(Driver):
    """One rank per Ray actor, set up and holding the plan's state between steps, so a
    caller steps when it likes (`run` steps straight through; a benchmark interleaves the
    steps of two systems). Closing kills the workers and frees their placement, and shuts
    down a Ray instance that this job started."""

    def __init__(self, spec: ModelSpec, plan: Plan, *, batch_size: int, seed: int,
                 device: str = "cpu", address: str | None = None, timeout_s: float = 300.0,
                 train: TrainConfig | None = None, done: int = 0, per_node: int | None = None,
                 shared: tuple[str, ...] = (), hang_timeout_s: float | None = None) -> None:
        """`done`: steps trained before (the ranks' state is then loaded by `restore`).
        `per_node`: ranks per node (default: `placement.default_per_node`). `shared`:
        folders every node must see as this machine does (a checkpoint folder), checked
        before setup. `hang_timeout_s`: a rank silent this long, or a step in which no rank
        moves on for this long, is a hang (default `hang_after`)."""
        self.hang_timeout_s = hang_timeout_s
        if not plan.complete:
            raise ValueError("a simulation view of a Plan (some replicas left out) cannot run")
        self.plan = plan
        self.done = done
        self.started = False
        world = plan.world_size
        self.actors: list = []
        self._start_steps()
        self.nodes: tuple[str, ...] = ()
        self.placement: Placement | None = None
        self.board = None
        try:  # from here on, close() undoes whatever was done (placement, Ray, actors)
            joined = cluster_address(address) is not None
            self.started = connect(address, ship=[spec.source[0]])
            _check_cluster(world, device)
            resources = rank_resources(device, joined, world)
            self.placement = place(world, per_node or default_per_node(world, resources,
                                                                       joined), resources)
            self.board = progress.board(f"{progress.BOARD_PREFIX}{uuid.uuid4().hex[:12]}")
            threads = max(1, (os.cpu_count() or 1) // world)
            source = remote_source(spec.source)
            self.actors = [RemoteWorker.options(
                num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                **self.placement.options(r)).remote(r, world, source, device, threads,
                                                    self.board)
                for r in range(world)]
            # starting processes and capturing the model take a while: more time
            setup = _Waiter(max(timeout_s, SETUP_MIN_S) + DEADLINE_SLACK_S, self,
                            hang=False)
            self.nodes = tuple(setup([a.node.remote() for a in self.actors],
                                     "starting the workers"))
            self._check_paths(setup, spec, train, shared)
            master = setup([self.actors[0].listen.remote(timeout_s)], "opening the "
                           "rendezvous")[0]
            setup([a.setup.remote(plan, batch_size, seed, timeout_s, train, done, master)
                   for a in self.actors], "setup")
        except BaseException:
            self.close()
            raise
        self.wait = _Waiter(timeout_s + DEADLINE_SLACK_S, self)

    def _check_paths(self, wait: _Waiter, spec: ModelSpec, train: TrainConfig | None,
                     shared: tuple[str, ...]) -> None:
        """What the ranks read or write by path is there on every node: the model (unless
        shipped), `--data`, and each shared folder (a marker written here must be seen
        there, so a folder that merely exists on each node does not pass)."""
        needs = {"the model": remote_source(spec.source)[0]}  # a folder: with its weights
        for flag, data in (("--data", train and train.data),
                           ("--eval-data", train and train.eval_data)):
            files = parse_blend(data or None, flag)
            for k, (_, path) in enumerate(files):
                what = flag if len(files) == 1 else f"{flag}'s file {k + 1} of {len(files)}"
                needs[what] = os.path.abspath(path)
        markers = []
        for folder in shared:
            os.makedirs(folder, exist_ok=True)
            marker = os.path.join(os.path.abspath(folder), f".piper-check-{uuid.uuid4().hex}")
            open(marker, "w").close()
            markers.append(marker)
            needs[f"the folder {folder} (a file this machine wrote there)"] = marker
        first = {}
        for r, n in enumerate(self.nodes):
            first.setdefault(n, r)
        try:
            missing = wait([self.actors[r].missing.remote(list(needs.values()))
                            for r in first.values()], "checking paths")
        finally:
            for m in markers:
                os.remove(m)
        for node, gone in zip(first, missing):
            for what, path in needs.items():
                if path in gone:
                    ranks = [r for r, n in enumerate(self.nodes) if n == node]
                    raise PiperError(f"{what} ({path}) is not on node {node} ({ranks_text(ranks)}"
                                     "): put it on storage every node mounts at the same "
                                     "path")

    def call_all(self, method: str, what: str, *args: object) -> list:
        return self.wait([getattr(a, method).remote(*args) for a in self.actors], what)

    def hang_after(self) -> float:
        """Seconds of silence, or of no progress in a step, that make a hang: the caller's
        `hang_timeout_s`, else `HANG_STEPS` times the median step so far (at least
        `HANG_MIN_S`; before any step, that floor)."""
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        times = sorted(r.time_s for r in self.results)
        return max(HANG_MIN_S, HANG_STEPS * times[len(times) // 2]) if times else HANG_MIN_S

    def reports(self) -> dict[int, Progress]:
        """What each rank last said it was doing (empty if the board cannot be read)."""
        return progress.read(self.board) if self.board is not None else {}

    def close(self) -> None:
        for a in self.actors:  # on success too: the processes end now, not when Ray gets
            ray.kill(a, no_restart=True)  # to it
        self.actors = []
        if self.board is not None:
            ray.kill(self.board, no_restart=True)
            self.board = None
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        if self.started:
            self.started = False
            disconnect()


class _Waiter:
    """Waits for one phase (setup, a step) on every rank and stops at the first failure: a
    rank that raised, a rank whose process or node died, or a phase past its deadline. Each
    message names the rank (and a lost node) and, from the job's progress board, the task
    it was running."""

    def __init__(self, deadline_s: float, job: Job, hang: bool = True) -> None:
        """`hang`: also watch the board for a silent rank, or a phase in which no rank
        moves on, for `job.hang_after()` (setup runs without the second: its one long
        capture is no hang)."""
        self.deadline_s = deadline_s
        self.job = job
        self.hang = hang

    def __call__(self, refs: list, what: str) -> list:
        rank_of = {ref: r for r, ref in enumerate(refs)}
        out: dict[int, Any] = {}
        pending = list(refs)
        end = time.monotonic() + self.deadline_s
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                ranks = sorted(rank_of[ref] for ref in pending)
                raise RuntimeFailure(f"{ranks_text(ranks)} did not finish {what} within "
                                     f"{self.deadline_s:.0f}s: "
                                     + self._where_all(ranks, what, self.job.reports()))
            # short waits, so Ctrl-C is seen promptly while nothing happens
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, POLL_S))
            for ref in ready:
                try:
                    out[rank_of[ref]] = ray.get(ref)
                except RayError as e:
                    raise RuntimeFailure(*self._failed(rank_of[ref], e, pending, rank_of,
                                                       what)) from None
            if not ready and pending:
                self._check_hang(sorted(rank_of[ref] for ref in pending), what)
        return [out[r] for r in range(len(refs))]

    def _check_hang(self, pending: list[int], what: str) -> None:
        """`RuntimeFailure` if a pending rank has been silent for `job.hang_after()` (a
        stopped process; all of a node's ranks: the node), or if, in a step, none of them
        has moved on for that long (a collective that never completes)."""
        after = self.job.hang_after()
        reports = self.job.reports()
        silent = [r for r in pending if r in reports and reports[r].age_s > after]
        if silent:
            lost = self._lost_nodes({}, reports)
            if lost:
                raise RuntimeFailure("; ".join(self._describe_lost(node, ranks, reports, what)
                                               for node, ranks in lost.items()), tuple(lost))
            r = silent[0]
            others = [o for o in pending if o != r]
            raise RuntimeFailure(
                f"rank {r} (pid {reports[r].pid}) stopped responding "
                f"{reports[r].describe()}: no word from it in {reports[r].age_s:.0f} s "
                f"(hang timeout {after:.0f} s)"
                + (f"; still running: {self._where_all(others, what, reports)}" if others
                   else ""), hung=True)
        # a step's tasks: known to be shorter than a step once one was timed (or said)
        timed = self.job.hang_timeout_s is not None or bool(self.job.results)
        stuck = [r for r in pending if r in reports and reports[r].still_s > after]
        if (self.hang and timed and what.startswith("step") and stuck
                and len(stuck) == len(pending)):
            raise RuntimeFailure(f"no rank moved on in {after:.0f} s of {what} (hang "
                                 f"timeout): {self._where_all(stuck, what, reports)}",
                                 hung=True)

    def _failed(self, rank: int, err: RayError, pending: list, rank_of: dict, what: str
                ) -> tuple[str, tuple[str, ...]]:
        """The failure's message, and the nodes it lost (empty: ranks alone failed)."""
        errors = {rank: err}

        def collect(pending: list, timeout: float) -> list:
            """Wait up to `timeout` for the others; keep the errors of those that fail."""
            if not pending:
                return pending
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=timeout)
            for ref in more:
                try:
                    ray.get(ref)
                except RayError as e:
                    errors[rank_of[ref]] = e
            return pending

        # a dead rank's peers fail a moment later (their sockets close): wait a little, so
        # the message leads with the root cause, not with its echo
        pending = collect(pending, GRACE_S)
        reports = self.job.reports()
        lost = self._lost_nodes(errors, reports)
        end = time.monotonic() + progress.SILENT_S + 2 * progress.HEARTBEAT_S

        def died() -> list[int]:  # ranks whose worker process is gone
            return [r for r, e in errors.items() if isinstance(e, RayActorError)]

        # a node's loss shows as its ranks dying or falling silent, seconds after their
        # peers elsewhere fail: look again before blaming the first rank that failed (also
        # when every rank has answered already: a rank whose process is gone may be a lost
        # node's that Ray's health checks have not yet named)
        while (not lost and (pending or died()) and len(set(self.job.nodes)) > 1
               and time.monotonic() < end):
            if pending:
                pending = collect(pending, POLL_S / 2)
            else:
                time.sleep(POLL_S / 2)
            reports = self.job.reports()
            lost = self._lost_nodes(errors, reports)
        first = next(iter(died()), rank)
        if lost:
            msg = "; ".join(self._describe_lost(node, ranks, reports, what)
                            for node, ranks in lost.items())
            gone = {r for ranks in lost.values() for r in ranks}
        else:
            msg = self._describe(first, errors[first], what, reports)
            gone = {first}
        then = [r for r in errors if r not in gone]
        if then:
            msg += "; then " + "; ".join(f"rank {r} failed ({_reason(errors[r])})" for r in then)
        still = sorted(rank_of[ref] for ref in pending if rank_of[ref] not in gone)
        if still:
            msg += "; still running: " + self._where_all(still, what, reports)
        return msg, tuple(lost)

    def _lost_nodes(self, errors: dict[int, RayError], reports: dict[int, Progress]
                    ) -> dict[str, list[int]]:
        """Nodes of this job that Ray reports dead, or whose every rank went silent or
        died (Ray learns of a lost node only after its health checks fail)."""
        nodes = self.job.nodes
        if len(set(nodes)) < 2:
            return {}  # all on one node: a rank's death says it all
        dead = {n.get("NodeManagerAddress") for n in ray.nodes() if not n.get("Alive")}
        out = {}
        for node in dict.fromkeys(nodes):
            ranks = [r for r, n in enumerate(nodes) if n == node]
            if node in dead or all(isinstance(errors.get(r), RayActorError)
                                   or (r in reports and reports[r].silent) for r in ranks):
                out[node] = ranks
        return out

    def _describe_lost(self, node: str, ranks: list[int], reports: dict[int, Progress],
                       what: str) -> str:
        where = self._where_all(ranks, what, reports)
        return f"node {node} was lost ({ranks_text(ranks)}): {where}"

    def _describe(self, rank: int, err: RayError, what: str,
                  reports: dict[int, Progress]) -> str:
        p = reports.get(rank)
        where = p.describe() if p else f"during {what}"
        if isinstance(err, RayActorError):
            pid = f" (pid {p.pid})" if p else ""
            return f"rank {rank}{pid} died {where}: its worker process exited unexpectedly"
        return f"rank {rank} failed {where}: {_reason(err)}"

    def _where_all(self, ranks: list[int], what: str, reports: dict[int, Progress]) -> str:
        out = []
        for r in ranks:
            p = reports.get(r)
            out.append(f"rank {r} {p.describe() if p else f'during {what}'}")
        return "; ".join(out)


def _reason(err: RayError) -> str:
    if isinstance(err, RayActorError):
        return "died"
    return reason(getattr(err, "cause", None) or err)
