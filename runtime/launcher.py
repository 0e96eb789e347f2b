"""Driver side of a real run: capture, lower the Program to a Plan, start one Ray actor per
rank, run the steps and gather losses, times and memory."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from piper.capture import capture
from piper.dag import TrainingDAG, single_device_dag
from piper.errors import PiperError
from piper.model_file import ModelSpec
from piper.program import Program
from runtime.dryrun import Span
from runtime.plan import Plan
from runtime.scheduler import schedule
from runtime.worker import RemoteWorker


class RuntimeFailure(Exception):
    """A worker died or timed out (exit code 3); the message names the rank."""


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    time_s: float


@dataclass(frozen=True)
class RunResult:
    steps: tuple[StepResult, ...]
    peak_memory_bytes: tuple[int, ...]
    plan: Plan
    spans: tuple[Span, ...] = ()  # the last step's measured timeline
    model_state_bytes: tuple[int, ...] = ()  # per rank: peak params + grads + optimizer state


def microbatch_size(batch_size: int, dp: int, microbatches: int) -> int:
    """The per-microbatch sample count; a `PiperError` says which division fails."""
    if batch_size % dp:
        raise PiperError(f"batch size {batch_size} is not divisible by dp={dp}")
    per = batch_size // dp
    if per % microbatches:
        raise PiperError(f"--microbatches {microbatches} does not divide the per-replica batch "
                         f"{per} (batch {batch_size} / dp {dp})")
    return per // microbatches


def program_microbatch_size(program: Program, batch_size: int) -> int:
    s = program.summary()
    return microbatch_size(batch_size, s["dp"], s["microbatches"])


def apply_for(program: Program, dag: TrainingDAG, gpus: int) -> TrainingDAG:
    """Apply `program` to a single-device DAG and check it uses exactly `gpus` devices."""
    out = program.apply(dag)
    if out.world_size != gpus:
        raise PiperError(f"strategy needs pp={out.pp} x dp={out.dp} = {out.world_size} "
                         f"devices, but --gpus is {gpus}")
    return out


def lower(spec: ModelSpec, program: Program, gpus: int, batch_size: int) -> Plan:
    """Capture at the microbatch size, apply the Program, check the world size, schedule."""
    mb = program_microbatch_size(program, batch_size)
    return schedule(apply_for(program, single_device_dag(capture(spec, mb).graph), gpus))


def ensure_ray(address: str | None = None) -> None:
    """Join `address`, or start a local Ray instance once per process."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    else:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(spec: ModelSpec, plan: Plan, *, batch_size: int, steps: int, seed: int,
        device: str = "cpu", address: str | None = None, timeout_s: float = 300.0
        ) -> RunResult:
    """Train `steps` steps of `plan` on real worker processes."""
    ensure_ray(address)
    world = plan.world_size
    threads = max(1, (os.cpu_count() or 1) // world)
    master = f"127.0.0.1:{_free_port()}"
    gpu = 1 if device == "cuda" else 0
    actors = [RemoteWorker.options(num_cpus=0, num_gpus=gpu).remote(
        r, world, master, os.path.abspath(spec.path), spec.model_args, device, threads)
        for r in range(world)]
    try:
        _gather([a.setup.remote(plan, batch_size, seed, timeout_s) for a in actors],
                timeout_s, "setup")
        results, peaks, spans = [], [0] * world, ()
        for k in range(steps):
            outs = _gather([a.step.remote() for a in actors], timeout_s, f"step {k}")
            loss = sum(o.loss_sum for o in outs if o.loss_sum is not None)
            results.append(StepResult(k, loss, max(o.time_s for o in outs)))
            peaks = [max(p, o.peak_memory_bytes) for p, o in zip(peaks, outs)]
            spans = tuple(Span(r, stream, t, a, b) for r, o in enumerate(outs)
                          for stream, t, a, b in o.spans)
        _gather([a.shutdown.remote() for a in actors], timeout_s, "shutdown")
        states = tuple(o.model_state_bytes for o in outs)
        return RunResult(tuple(results), tuple(peaks), plan, spans, states)
    finally:
        for a in actors:
            ray.kill(a)


def _gather(refs: list, timeout_s: float, what: str) -> list:
    """ray.get per rank so a failure names the rank that failed."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out = []
    for rank, ref in enumerate(refs):
        if ref not in ready:
            raise RuntimeFailure(f"rank {rank} did not finish {what} within {timeout_s:.0f}s")
        try:
            out.append(ray.get(ref))
        except RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise RuntimeFailure(f"rank {rank} failed in {what}: {type(cause).__name__}: "
                                 f"{str(cause).strip().splitlines()[-1] if str(cause) else ''}")
        except (RayActorError, GetTimeoutError) as e:
            raise RuntimeFailure(f"rank {rank} died in {what}: {type(e).__name__}")
    return out
