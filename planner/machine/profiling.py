"""Host `cost_models.probes` on real worker processes: one Ray actor per rank, or one process
per rank spawned here (`launcher="local"`, no Ray: `runtime.cluster.process_ranks`), a real
`torch.distributed` process group between them, as `piper-plan run` starts them.

    measurements = measure(spec, gpus=4, device="cpu", batch_size=32)

Compute probes run on rank 0 alone while the others wait at a barrier, so chunk timings are
those of an unshared device (sharing is the simulator's business: `cost_models.contention`);
communication probes run on every rank at once. Last, a short real run of the runtime
(`short_run`) times what no probe sees: the executor's own work between two tasks, and
compute among the step's other work.
"""

from __future__ import annotations

import datetime
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cost_models.calibrate import Measurements, RunSample
from cost_models.fit import CommSample
from cost_models.probes import (
    ComputeTimings,
    group_layout,
    time_collectives,
    time_compute,
    time_sharing,
)
from piper.capture import capture
from piper.errors import PiperError
from piper.loading import load_model
from piper.model_file import ModelSpec
from runtime.cluster.jobs import RuntimeFailure, free_port
from runtime.cluster.process_ranks import Here, Ranks


@dataclass(frozen=True)
class ProbePlan:
    """What to time: message sizes (bytes), group sizes, microbatch sizes, repetitions."""

    message_bytes: tuple[int, ...] = (2**12, 2**14, 2**16, 2**18, 2**20, 2**22, 2**24)
    """Up to 16 MiB: a stage's gradients are megabytes even for small models, and a
    bandwidth fitted on kilobytes alone mispriced them by up to 5x (gloo on CPU)."""
    microbatch_sizes: tuple[int, ...] = (1, 4)
    reps: int = 4
    rounds: int = 3


class ProbeWorker:
    """One rank of a profile run. Methods in order: setup, comm, compute, shutdown."""

    def __init__(self, rank: int, world: int, master: str, model: tuple, device: str,
                 threads: int, gpu: int = 0) -> None:
        self.rank, self.world, self.master = rank, world, master
        self.model = model  # `ModelSpec.source`
        self.device = torch.device("cuda", gpu) if device == "cuda" else torch.device("cpu")
        torch.set_num_threads(threads)
        self.groups: dict[tuple[int, ...], object] = {}
        self.layout: dict[int, list[tuple[int, ...]]] = {}

    def setup(self, timeout_s: float) -> int:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                init_method=f"tcp://{self.master}", rank=self.rank,
                                world_size=self.world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.layout = group_layout(self.world, (2, self.world))
        for gs in self.layout.values():
            for g in gs:
                self.groups[g] = dist.new_group(list(g))
        return os.getpid()

    def comm(self, plan: ProbePlan) -> list[CommSample]:
        return time_collectives(self.rank, self.groups, self.layout, plan.message_bytes,
                                self.device, plan.reps, plan.rounds)

    def sharing(self, plan: ProbePlan) -> tuple[list[float], list[float]]:
        return time_sharing(self.rank, self.device, plan.reps, plan.rounds)

    def compute(self, plan: ProbePlan) -> ComputeTimings | None:
        out = None
        if self.rank == 0:
            spec = load_model(*self.model)
            captures = [capture(spec, b) for b in plan.microbatch_sizes]
            out = time_compute(spec, captures, self.device, plan.reps)
        dist.barrier()
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def probe_host(rank: int, world: int, here: Here, store: object, master: str, model: tuple,
               device: str) -> ProbeWorker:
    """A spawned rank's probe (`runtime.cluster.process_ranks`)."""
    return ProbeWorker(rank, world, master, model, device, here.threads, here.gpu)


def measure(spec: ModelSpec, *, gpus: int, device: str, plan: ProbePlan | None = None,
            address: str | None = None, timeout_s: float = 120.0,
            launcher: str = "ray") -> Measurements:
    """Run the probes on `gpus` fresh worker processes (Ray actors, or with `launcher`
    "local" processes spawned here); RuntimeFailure names a failed rank."""
    if gpus < 2:
        raise PiperError(f"profile needs --gpus >= 2 to time communication, got {gpus}")
    plan = plan or ProbePlan()
    master = f"127.0.0.1:{free_port()}"  # one node's devices: a loopback rendezvous
    if launcher == "local":
        ranks = Ranks(gpus, timeout_s)
        try:
            ranks.start(probe_host, master, spec.source, device)
            comm, compute, sharing = _probe(ranks.call_all, plan, timeout_s)
        finally:
            ranks.close()
    else:
        comm, compute, sharing = _on_ray(spec, gpus, device, plan, address, timeout_s, master)
    sample = short_run(spec, gpus, device, timeout_s, launcher)
    return Measurements(device=device, device_name=_device_name(device), ranks=gpus,
                        memory_bytes=_memory_per_rank(device, gpus),
                        cores=effective_cores(sharing) if device == "cpu" else None,
                        comm=tuple(slowest_rank(comm)), compute=compute,
                        run=sample)


def _probe(call_all: Callable[..., list], plan: ProbePlan, timeout_s: float
           ) -> tuple[list, ComputeTimings | None, list]:
    """Every probe, in order, through `call_all(method, what, *args)` on all ranks."""
    call_all("setup", "setup", timeout_s)
    comm = call_all("comm", "communication", plan)
    compute = call_all("compute", "compute", plan)[0]
    sharing = call_all("sharing", "sharing", plan)
    call_all("shutdown", "shutdown")
    return comm, compute, sharing


def _on_ray(spec: ModelSpec, gpus: int, device: str, plan: ProbePlan, address: str | None,
            timeout_s: float, master: str) -> tuple[list, ComputeTimings | None, list]:
    import ray

    from runtime.cluster.join import cluster_address, connect, disconnect, remote_source
    from runtime.cluster.placement import place, rank_resources

    started = connect(address, ship=[spec.source[0]])
    threads = max(1, (os.cpu_count() or 1) // gpus)  # what runtime.cluster.launcher gives a rank
    needs = rank_resources(device, cluster_address(address) is not None, gpus)
    where = place(gpus, gpus, needs)
    actors = [ray.remote(ProbeWorker).options(
        num_cpus=needs.get("CPU", 0), num_gpus=needs.get("GPU", 0), **where.options(r)
    ).remote(r, gpus, master, remote_source(spec.source), device, threads)
        for r in range(gpus)]

    def call_all(method: str, what: str, *args: object) -> list:
        return _gather([getattr(a, method).remote(*args) for a in actors], timeout_s, what)

    try:
        return _probe(call_all, plan, timeout_s)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        where.remove()
        if started:
            disconnect()


RUN_STEPS = 4
RUN_MICROBATCH = 4
"""Steps of the short real run; only the last one's timeline is used."""


def short_run(spec: ModelSpec, gpus: int, device: str, timeout_s: float,
              launcher: str = "ray") -> RunSample:
    """A few real steps of 1F1B over two stages where the model and `gpus` allow (data
    parallel for the rest), for what only the runtime adds to
    the probes' figures (`cost_models.calibrate`): time between tasks, and how much slower
    compute runs among the step's other work than alone."""
    from piper import schedules
    from runtime.lowering.lower import lower
    from search_spaces.partition import balanced_stages

    names = capture(spec, 1).graph.names
    pp = 2 if gpus % 2 == 0 and len(names) >= 2 else 1
    dp = gpus // pp
    cut = balanced_stages([1.0] * len(names), pp)
    program = schedules.one_f_one_b([[names[i] for i in r] for r in cut],
                                    microbatches=2 * pp, dp=dp)
    # microbatches as the model file's batch gives them (at most RUN_MICROBATCH samples):
    # how much slower compute runs among the step's other work depends on its size
    mb = max(1, min(RUN_MICROBATCH, spec.batch_size // (2 * pp * dp)))
    batch = mb * 2 * pp * dp
    plan = lower(spec, program, gpus, batch)
    if launcher == "local":
        from runtime.cluster.process_job import ProcessJob

        with ProcessJob(spec, plan, batch_size=batch, seed=0, device=device,
                        timeout_s=timeout_s) as job:
            for _ in range(RUN_STEPS):
                job.step()
            res = job.finish()
    else:
        from runtime.cluster.launcher import run

        res = run(spec, plan, batch_size=batch, steps=RUN_STEPS, seed=0, device=device,
                  timeout_s=timeout_s)
    return RunSample(plan, mb, res.spans)


def effective_cores(sharing: list[tuple[list[float], list[float]]]) -> float:
    """Cores N ranks computing at once effectively share: N x (rank 0 alone) / (each rank
    with all at once), medians; at most N (ranks never get more than one core's worth)."""
    n = len(sharing)
    alone = statistics.median(sharing[0][0])
    together = statistics.median(t for _, ts in sharing for t in ts)
    return min(float(n), n * alone / together)


def slowest_rank(per_rank: list[list[CommSample]]) -> list[CommSample]:
    """Per measurement (same position on every rank that took part), the slowest rank."""
    out: dict[tuple[str, int, int, int], CommSample] = {}
    for samples in per_rank:
        seen: dict[tuple[str, int, int], int] = {}
        for s in samples:
            k = (s.kind, s.ranks, s.nbytes)
            i = seen[k] = seen.get(k, -1) + 1
            key = (*k, i)
            if key not in out or s.seconds > out[key].seconds:
                out[key] = s
    return list(out.values())


def _gather(refs: list, timeout_s: float, what: str) -> list:
    import ray

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out = []
    for rank, ref in enumerate(refs):
        if ref not in ready:
            raise RuntimeFailure(f"rank {rank} did not finish profiling {what} within "
                                 f"{timeout_s:.0f}s")
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayError as e:
            raise RuntimeFailure(f"rank {rank} failed profiling {what}: "
                                 f"{type(e).__name__}: {str(e).strip().splitlines()[-1]}"
                                 ) from None
    return out


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU (gloo): {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return "CPU (gloo)"


def _memory_per_rank(device: str, gpus: int) -> int:
    if device == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(ram // gpus)
