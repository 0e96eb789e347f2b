"""Step time of our pipeline schedules against torch.distributed.pipelining, same everything.

    python benchmarks/vs_torch_pipelining.py --ranks 2 4 --repeats 3

Same model (examples/gpt.py, size=mini), same seed and batch, same microbatches, same stage
boundaries (ours, balanced by cost), same threads per rank, gloo on CPU. Ours runs on Ray
actors through `runtime.launcher.run`; theirs runs torch's `Schedule1F1B` /
`ScheduleInterleaved1F1B` / `ScheduleDualPipeV` in processes from `torch.multiprocessing`. Runs alternate
(ours, theirs, ours, ...) so machine noise hits both; each run's first step (warm-up) is
dropped and the median of the rest is reported, with the ratio ours/theirs.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cost_models import CATALOG
from piper import schedules
from piper.model_file import ModelSpec, load_model_file
from planner.evaluate import Evaluator
from runtime.launcher import lower, run
from search_spaces.partition import balanced_stages

GPT = str(ROOT / "examples" / "gpt.py")
MODEL_ARGS = (("size", "mini"),)
THEIRS = {"1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
          "dualpipev": "ScheduleDualPipeV"}
VIRTUAL = {"1f1b": 1, "interleaved-1f1b": 2, "dualpipev": 2}


def device_of(schedule: str, stage: int, n_stages: int, world: int) -> int:
    """Where both systems put a stage: looped for interleaving, a V for dualpipev."""
    if schedule == "dualpipev" and stage >= world:
        return n_stages - 1 - stage
    return stage % world


class RegionStage(nn.Module):
    """The GPT regions of one stage, run in order (the same cut as our Place directives)."""

    def __init__(self, model: nn.Module, regions: list[str]) -> None:
        super().__init__()
        self.regions = regions
        if "embed" in regions:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleDict({r.replace(".", "_"): model.blocks[int(r.split(".")[1])]
                                     for r in regions if r.startswith("layer.")})
        if "head" in regions:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for r in self.regions:
            if r == "embed":
                x = self.tok(x) + self.pos(torch.arange(x.shape[1]))
            elif r == "head":
                x = self.lm_head(self.ln_f(x))
            else:
                x = self.blocks[r.replace(".", "_")](x)
        return x


def _theirs_worker(rank: int, world: int, port: int, schedule: str, stages: list[list[str]],
                   microbatches: int, batch: int, steps: int, threads: int, out: dict) -> None:
    from torch.distributed import pipelining

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    spec = load_model_file(GPT, MODEL_ARGS)
    torch.manual_seed(0)
    model = spec.build()
    torch.manual_seed(0)
    (x,), y = spec.batch(batch)
    mine = [s for s in range(len(stages)) if device_of(schedule, s, len(stages), world) == rank]
    pstages = [pipelining.PipelineStage(RegionStage(model, stages[s]), s, len(stages),
                                        torch.device("cpu")) for s in mine]
    params = [p for st in pstages for p in st.submod.parameters()]
    opt = spec.make_optimizer(params)
    cls = getattr(pipelining, THEIRS[schedule])
    sched = cls(pstages[0] if schedule == "1f1b" else pstages, microbatches,
                loss_fn=spec.loss_fn)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        kwargs = {}
        if 0 in mine:
            kwargs["x"] = x
        if len(stages) - 1 in mine:
            kwargs["target"] = y
        sched.step(*([kwargs.pop("x")] if "x" in kwargs else []), **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    if rank == 0:
        out["times"] = times
    dist.destroy_process_group()


def theirs(schedule: str, stages: list[list[str]], world: int, microbatches: int, batch: int,
           steps: int) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as m:
        out = m.dict()
        threads = max(1, (os.cpu_count() or 1) // world)
        mp.spawn(_theirs_worker, args=(world, port, schedule, stages, microbatches, batch,
                                       steps, threads, out), nprocs=world)
        return list(out["times"])


def ours(spec: ModelSpec, schedule: str, stages: list[list[str]], world: int,
         microbatches: int, batch: int, steps: int) -> list[float]:
    prog = schedules.build(schedule, stages, microbatches=microbatches, pp=world)
    plan = lower(spec, prog, world, batch)
    return [s.time_s for s in run(spec, plan, batch_size=batch, steps=steps, seed=0).steps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=list(THEIRS))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    spec = load_model_file(GPT, MODEL_ARGS)
    ev = Evaluator(spec, 1, args.batch, CATALOG["cpu"])
    names = ev.captured.graph.names
    print("| ranks | schedule | ours median step (s) | torch median step (s) | ours/torch |")
    print("|---|---|---|---|---|")
    for world in args.ranks:
        for schedule in args.schedules:
            v = VIRTUAL[schedule]
            stages = [[names[i] for i in r]
                      for r in balanced_stages(ev.region_costs(), world * v)]
            a: list[float] = []
            b: list[float] = []
            for _ in range(args.repeats):
                a += ours(spec, schedule, stages, world, args.microbatches, args.batch,
                          args.steps)[1:]
                b += theirs(schedule, stages, world, args.microbatches, args.batch,
                            args.steps)[1:]
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"| {world} | {schedule} | {ma:.4f} | {mb:.4f} | {ma / mb:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
