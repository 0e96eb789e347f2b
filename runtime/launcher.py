"""Driver side of a real run: start one Ray actor per rank for a lowered Plan
(`runtime.lowering`), run the steps and gather losses, times and memory.

Ranks run wherever Ray puts their blocks (`runtime.placement`), on this machine or on the
nodes of a cluster (`runtime.cluster`); rank 0 opens the rendezvous on its own node, and
each rank reports what it is doing through the job's progress board (`runtime.progress`),
so a rank or node lost is named with its task."""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Self

import ray
from ray.exceptions import RayActorError, RayError

from piper.errors import PiperError
from piper.model_file import ModelSpec
from runtime import progress
from runtime.cluster import cluster_address, connect, disconnect, remote_source
from runtime.dryrun import Span
from runtime.placement import Placement, default_per_node, place, rank_resources
from runtime.plan import Plan
from runtime.progress import Progress
from runtime.training import TrainConfig
from runtime.worker import RemoteWorker

POLL_S = 1.0  # the driver looks up from waiting this often (Ctrl-C, deadlines)
GRACE_S = 3.0  # after a first failure, how long the others get to fail too (root cause first)
DEADLINE_SLACK_S = 10.0  # the driver outwaits the process groups' timeout by this much
SETUP_MIN_S = 300.0  # starting worker processes and capturing a big model takes a while
CPU_WORKER_BYTES = 512 * 2**20  # a CPU worker process: torch, Ray, a small model


class RuntimeFailure(Exception):
    """A worker died or timed out (exit code 3); the message names the rank."""


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    time_s: float  # the slowest rank's
    grad_norm: float = float("nan")  # of the whole model's gradient, before clipping
    lr: float = float("nan")
    peak_memory_bytes: tuple[int, ...] = ()  # per rank, so far


@dataclass(frozen=True)
class RunResult:
    steps: tuple[StepResult, ...]
    peak_memory_bytes: tuple[int, ...]
    plan: Plan
    spans: tuple[Span, ...] = ()  # the last step's measured timeline
    model_state_bytes: tuple[int, ...] = ()  # per rank: peak params + grads + optimizer state
    nodes: tuple[str, ...] = ()  # per rank: the IP address of the node it ran on


def check_workers(world: int, device: str, address: str | None) -> None:
    """Refuse a run this machine cannot host, before anything is built or started: Ray would
    otherwise leave the extra workers pending (a hang) or start them until memory runs out."""
    if cluster_address(address):
        return  # a cluster's capacity is checked once joined (`_check_cluster`)
    if device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if world > have:
            raise PiperError(f"--gpus {world} needs {world} GPUs; this machine has {have} "
                             "(--address joins a Ray cluster with more)")
        return
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    most = max(2, ram // CPU_WORKER_BYTES)
    if world > most:
        raise PiperError(f"--gpus {world} on --device cpu starts {world} worker processes of "
                         f"about {CPU_WORKER_BYTES / 2**30:.1f} GiB each; this machine's "
                         f"{ram / 2**30:.0f} GiB holds at most {most} (--address joins a "
                         "Ray cluster with more)")


def _check_cluster(world: int, device: str) -> None:
    if device == "cuda":
        have = int(ray.cluster_resources().get("GPU", 0))
        if world > have:
            raise PiperError(f"--gpus {world} needs {world} GPUs; the Ray cluster has {have}")


def describe_nodes(nodes: tuple[str, ...]) -> str:
    """'ranks 0-1 on 10.0.0.2, ranks 2-3 on 10.0.0.3' (runs of consecutive ranks)."""
    out: list[str] = []
    start = 0
    for r in range(1, len(nodes) + 1):
        if r == len(nodes) or nodes[r] != nodes[start]:
            ranks = f"rank {start}" if r - start == 1 else f"ranks {start}-{r - 1}"
            out.append(f"{ranks} on {nodes[start]}")
            start = r
    return ", ".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


class Job:
    """One rank per Ray actor, set up and holding the plan's state between steps, so a
    caller steps when it likes (`run` steps straight through; a benchmark interleaves the
    steps of two systems). Closing kills the workers and frees their placement, and shuts
    down a Ray instance that this job started."""

    def __init__(self, spec: ModelSpec, plan: Plan, *, batch_size: int, seed: int,
                 device: str = "cpu", address: str | None = None, timeout_s: float = 300.0,
                 train: TrainConfig | None = None, done: int = 0, per_node: int | None = None,
                 shared: tuple[str, ...] = ()) -> None:
        """`done`: steps trained before (the ranks' state is then loaded by `restore`).
        `per_node`: ranks per node (default: `placement.default_per_node`). `shared`:
        folders every node must see as this machine does (a checkpoint folder), checked
        before setup."""
        if not plan.complete:
            raise ValueError("a simulation view of a Plan (some replicas left out) cannot run")
        self.plan = plan
        self.done = done
        self.started = False
        world = plan.world_size
        self.actors: list = []
        self.results: list[StepResult] = []
        self.peaks = [0] * world
        self.outs: list = []
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
            setup = _Waiter(max(timeout_s, SETUP_MIN_S) + DEADLINE_SLACK_S, self)
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
        if train and train.data:
            needs["--data"] = os.path.abspath(train.data)
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
                    raise PiperError(f"{what} ({path}) is not on node {node} ({_ranks(ranks)}"
                                     "): put it on storage every node mounts at the same "
                                     "path")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self) -> StepResult:
        """One training step on every rank: the loss summed over the output stage's ranks,
        and the slowest rank's time."""
        k = len(self.results) + self.done
        self.outs = self.wait([a.step.remote() for a in self.actors], f"step {k}")
        loss = sum(o.loss_sum for o in self.outs if o.loss_sum is not None)
        lrs = [o.lr for o in self.outs if o.lr == o.lr]  # a rank without parameters: nan
        self.results.append(StepResult(
            k, loss, max(o.time_s for o in self.outs), self.outs[0].grad_norm,
            lrs[0] if lrs else float("nan"), tuple(o.peak_memory_bytes for o in self.outs)))
        self.peaks = [max(p, o.peak_memory_bytes) for p, o in zip(self.peaks, self.outs)]
        return self.results[-1]

    def save(self, root: str, info: dict[str, Any]) -> str:
        """A checkpoint of the steps so far under `root` (`runtime.checkpoint`): every rank
        writes its part into a temporary folder, which becomes the latest checkpoint only
        once all have finished."""
        from runtime.checkpoint import commit, step_folder

        step = len(self.results) + self.done
        tmp = step_folder(root, step, tmp=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
        self.wait([a.save.remote(str(tmp)) for a in self.actors], f"saving step {step}")
        return str(commit(root, step, info))

    def restore(self, folder: str) -> None:
        """Every rank's state from a checkpoint (of any strategy)."""
        self.wait([a.load.remote(folder) for a in self.actors], "loading the checkpoint")

    def finish(self) -> RunResult:
        """Shut the ranks down in order and report every step so far, with the last step's
        timeline."""
        self.wait([a.shutdown.remote() for a in self.actors], "shutdown")
        spans = tuple(Span(r, stream, t, a, b) for r, o in enumerate(self.outs)
                      for stream, t, a, b in o.spans)
        return RunResult(tuple(self.results), tuple(self.peaks), self.plan, spans,
                         tuple(o.model_state_bytes for o in self.outs), self.nodes)

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

    def __init__(self, deadline_s: float, job: Job) -> None:
        self.deadline_s = deadline_s
        self.job = job

    def __call__(self, refs: list, what: str) -> list:
        rank_of = {ref: r for r, ref in enumerate(refs)}
        out: dict[int, Any] = {}
        pending = list(refs)
        end = time.monotonic() + self.deadline_s
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                ranks = sorted(rank_of[ref] for ref in pending)
                raise RuntimeFailure(f"{_ranks(ranks)} did not finish {what} within "
                                     f"{self.deadline_s:.0f}s: "
                                     + self._where_all(ranks, what, self.job.reports()))
            # short waits, so Ctrl-C is seen promptly while nothing happens
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, POLL_S))
            for ref in ready:
                try:
                    out[rank_of[ref]] = ray.get(ref)
                except RayError as e:
                    raise RuntimeFailure(self._failed(rank_of[ref], e, pending, rank_of, what)
                                         ) from None
        return [out[r] for r in range(len(refs))]

    def _failed(self, rank: int, err: RayError, pending: list, rank_of: dict, what: str) -> str:
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
        while not lost and pending and len(set(self.job.nodes)) > 1 and time.monotonic() < end:
            # a node's loss shows as its ranks dying or falling silent, seconds after their
            # peers elsewhere fail: look again before blaming the first rank that failed
            pending = collect(pending, POLL_S / 2)
            reports = self.job.reports()
            lost = self._lost_nodes(errors, reports)
        died = [r for r, e in errors.items() if isinstance(e, RayActorError)]
        first = died[0] if died else rank
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
        return msg

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
        return f"node {node} was lost ({_ranks(ranks)}): {where}"

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
    """`Type: message`, the message's last line cut to its first sentence (gloo appends
    advice and a source location to every error)."""
    if isinstance(err, RayActorError):
        return "died"
    cause = getattr(err, "cause", None) or err
    lines = str(cause).strip().splitlines()
    msg = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1].strip() if lines else "")
    msg = msg.split(". ")[0].rstrip(".")
    return f"{type(cause).__name__}: {msg}" if msg else type(cause).__name__


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
