"""Gradient buckets: one stage's data-parallel all-reduce as several smaller ones, started
while the backward that finishes the gradients still runs (DDP's bucketing).

Buckets take the parameters in reverse order (backward finishes the last layers' gradients
first) up to a byte cap; a parameter larger than the cap is a bucket of its own. Armed for
the stage's last backward of the step, a post-accumulate-grad hook counts each parameter's
final gradient; a bucket whose gradients are all final is flattened and all-reduced
asynchronously, in bucket order (every replica must issue the group's collectives in one
order). `finish` starts what backward did not (unused parameters, or not armed at all),
waits, and puts the summed gradients back. ZeRO-2/3 with a cap shards the stage in units
of the same buckets (`runtime.execute.zero`), whose reduce-scatters start the same way, inside every
backward (`early_reduce_scatters`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from piper.dag import Kind
from runtime.lowering.plan import COMPUTE_STREAM, PAIR_STREAM, Plan


def bucket_indices(nbytes: list[int], cap: int) -> list[list[int]]:
    """Parameter indices per bucket: reverse order, each bucket at most `cap` bytes (or one
    parameter)."""
    out: list[list[int]] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        if out and size + nbytes[i] <= cap:
            out[-1].append(i)
            size += nbytes[i]
        else:
            out.append([i])
            size = nbytes[i]
    return out


def bucketed(plan: Plan) -> bool:
    """Whether `plan`'s stage all-reduces run in buckets (ZeRO-0 replicas with a cap)."""
    return bool(plan.bucket_bytes) and not plan.zero and plan.dp > 1


def early_stages(plan: Plan) -> frozenset[int]:
    """Stages whose buckets start inside their last backward: bucketed, the all-reduce on
    the compute stream (the hooks fire on that thread, so the group's collectives keep one
    order on every replica), the backward not split (W, not autograd, makes the weight
    gradients) and never on the pair lane (another thread)."""
    if not bucketed(plan):
        return frozenset()
    other = {t.stage for rp in plan.ranks for t in rp.tasks if t.kind is Kind.BWD_I} | {
        t.stage for rp in plan.ranks for t in rp.stream(PAIR_STREAM)}
    return frozenset(t.stage for rp in plan.ranks for t in rp.stream(COMPUTE_STREAM)
                     if t.kind is Kind.ALL_REDUCE and not t.values and t.stage not in other)


def early_reduce_scatters(plan: Plan) -> frozenset[int]:
    """ZeRO-2/3 stages whose units' reduce-scatters start inside every backward
    (`runtime.execute.zero`): units (a bucket cap) over dp > 1 replicas, every data-parallel
    collective of the plan on the compute stream (the hooks fire on that thread, so each
    group's collectives keep one order on every replica), no overlapped pairs (a second
    lane) and the backward not split. `planner.search.memory_bound.early_reduce_scatter_stages`
    reads the same from a Program's directives."""
    if not plan.bucket_bytes or plan.zero < 2 or plan.dp == 1 or plan.paired:
        return frozenset()
    if any(name != COMPUTE_STREAM and any(t.kind.is_collective and not t.values for t in ts)
           for rp in plan.ranks for name, ts in rp.streams):
        return frozenset()
    tasks = [t for rp in plan.ranks for t in rp.tasks]
    split = {t.stage for t in tasks if t.kind is Kind.BWD_I}
    return frozenset(t.stage for t in tasks if t.kind is Kind.REDUCE_SCATTER) - split


class GradBuckets:
    """The bucketed all-reduce of one stage's gradients over its data-parallel group."""

    def __init__(self, params: list[torch.nn.Parameter], cap: int, group: Any,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.params, self.group, self.reduce_dtype = params, group, reduce_dtype
        self.buckets = bucket_indices([p.numel() * p.element_size() for p in params], cap)
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._missing: list[int] = []
        self._handles: list[Any] = []
        self._works: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []

    def arm(self) -> None:
        """Start buckets from the coming backward as their gradients become final."""
        self._missing = [len(idx) for idx in self.buckets]
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, p in enumerate(self.params)]

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, i: int) -> Any:
        def ready(_p: torch.Tensor) -> None:
            self._missing[self._bucket_of[i]] -= 1
            while (len(self._works) < len(self.buckets)
                   and self._missing[len(self._works)] == 0):
                self._start(len(self._works))
        return ready

    def _start(self, b: int) -> None:
        ps = [self.params[i] for i in self.buckets[b]]
        gs = [p.grad if p.grad is not None else torch.zeros_like(p) for p in ps]
        flat = on_wire(_flatten_dense_tensors(gs), self.reduce_dtype)
        self._works.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, gs))

    def finish(self) -> list[torch.Tensor]:
        """Start the remaining buckets, wait for all, set each parameter's `.grad` to the
        sum; returns the gradients (a CUDA caller keeps them for its streams)."""
        self.disarm()
        while len(self._works) < len(self.buckets):
            self._start(len(self._works))
        out = []
        for b, (work, flat, gs) in enumerate(self._works):
            work.wait()
            flat = flat.to(gs[0].dtype)
            for i, g in zip(self.buckets[b], _unflatten_dense_tensors(flat, gs), strict=True):
                self.params[i].grad = g
                out.append(g)
        self._works = []
        return out


def on_wire(flat: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A flat gradient as it is reduced: in `dtype` (`--reduce-dtype`), or as it is."""
    if dtype is None or not flat.is_floating_point() or flat.dtype == dtype:
        return flat
    return flat.to(dtype)


def reduce_grads(params: list[torch.nn.Parameter], group: Any,
                 dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Sum `params`' gradients over `group` in one flat all-reduce (a parameter without a
    gradient contributes zeros); returns the gradients it read (a CUDA caller keeps them)."""
    gs = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(gs)
    wire = on_wire(flat, dtype)
    dist.all_reduce(wire, group=group)
    for p, g in zip(params, _unflatten_dense_tensors(wire.to(flat.dtype), gs), strict=True):
        p.grad = g
    return gs


def stage_buckets(plan: Plan, rank_tasks: Any, compute: tuple, params: dict[int, list],
                  group_of: Any, dtype: torch.dtype | None = None
                  ) -> tuple[dict[int, GradBuckets], set[tuple[int, int]]]:
    """Per stage with a bucketed all-reduce (`Replicate(bucket_mb=...)`), its buckets; and
    the backward tasks (stage, mb) that start them early (`early_stages`): the stage's last
    B before its AR. `group_of(task)`: the process group of an all-reduce task."""
    out: dict[int, GradBuckets] = {}
    arm: set[tuple[int, int]] = set()
    if not bucketed(plan):
        return out, arm
    early = early_stages(plan)
    for t in rank_tasks:
        if t.kind is Kind.ALL_REDUCE and not t.values and params.get(t.stage):
            out[t.stage] = GradBuckets(params[t.stage], plan.bucket_bytes, group_of(t), dtype)
            if t.stage in early:
                last = [b for b in compute[:compute.index(t)]
                        if b.kind is Kind.BWD and b.stage == t.stage]
                arm.add((t.stage, last[-1].mb))
    return out, arm
