"""`runtime.cluster.launcher.Job` without Ray: the same steps on ranks that are processes spawned on
this machine (`run --launcher local`) or started by torchrun (`--launcher torchrun`, this
process being rank 0), reached through torch's TCPStore (`runtime.cluster.process_ranks`)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from piper.model_file import ModelSpec
from runtime.cluster.jobs import DEADLINE_SLACK_S, SETUP_MIN_S, Driver
from runtime.cluster.process_ranks import Here, Ranks, Torchrun
from runtime.cluster.worker import Worker
from runtime.lowering.plan import Plan
from runtime.train.training import TrainConfig


def hosted_worker(rank: int, world: int, here: Here, store: Any, model: tuple,
                  device: str) -> Worker:
    """A rank's Worker, its process groups meeting in the driver's store."""
    worker = Worker(rank, world, model, device, here.threads, ip=here.ip, gpu=here.gpu)
    worker.store = dist.PrefixStore("piper/pg", store)
    return worker


class ProcessJob(Driver):
    """One rank per process: spawned here, or (`torchrun`) the processes torchrun started."""

    def __init__(self, spec: ModelSpec, plan: Plan, *, batch_size: int, seed: int,
                 device: str = "cpu", timeout_s: float = 300.0,
                 train: TrainConfig | None = None, done: int = 0,
                 torchrun: Torchrun | None = None) -> None:
        if not plan.complete:
            raise ValueError("a simulation view of a Plan (some replicas left out) cannot run")
        self.plan, self.done = plan, done
        self._start_steps()
        self.ranks: Ranks | None = None
        try:  # starting processes and capturing the model take a while: more time
            self.ranks = Ranks(plan.world_size, max(timeout_s, SETUP_MIN_S) + DEADLINE_SLACK_S,
                               torchrun)
            self.nodes = self.ranks.start(hosted_worker, spec.source, device)
            self.call_all("setup", "setup", plan, batch_size, seed, timeout_s, train, done)
        except BaseException:
            self.close()
            raise
        self.ranks.deadline_s = timeout_s + DEADLINE_SLACK_S

    def call_all(self, method: str, what: str, *args: Any) -> list:
        assert self.ranks is not None
        return self.ranks.call_all(method, what, *args)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
