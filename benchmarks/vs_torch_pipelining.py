"""Step time of our pipeline schedules against torch.distributed.pipelining, same everything.

    python benchmarks/vs_torch_pipelining.py --ranks 2 4 --repeats 3 --steps 20

Same model (examples/gpt.py, size=mini), same seed and batch, same microbatches, same stage
boundaries (ours, balanced by cost), same threads per rank, gloo on CPU. Ours runs on Ray
actors (a `runtime.cluster.launcher.Job` on one Ray instance for the whole run, as on a cluster);
theirs runs torch's `Schedule1F1B` / `ScheduleInterleaved1F1B` / `ScheduleDualPipeV` in
spawned processes. Both are set up side by side and their steps alternate one by one, so the
machine's drift in speed (large on a shared 2-core VM) hits both alike; each run's first
`--warmup` steps are dropped; the table gives the median step over all runs of each system,
their ratio, and the median of the step-by-step ratios with a 95% bootstrap interval.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy.stats import bootstrap
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cost_models import CATALOG
from piper import schedules
from piper.model_file import ModelSpec, load_model_file
from planner.search.evaluate import Evaluator
from runtime.cluster.jobs import free_port
from runtime.cluster.join import connect
from runtime.cluster.launcher import Job
from runtime.lowering.lower import lower
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
                   microbatches: int, batch: int, threads: int, conn: Connection) -> None:
    """One rank of torch's schedule: set up, then one step per "step" received (rank 0
    answers with the slowest rank's time) until None."""
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
    args = [x] if 0 in mine else []
    kwargs = {"target": y} if len(stages) - 1 in mine else {}
    conn.send("ready")
    while conn.recv() is not None:
        dist.barrier()
        t0 = time.perf_counter()
        sched.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            conn.send(float(t))
    dist.destroy_process_group()


class Theirs:
    """torch's schedule on `world` processes, stepped one step at a time like our `Job`."""

    def __init__(self, schedule: str, stages: list[list[str]], world: int, microbatches: int,
                 batch: int) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        threads = max(1, (os.cpu_count() or 1) // world)
        self.conns, self.procs = [], []
        for r in range(world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_theirs_worker, args=(r, world, port, schedule, stages,
                                                            microbatches, batch, threads,
                                                            theirs), daemon=True)
            proc.start()
            theirs.close()  # the child's end lives in the child only: its death ends recv()
            self.conns.append(mine)
            self.procs.append(proc)
        for c in self.conns:
            try:
                c.recv()
            except EOFError:
                raise RuntimeError("a torch.distributed.pipelining rank failed to start"
                                   ) from None

    def step(self) -> float:
        for c in self.conns:
            c.send("step")
        return self.conns[0].recv()

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def cell(spec: ModelSpec, schedule: str, stages: list[list[str]], world: int,
         microbatches: int, batch: int, warmup: int, steps: int) -> tuple[list[float],
                                                                          list[float]]:
    """Both systems set up side by side, then their steps alternate (the one going first
    alternating too), so drift in the machine's speed hits both alike."""
    prog = schedules.build(schedule, stages, microbatches=microbatches, pp=world)
    plan = lower(spec, prog, world, batch)
    ours: list[float] = []
    theirs: list[float] = []
    with Job(spec, plan, batch_size=batch, seed=0) as job:
        other = Theirs(schedule, stages, world, microbatches, batch)
        try:
            for k in range(warmup + steps):
                if k % 2:
                    b = other.step()
                    a = job.step().time_s
                else:
                    a = job.step().time_s
                    b = other.step()
                if k >= warmup:
                    ours.append(a)
                    theirs.append(b)
        finally:
            other.close()
    return ours, theirs


def paired_ratio(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """Median of the step-by-step ratios ours/theirs (neighbouring steps share the machine's
    state of the moment), with a 95% bootstrap confidence interval of that median."""
    r = np.array(ours) / np.array(theirs)
    ci = bootstrap((r,), np.median, confidence_level=0.95, random_state=0).confidence_interval
    return float(np.median(r)), float(ci.low), float(ci.high)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=list(THEIRS))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2, help="steps dropped from each run")
    ap.add_argument("--steps", type=int, default=10, help="steps measured in each run")
    ap.add_argument("--repeats", type=int, default=3, help="fresh runs per cell")
    args = ap.parse_args()
    connect()  # one Ray instance for every run, as on a user's cluster
    spec = load_model_file(GPT, MODEL_ARGS)
    ev = Evaluator(spec, 1, args.batch, CATALOG["cpu"])
    names = ev.captured.graph.names
    print("| ranks | schedule | ours median step (s) | torch median step (s) | ours/torch | "
          "paired ours/torch, median [95% CI] |")
    print("|---|---|---|---|---|---|")
    for world in args.ranks:
        for schedule in args.schedules:
            v = VIRTUAL[schedule]
            stages = [[names[i] for i in r]
                      for r in balanced_stages(ev.region_costs(), world * v)]
            a: list[float] = []
            b: list[float] = []
            for _ in range(args.repeats):
                ours, theirs = cell(spec, schedule, stages, world, args.microbatches,
                                    args.batch, args.warmup, args.steps)
                a += ours
                b += theirs
            ma, mb = statistics.median(a), statistics.median(b)
            mid, lo, hi = paired_ratio(a, b)
            print(f"| {world} | {schedule} | {ma:.4f} | {mb:.4f} | {ma / mb:.3f} | "
                  f"{mid:.3f} [{lo:.3f}, {hi:.3f}] |", flush=True)


if __name__ == "__main__":
    main()
