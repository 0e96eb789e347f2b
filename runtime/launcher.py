"""Driver side of a real run: start one Ray actor per rank for a lowered Plan
(`runtime.lowering`), run the steps and gather losses, times and memory."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Self

import ray
from ray.exceptions import RayActorError, RayError

from piper.errors import PiperError
from piper.model_file import ModelSpec
from runtime.dryrun import Span
from runtime.plan import Plan
from runtime.progress import read_progress
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


def ensure_ray(address: str | None = None) -> bool:
    """Join `address`, or start a local Ray instance; True if this call connected (so the
    caller shuts it down), False if Ray was already up."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray starts workers at nice 15 so its own daemons stay responsive; our workers are the
    # job (torchrun's ranks run at 0), and at 15 any daemon or driver wake-up preempts them
    # (measured: 5-7% of a CPU pipeline step). Ray's job manager does the same for jobs.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    else:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)
    return True


def check_workers(world: int, device: str, address: str | None) -> None:
    """Refuse a run this machine cannot host, before anything is built or started: Ray would
    otherwise leave the extra workers pending (a hang) or start them until memory runs out."""
    if address:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(spec: ModelSpec, plan: Plan, *, batch_size: int, steps: int, seed: int,
        device: str = "cpu", address: str | None = None, timeout_s: float = 300.0,
        train: TrainConfig | None = None) -> RunResult:
    """Train `steps` steps of `plan` on real worker processes (a `Job` from start to end).

    `timeout_s` bounds every collective and P2P transfer (the process groups' timeout); the
    driver waits a little longer for each phase, so a hang is reported by the rank that
    waited. A rank that dies or fails stops the run at once: every worker is killed and a
    `RuntimeFailure` names the rank and the task it was running. So does Ctrl-C
    (KeyboardInterrupt, re-raised). A Ray instance this call started is shut down.
    """
    with Job(spec, plan, batch_size=batch_size, seed=seed, device=device, address=address,
             timeout_s=timeout_s, train=train) as job:
        for _ in range(steps):
            job.step()
        return job.finish()


class Job:
    """One rank per Ray actor, set up and holding the plan's state between steps, so a
    caller steps when it likes (`run` steps straight through; a benchmark interleaves the
    steps of two systems). Closing kills the workers, and shuts down a Ray instance that
    this job started."""

    def __init__(self, spec: ModelSpec, plan: Plan, *, batch_size: int, seed: int,
                 device: str = "cpu", address: str | None = None, timeout_s: float = 300.0,
                 train: TrainConfig | None = None, done: int = 0) -> None:
        """`done`: steps trained before (the ranks' state is then loaded by `restore`)."""
        if not plan.complete:
            raise ValueError("a simulation view of a Plan (some replicas left out) cannot run")
        self.plan = plan
        self.done = done
        self.started = False
        world = plan.world_size
        self.folder = tempfile.mkdtemp(prefix="piper-run-",
                                       dir=os.environ.get("PIPER_RUN_DIR"))
        self.actors: list = []
        self.results: list[StepResult] = []
        self.peaks = [0] * world
        self.outs: list = []
        try:  # from here on, close() undoes whatever was done (folder, Ray, actors)
            self.started = ensure_ray(address)
            _check_cluster(world, device)
            threads = max(1, (os.cpu_count() or 1) // world)
            master = f"127.0.0.1:{_free_port()}"
            gpu = 1 if device == "cuda" else 0
            self.actors = [RemoteWorker.options(num_cpus=0, num_gpus=gpu).remote(
                r, world, master, spec.source, device, threads, self.folder)
                for r in range(world)]
            # setup also starts the processes and captures the model: it gets more time
            _Waiter(max(timeout_s, SETUP_MIN_S) + DEADLINE_SLACK_S, self.folder)(
                [a.setup.remote(plan, batch_size, seed, timeout_s, train, done)
                 for a in self.actors],
                "setup")
        except BaseException:
            self.close()
            raise
        self.wait = _Waiter(timeout_s + DEADLINE_SLACK_S, self.folder)

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
                         tuple(o.model_state_bytes for o in self.outs))

    def close(self) -> None:
        for a in self.actors:  # on success too: the processes end now, not when Ray gets
            ray.kill(a, no_restart=True)  # to it
        self.actors = []
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.started:
            self.started = False
            ray.shutdown()


class _Waiter:
    """Waits for one phase (setup, a step) on every rank and stops at the first failure: a
    rank that raised, a rank whose process died, or a phase past its deadline. Each message
    names the rank and, from its progress file, the task it was running."""

    def __init__(self, deadline_s: float, folder: str) -> None:
        self.deadline_s = deadline_s
        self.folder = folder

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
                                     f"{self.deadline_s:.0f}s: " + self._where_all(ranks, what))
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
        if pending:  # a dead rank's peers fail a moment later (their sockets close): wait a
            # little, so the message leads with the root cause, not with its echo
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S)
            for ref in more:
                try:
                    ray.get(ref)
                except RayError as e:
                    errors[rank_of[ref]] = e
        died = [r for r, e in errors.items() if isinstance(e, RayActorError)]
        first = died[0] if died else rank
        msg = self._describe(first, errors[first], what)
        then = [r for r in errors if r != first]
        if then:
            msg += "; then " + "; ".join(f"rank {r} failed ({_reason(errors[r])})" for r in then)
        still = sorted(rank_of[ref] for ref in pending)
        if still:
            msg += "; still running: " + self._where_all(still, what)
        return msg

    def _describe(self, rank: int, err: RayError, what: str) -> str:
        p = read_progress(self.folder, rank)
        where = p.describe() if p else f"during {what}"
        if isinstance(err, RayActorError):
            pid = f" (pid {p.pid})" if p else ""
            return f"rank {rank}{pid} died {where}: its worker process exited unexpectedly"
        return f"rank {rank} failed {where}: {_reason(err)}"

    def _where_all(self, ranks: list[int], what: str) -> str:
        out = []
        for r in ranks:
            p = read_progress(self.folder, r)
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
