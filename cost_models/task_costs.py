"""Task durations of a Plan: what each task of each rank costs on a cluster.

`task_costs` turns a model's analytical figures (`cost_models.analytical.ModelCosts`) and a
`ClusterSpec` into the `duration` and `transfer` callables `runtime.lowering.dryrun.dry_run` runs a
Plan with: chunks op by op, optimizer steps per parameter tensor and by the bytes AdamW
streams, collectives by `cost_models.comm`, ZeRO-3's units gathered inside their chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cost_models import comm
from cost_models.analytical import UPDATE_BYTES_PER_PARAM, ModelCosts
from cost_models.cluster import ClusterSpec
from piper.dag import Kind
from runtime.execute.buckets import early_reduce_scatters, early_stages
from runtime.execute.unit_gather import unit_gathers
from runtime.lowering.mesh import Mesh
from runtime.lowering.plan import Plan, Task


@dataclass(frozen=True, kw_only=True)
class TaskCosts:
    """Seconds per task of a Plan: per-stage compute times plus the cluster for comms.

    Built by `task_costs` from analytical figures; a profiler can build one from measured
    per-stage times instead and hand it to the simulator unchanged.
    """

    cluster: ClusterSpec
    forward_s: tuple[float, ...]
    """Per stage, one microbatch."""
    backward_s: tuple[float, ...]
    update_s: tuple[float, ...]
    gradient_bytes: tuple[int, ...]
    """Per stage: what its ALL_REDUCE moves."""
    value_bytes: tuple[tuple[str, int], ...]
    """FX value name -> bytes of that tensor at the microbatch size."""
    gather_bytes: tuple[int, ...] = ()
    """Per stage: what a ZeRO parameter all-gather moves (empty: `gradient_bytes`)."""
    recompute_s: tuple[float, ...] = ()
    """Per stage, the part of `backward_s` that re-runs the forward (`piper.Recompute`);
    empty: none. It belongs to I when the backward is split, W needs no activations."""
    bucket_bytes: int = 0
    """Bucket cap of the data-parallel collectives (`Plan.bucket_bytes`): all-reduce
    buckets, or ZeRO's units; 0: one collective per stage."""
    early_buckets: frozenset[int] = frozenset()
    """Stages whose all-reduce buckets (inside their last backward) or ZeRO-2/3 unit
    reduce-scatters (inside every backward) start early (`runtime.execute.buckets`)."""
    units: tuple[int, ...] = ()
    """Per stage, the ZeRO-3 units its chunks gather one by one (`runtime.execute.unit_gather`):
    the ALL_GATHER before a chunk brings the first, the chunk the others, each one ahead
    of the ops that read it; 0 or 1: the ALL_GATHER brings the stage whole."""
    unit_groups: tuple[tuple[int, ...], ...] = ()
    """Per stage, the data-parallel group those gathers run over (as its ALL_GATHER's)."""
    gather_under_forward: bool = False
    """ZeRO-1/2's parameter all-gather after the update runs in buckets under the next
    step's first forward of its stage (Megatron-LM's --overlap-param-gather: the first
    bucket is dispatched at the forward's first use, each later one when the bucket
    before arrives, `finish_param_sync`); priced as the part of it that forward waits for
    (`_gathered_under_forward`). False: the step ends with it, as piper's runtime runs it."""
    mesh: Mesh | None = None
    """Set under context parallelism: a replicas' collective runs over the context-parallel
    ranks of each replica too (`Mesh.dp_lift`), a larger group than its task names."""
    _bytes: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bytes", dict(self.value_bytes))

    def duration(self, rank: int, task: Task) -> float:
        """Busy time of `task` on `rank`'s stream."""
        k = task.kind
        if k.is_compute:
            busy = self._compute(task) * self.cluster.runtime_compute_factor
            return (busy * (1 + self._gather_contention(task, busy))
                    + self._exposed_gathers(task, busy) + self.cluster.task_overhead_s)
        if k is Kind.SEND:
            # isend: the sender posts it and moves on; the wire time is `transfer`
            return self.cluster.send_overhead_s + self.cluster.task_overhead_s
        if k is Kind.RECV:  # dry_run adds the wait until arrival
            return self.cluster.task_overhead_s
        kind = _COLLECTIVE.get(k)
        if k is Kind.ALL_GATHER and task.mb < 0 and self.gather_under_forward:
            return self._gathered_under_forward(task) + self.cluster.task_overhead_s
        if k is Kind.ALL_GATHER and self._units(task.stage) > 1:  # the chunk's first unit
            return self._unit_gather(task.stage, task.group) + self.cluster.task_overhead_s
        if kind is not None and self.bucket_bytes and not task.values:
            return self._bucketed(task, kind) + self.cluster.task_overhead_s
        if kind is not None:  # ZeRO gathers parameters and scatters gradients of full size
            return comm.collective_time(kind, self._bytes_of(task), self._over(task.group),
                                        self.cluster) + self.cluster.task_overhead_s
        raise NotImplementedError(f"no cost model for task kind {k.name} ({task.name})")

    def _over(self, group: tuple[int, ...]) -> tuple[int, ...]:
        """The processes a collective of logical-rank `group` runs over."""
        return group if self.mesh is None else self.mesh.dp_lift(group, 0)

    def _units(self, stage: int) -> int:
        return self.units[stage] if self.units else 0

    def _unit_gather(self, stage: int, group: tuple[int, ...]) -> float:
        """One unit's all-gather (the stage's gathered bytes split evenly)."""
        nbytes = (self.gather_bytes or self.gradient_bytes)[stage] / self._units(stage)
        return comm.collective_time(comm.ALL_GATHER, round(nbytes), self._over(group),
                                    self.cluster)

    def _exposed_gathers(self, task: Task, busy: float) -> float:
        """What a chunk waits for its units' gathers inside it: unit j + 1's starts when
        unit j's ops do, so each of the n - 1 shows past its 1/n of the chunk's compute.
        W reads no parameters (I kept what it multiplies)."""
        n = self._units(task.stage)
        if n < 2 or task.kind not in (Kind.FWD, Kind.BWD, Kind.BWD_I):
            return 0.0
        gather = self._unit_gather(task.stage, self.unit_groups[task.stage])
        return (n - 1) * max(0.0, gather - busy / n)

    def _gather_contention(self, task: Task, busy: float) -> float:
        """Share by which a chunk slows while its own units' gathers run inside it (they
        are not spans of their own, so `cost_models.contention` cannot see them): NVLink's
        or the network's contention over the share of the chunk they cover."""
        n = self._units(task.stage)
        if n < 2 or busy <= 0 or task.kind not in (Kind.FWD, Kind.BWD, Kind.BWD_I):
            return 0.0
        group = self.unit_groups[task.stage]
        c = comm.contention(self.cluster, group)
        hidden = (n - 1) * min(self._unit_gather(task.stage, group), busy / n)
        return c * min(1.0, hidden / busy)

    def _gathered_under_forward(self, task: Task) -> float:
        """What the next step's first forward of the stage waits for its parameters when
        their gather runs under it, bucket j + 1's once bucket j's arrived (one ahead, as
        FSDP's units): the first bucket's, what each later one has left past the forward
        of the bucket before (buckets cover the forward in proportion to their bytes), and
        the forward slowed by the cluster's comm/compute contention while they run."""
        sizes = self._bucket_sizes(self._bytes_of(task))
        group = self._over(task.group)
        times = [comm.collective_time(comm.ALL_GATHER, n, group, self.cluster) for n in sizes]
        total = sum(sizes)
        forward = self.forward_s[task.stage] * self.cluster.runtime_compute_factor
        covers = [forward * n / total if total else 0.0 for n in sizes]
        later = list(zip(times[1:], covers[:-1], strict=True))  # bucket j + 1 under j's
        exposed = times[0] + sum(max(0.0, t - c) for t, c in later)
        hidden = sum(min(t, c) for t, c in later)
        return exposed + comm.contention(self.cluster, group) * hidden

    def _bucket_sizes(self, total: int) -> list[int]:
        """`total` bytes in buckets of `bucket_bytes` (the last one what is left), or one."""
        if not self.bucket_bytes:
            return [total]
        sizes = [self.bucket_bytes] * (total // self.bucket_bytes)
        if total % self.bucket_bytes or not sizes:
            sizes.append(total % self.bucket_bytes)
        return sizes

    def _bytes_of(self, task: Task) -> int:
        """What a stage's collective moves: parameters (a gather) or gradients."""
        if task.kind is Kind.ALL_GATHER and self.gather_bytes:
            return self.gather_bytes[task.stage]
        return self.gradient_bytes[task.stage]

    def _bucketed(self, task: Task, kind: str) -> float:
        """A bucketed collective (all-reduce buckets, or ZeRO's units): one per bucket,
        back to back. A gradient collective started early has bucket j's gradients final
        once backward has covered its share of the bytes (backward finishes the parameters
        in reverse, about evenly); the task is what is left after that backward ends (at
        least the last bucket)."""
        total = self._bytes_of(task)
        sizes = self._bucket_sizes(total)
        group = self._over(task.group)
        each = {n: comm.collective_time(kind, n, group, self.cluster) for n in set(sizes)}
        times = [each[n] for n in sizes]
        if (task.stage not in self.early_buckets or total == 0
                or task.kind is Kind.ALL_GATHER):
            return sum(times)
        back = self.backward_s[task.stage] * self.cluster.runtime_compute_factor
        end, done = 0.0, 0
        for n, t in zip(sizes, times, strict=True):
            done += n
            end = max(end, back * done / total) + t
        return end - back

    def _compute(self, task: Task) -> float:
        k = task.kind
        if k is Kind.FWD:
            return self.forward_s[task.stage]
        if k is Kind.BWD:
            return self.backward_s[task.stage]
        if k in (Kind.BWD_I, Kind.BWD_W):  # each about one forward's matmuls
            again = self.recompute_s[task.stage] if self.recompute_s else 0.0
            half = (self.backward_s[task.stage] - again) / 2
            return half + again if k is Kind.BWD_I else half
        return self.update_s[task.stage]

    def transfer(self, rank: int, task: Task) -> float:
        """Wire time of a SEND from `rank` to `task.peer`: alpha + bytes / beta."""
        nbytes = sum(self._bytes[v] for v in task.values)
        return comm.p2p_message_time(self.cluster, rank, task.peer, nbytes)


_COLLECTIVE = {Kind.ALL_REDUCE: comm.ALL_REDUCE, Kind.ALL_GATHER: comm.ALL_GATHER,
               Kind.REDUCE_SCATTER: comm.REDUCE_SCATTER}


def recomputed(plan: Plan, recompute: bool | None = None) -> frozenset[int]:
    """Stages whose backward repeats (part of) their forward: the Plan's
    (`piper.Recompute`), or with `recompute` True/False every stage/none (what-if figures,
    full recompute)."""
    if recompute is None:
        return frozenset(plan.recompute)
    return frozenset(range(len(plan.stage_regions))) if recompute else frozenset()


def recompute_policy(plan: Plan, recompute: bool | None = None) -> str:
    """The policy of the stages `recomputed` names: the Plan's, or full for what-ifs."""
    return plan.recompute_policy if recompute is None else "full"


def _wire_bytes(v: Any, costs: ModelCosts) -> float:
    """A value's bytes as it travels: floating ones in the training precision."""
    size = torch.empty((), dtype=getattr(torch, v.dtype)).element_size()
    if costs.wire_element_size and getattr(torch, v.dtype).is_floating_point:
        return v.nbytes * costs.wire_element_size / size
    return v.nbytes


def gathered_element_size(costs: ModelCosts, zero: int) -> int:
    """Bytes per element of parameters ZeRO gathers: under bf16 training bf16 copies of the
    fp32 shards (FSDP2's `param_dtype` at ZeRO-3; at ZeRO-1/2 the bf16 weights Megatron's
    distributed optimizer gathers after its update); otherwise the parameters'."""
    return (costs.wire_element_size or costs.element_size) if zero else costs.element_size


def task_costs(plan: Plan, costs: ModelCosts, cluster: ClusterSpec,
               microbatch_size: int, *, recompute: bool | None = None) -> TaskCosts:
    """Analytical TaskCosts: chunks op by op (`ModelCosts.chunk_seconds`); updates per
    parameter tensor plus the bytes AdamW streams over memory bandwidth. On recomputed
    stages (`recomputed`) each backward first repeats its forward, or under a selective
    policy the ops it recomputes (`ModelCosts.recompute_seconds`)."""
    chunks = [costs.chunk_seconds(rs, microbatch_size, cluster) for rs in plan.stage_regions]
    fwd = tuple(f for f, _ in chunks)
    again = recomputed(plan, recompute)
    policy = recompute_policy(plan, recompute)
    rec = tuple((f if policy == "full" else costs.recompute_seconds(
        rs, microbatch_size, cluster, policy)) if s in again else 0.0
        for s, ((f, _), rs) in enumerate(zip(chunks, plan.stage_regions, strict=True)))
    bwd = tuple(b + r for (_, b), r in zip(chunks, rec, strict=True))
    params = tuple(costs.params_of(rs) for rs in plan.stage_regions)
    shards = plan.shard_ways if plan.zero else 1  # ZeRO ranks update only their shard
    # ZeRO's optimizer sees one flat shard per stage, plain DP every parameter tensor
    tensors = tuple((1 if p else 0) if plan.zero else costs.param_tensors_of(rs)
                    for p, rs in zip(params, plan.stage_regions, strict=True))
    per_tensor = cluster.optimizer_tensor_overhead_s
    bw = cluster.memory_bandwidth
    update = tuple(n * per_tensor + (UPDATE_BYTES_PER_PARAM * p / shards / bw if bw else 0.0)
                   for n, p in zip(tensors, params, strict=True))
    scale = microbatch_size / plan.model.batch
    units, groups = zero3_units(plan, costs, params)
    return TaskCosts(
        cluster=cluster,
        forward_s=fwd,
        backward_s=bwd,
        update_s=update,
        gradient_bytes=tuple((costs.grad_element_size or costs.element_size) * p
                             for p in params),
        value_bytes=tuple((v.name, round(_wire_bytes(v, costs) * scale))
                          for v in plan.model.values),
        gather_bytes=tuple(gathered_element_size(costs, plan.zero) * p for p in params),
        recompute_s=rec if again else (),
        bucket_bytes=plan.bucket_bytes,
        early_buckets=early_stages(plan) | early_reduce_scatters(plan),
        units=units,
        unit_groups=groups,
        mesh=plan.mesh if plan.sharding.cp > 1 else None,
    )


def zero3_units(plan: Plan, costs: ModelCosts, params: Sequence[int]
                ) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Per stage, how many ZeRO-3 units `runtime.execute.zero` makes of its parameters (units of at
    most `plan.bucket_bytes` of parameter bytes) and the group an ALL_GATHER of it uses;
    empty where the plan gathers stages whole (`runtime.execute.unit_gather.unit_gathers`)."""
    if not unit_gathers(plan):
        return (), ()
    groups: dict[int, tuple[int, ...]] = {}
    for rp in plan.ranks:
        for t in rp.tasks:
            if t.kind is Kind.ALL_GATHER:
                groups.setdefault(t.stage, t.group)
    units = tuple(math.ceil(costs.element_size * p / plan.bucket_bytes) for p in params)
    return units, tuple(groups.get(s, ()) for s in range(len(params)))
