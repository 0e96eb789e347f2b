"""The Ray actor that hosts one rank: joins the process groups, builds its stages, runs steps."""

from __future__ import annotations

import datetime
import os
from typing import Any

import ray
import torch
import torch.distributed as dist

from piper.capture import capture
from piper.model_file import load_model_file
from runtime.executor import RankExecutor, StepOutcome
from runtime.plan import Plan


class Worker:
    """One rank in its own process. Methods are called in order: setup, step*, shutdown."""

    def __init__(self, rank: int, world: int, master: str, model_path: str,
                 model_args: tuple[tuple[str, Any], ...], device: str, threads: int) -> None:
        self.rank, self.world, self.master = rank, world, master
        self.model_path, self.model_args = model_path, model_args
        self.device_type = device
        torch.set_num_threads(threads)
        self.ex: RankExecutor | None = None

    def setup(self, plan: Plan, batch_size: int, seed: int, timeout_s: float) -> int:
        if self.device_type == "cuda":
            device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to our GPU
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{self.master}", rank=self.rank,
                                world_size=self.world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        groups = {g: dist.new_group(list(g)) for g in plan.groups}
        spec = load_model_file(self.model_path, self.model_args)
        mb = batch_size // (plan.dp * plan.microbatches)
        self.ex = RankExecutor(plan, self.rank, spec, capture(spec, mb), batch_size, seed,
                               device, groups)
        return os.getpid()

    def step(self) -> StepOutcome:
        assert self.ex is not None, "setup() first"
        return self.ex.step()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


RemoteWorker = ray.remote(Worker)
