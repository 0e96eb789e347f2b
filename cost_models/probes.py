"""Short real measurements inside one rank's process, for `piper-plan profile` to fit.

Collectives and P2P run on real `torch.distributed` process groups (gloo on CPU, NCCL on
CUDA) that the caller has initialised; chunks run the same stage modules the runtime runs
(`runtime.execute.stage_module.build_stage`), one region at a time, forward then backward, on real
tensors. Nothing here starts processes: `planner.machine.profiling` hosts these in Ray actors.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cost_models.fit import P2P, CommSample, MatmulSample, OptimizerSample
from piper.capture import Captured
from piper.model_file import ModelSpec
from runtime.execute.stage_module import build_stage

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
SEND_POST = "send_post"
SHARING_S = 0.05
MATMUL_SIZES = (16, 32, 64, 128, 192, 256, 384)
"""Square matmul sides: from dispatch-bound to rate-bound on a CPU core or a GPU."""


@dataclass(frozen=True, slots=True)
class ChunkTiming:
    """Mean forward and backward seconds of one region at `samples` samples (the mean, not
    the median: a step is a sum of many chunks, so their occasional slow runs add up)."""

    region: str
    samples: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True, slots=True)
class ComputeTimings:
    chunks: tuple[ChunkTiming, ...]
    matmuls: tuple[MatmulSample, ...]
    optimizer: tuple[OptimizerSample, ...]


def group_layout(world: int, sizes: Sequence[int]) -> dict[int, list[tuple[int, ...]]]:
    """Disjoint groups of consecutive ranks for each group size (every rank must create
    every group, in this order, for `dist.new_group`)."""
    return {p: [tuple(range(i, i + p)) for i in range(0, world - p + 1, p)]
            for p in sorted(set(sizes)) if 2 <= p <= world}


def time_collectives(rank: int, groups: dict[tuple[int, ...], Any],
                     layout: dict[int, list[tuple[int, ...]]], sizes: Sequence[int],
                     device: torch.device, reps: int, rounds: int) -> list[CommSample]:
    """This rank's seconds per op for every kind, group size and message size.

    All groups of one size run at once (as data-parallel groups of a pipeline do); `reps`
    back-to-back ops after one barrier amortise the barrier's skew; `rounds` repeat that.
    The driver takes, per round, the slowest rank (the op ends when its last rank is done).
    """
    out = []
    for kind in (*COLLECTIVE_KINDS, P2P):
        for p, gs in layout.items():
            if kind == P2P and p != 2:
                continue
            mine = next((g for g in gs if rank in g), None)
            for nbytes in sizes:
                numel = max(p, nbytes // 4 // p * p)
                op = _op(kind, numel, mine, groups, rank, device) if mine else None
                if op is not None:
                    op()  # warm-up: buffers, connections
                for _ in range(rounds):
                    dist.barrier()
                    if op is None:
                        continue
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        op()
                    _sync(device)
                    per = (time.perf_counter() - t0) / reps
                    if kind == P2P:
                        per /= 2  # a ping-pong is two messages
                    out.append(CommSample(kind, p, numel * 4, per))
    out += _time_send_posts(rank, layout, device, reps * rounds)
    dist.barrier()
    return out


def _time_send_posts(rank: int, layout: dict[int, list[tuple[int, ...]]],
                     device: torch.device, count: int) -> list[CommSample]:
    """Seconds the first rank of each pair spends posting an `isend` (LogP's sender
    overhead o: the CPU time a SEND task takes; the wire time is the alpha-beta part)."""
    pair = next((g for g in layout.get(2, ()) if rank in g), None)
    out = []
    x = torch.ones(1024, device=device)
    for _ in range(count):
        dist.barrier()
        if pair is None:
            continue
        if rank == pair[0]:
            t0 = time.perf_counter()
            work = dist.isend(x, pair[1])
            out.append(CommSample(SEND_POST, 2, x.numel() * 4, time.perf_counter() - t0))
            work.wait()
        else:
            dist.recv(x, pair[0])
    return out


def _op(kind: str, numel: int, group: tuple[int, ...], groups: dict[tuple[int, ...], Any],
        rank: int, device: torch.device) -> Callable[[], None]:
    pg = groups[group]
    p = len(group)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // p, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=pg)
    if kind == "all_gather":
        return lambda: dist.all_gather_single(full, part, group=pg)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(part, full, group=pg)
    peer = group[1] if rank == group[0] else group[0]

    def ping_pong() -> None:
        if rank == group[0]:
            dist.send(full, peer)
            dist.recv(full, peer)
        else:
            dist.recv(full, peer)
            dist.send(full, peer)
    return ping_pong


def time_compute(spec: ModelSpec, captures: Sequence[Captured], device: torch.device,
                 reps: int) -> ComputeTimings:
    """Chunks of every region at each capture's batch (the microbatch sizes to fit on), a
    matmul size sweep, and optimizer steps."""
    torch.manual_seed(0)
    model = spec.build().to(device)
    return ComputeTimings(
        chunks=tuple(c for cap in captures for c in time_regions(spec, cap, model, device,
                                                                 reps)),
        matmuls=tuple(time_matmuls(device, reps)),
        optimizer=tuple(time_optimizer(spec, model, captures[0], device, reps)),
    )


def time_regions(spec: ModelSpec, captured: Captured, model: torch.nn.Module,
                 device: torch.device, reps: int) -> list[ChunkTiming]:
    """Forward and backward of each region alone, chained as a pipeline of one-region
    stages would run them (the output region's forward includes the loss, as the runtime's
    does)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    batch = captured.graph.batch
    inputs, targets = spec.batch(batch)
    inputs = tuple(t.to(device) for t in inputs)
    targets = targets.to(device) if isinstance(targets, torch.Tensor) else targets
    regions = captured.graph.regions
    stages = [build_stage(captured, {i}, device) for i in range(len(regions))]
    fwd: list[list[float]] = [[] for _ in regions]
    bwd: list[list[float]] = [[] for _ in regions]
    for rep in range(reps + 1):  # the first round warms caches and allocators
        acts: dict[str, torch.Tensor] = {}
        kept = []
        for i, sm in enumerate(stages):
            args, leaves, weights = [], [], []
            for kind, key in sm.inputs:
                if kind == "param":
                    args.append(params[key])
                    weights.append(params[key])
                elif kind == "buffer":
                    args.append(buffers[key])
                elif kind == "input":
                    args.append(inputs[key])
                else:
                    x = acts[key].detach()
                    if x.is_floating_point():
                        x.requires_grad_(True)
                        leaves.append((key, x))
                    args.append(x)
            t0 = _now(device)
            outs = dict(zip(sm.outputs, sm.module(*args), strict=True))
            loss = None
            if sm.model_outputs:
                loss = spec.loss_fn(sm.model_output(outs), targets)
            t = _now(device) - t0
            if rep:
                fwd[i].append(t)
            acts.update(outs)
            kept.append((outs, loss, leaves, list(dict.fromkeys(weights))))
        grads: dict[str, torch.Tensor] = {}
        for i in reversed(range(len(stages))):
            outs, loss, leaves, weights = kept[i]
            roots, seeds = ([loss], [torch.ones_like(loss)]) if loss is not None else ([], [])
            for name, o in outs.items():
                g = grads.pop(name, None)
                if g is not None and o.requires_grad:
                    roots.append(o)
                    seeds.append(g)
            wanted = [x for _, x in leaves] + [w for w in weights if w.requires_grad]
            t0 = _now(device)
            if roots and wanted:
                torch.autograd.backward(roots, seeds, inputs=wanted)
            t = _now(device) - t0
            if rep:
                bwd[i].append(t)
            for name, x in leaves:
                if x.grad is not None:
                    grads[name] = grads[name] + x.grad if name in grads else x.grad
        model.zero_grad(set_to_none=True)
    return [ChunkTiming(r.name, batch, statistics.mean(f), statistics.mean(b))
            for r, f, b in zip(regions, fwd, bwd, strict=True)]


def time_matmuls(device: torch.device, reps: int) -> list[MatmulSample]:
    """Square matmuls of growing size; bf16 too on CUDA (tensor cores)."""
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    out = []
    for dtype in dtypes:
        for n in MATMUL_SIZES:
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            seconds = _median_time(lambda a=a, b=b: torch.mm(a, b), device, reps)
            out.append(MatmulSample(2.0 * n ** 3, seconds, dtype != torch.float32))
    return out


def time_optimizer(spec: ModelSpec, model: torch.nn.Module, captured: Captured,
                   device: torch.device, reps: int) -> list[OptimizerSample]:
    """The model's optimizer over each region's parameter tensors, and over one flat tensor
    of the whole model's size and of half of it (what ZeRO's shards look like)."""
    named = dict(model.named_parameters())
    sets = [[named[p] for p in r.params if p in named] for r in captured.graph.regions]
    total = sum(p.numel() for p in named.values())
    flat = [[torch.nn.Parameter(torch.zeros(n, device=device))] for n in (total, total // 2)]
    out = []
    for ps in [s for s in sets if s] + flat:
        copies = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        for c in copies:
            c.grad = torch.randn_like(c)
        opt = spec.make_optimizer(copies)
        seconds = _median_time(opt.step, device, reps)
        out.append(OptimizerSample(len(copies), sum(c.numel() for c in copies), seconds))
    return out


def sharing_workload(device: torch.device) -> Callable[[], object]:
    """Small dispatch- and math-bound work, like a tiny model's chunk, for timing how much
    N ranks computing at once slow each other (`time_sharing`)."""
    x = torch.randn(64, 64, device=device)
    w = torch.randn(64, 64, device=device)

    def work() -> torch.Tensor:
        y = x
        for _ in range(20):
            y = torch.nn.functional.gelu(y @ w).add_(x).mul_(0.5)
        return y
    return work


def time_sharing(rank: int, device: torch.device, reps: int, rounds: int
                 ) -> tuple[list[float], list[float]]:
    """(seconds of the workload on rank 0 alone, on this rank with every rank at once), per
    round. cores the ranks effectively share = N x alone / together. Each timing lasts
    SHARING_S, long against the barrier's skew, so the ranks' timings overlap."""
    work = sharing_workload(device)
    alone, together = [], []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            alone.append(_median_time(work, device, reps, SHARING_S))
        dist.barrier()
        together.append(_median_time(work, device, reps, SHARING_S))
    dist.barrier()
    return alone, together


def _median_time(fn: Callable[[], object], device: torch.device, reps: int,
                 at_least_s: float = 1e-3) -> float:
    """Median seconds per call; calls are batched so each timing lasts `at_least_s`."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    batch = max(1, min(10_000, int(at_least_s / max(time.perf_counter() - t0, 1e-7))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / batch)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _now(device: torch.device) -> float:
    _sync(device)
    return time.perf_counter()
