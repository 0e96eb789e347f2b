"""Memory model: static training state per rank plus activations held between F and B.

Static bytes follow the ZeRO paper's accounting (Rajbhandari et al. 2020) for an fp32 model
with AdamW: K = 16 bytes per parameter at ZeRO-0 (value 4 + gradient 4 + two moments 8).
Over N data-parallel replicas, ZeRO-1 shards the optimizer state (4 + 4 + 8/N), ZeRO-2 also
the gradients (4 + 12/N), ZeRO-3 everything (16/N). Under bf16-mixed, ZeRO-1/2 keep the
weights in bf16 and the fp32 master with the optimizer state (2 + 4 + 12/N at ZeRO-1, as
Megatron-LM's distributed optimizer; `state_split`). ZeRO-3 adds the stage's gathered
parameters while one of its chunks runs (in units, two units: `runtime.execute.unit_gather`);
ZeRO-2/3 add a microbatch's full gradient from its backward to its reduce-scatter, or with
units whose reduce-scatters start inside the backward (`runtime.execute.zero`) at most two units
of it. Activations of a microbatch live from the start of its forward to the end of its
backward, which is what separates GPipe from 1F1B. They are what autograd saves
(`cost_models.saved`); on a recomputed stage (`piper.Recompute`) a microbatch keeps only its
regions' inputs, and a backward rebuilds one region's saved tensors at a time.
`memory_parts` tells a rank's peak apart: weights, gradients, optimizer state, activations,
temporaries and communication buffers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from cost_models.analytical import ModelCosts
from cost_models.task_costs import gathered_element_size, recompute_policy, recomputed
from piper.dag import Kind
from runtime.execute.buckets import early_reduce_scatters
from runtime.lowering.dryrun import Span
from runtime.lowering.plan import Plan

OPTIMIZER_STATE_BYTES = 8
"""AdamW's exp_avg and exp_avg_sq, fp32, per parameter."""


def bytes_per_param(costs: ModelCosts) -> int:
    """Parameter + gradient in the training dtype, optimizer state (`with_precision`)."""
    return 2 * costs.element_size + costs.optimizer_bytes


def stage_params(plan: Plan, costs: ModelCosts) -> tuple[int, ...]:
    return tuple(costs.params_of(rs) for rs in plan.stage_regions)


def zero_bytes_per_param(element_size: int, zero: int, replicas: int,
                         opt: int = OPTIMIZER_STATE_BYTES) -> float:
    """Model-state bytes per parameter per rank at a ZeRO stage (the paper's formulas)."""
    e, n = element_size, replicas
    return {0: 2 * e + opt, 1: 2 * e + opt / n, 2: e + (e + opt) / n,
            3: (2 * e + opt) / n}[zero]


def tied_copies(plan: Plan) -> tuple[tuple[int, int], ...]:
    """Per stage: (elements of tied parameters it holds, of which its own regions own).

    A tied parameter (an embedding shared with the output head) is a whole copy with its
    gradient and optimizer state on every stage of its tie group: `runtime.execute.executor` sums
    the copies apart from the stage's gradients and never ZeRO-shards them. The owner's
    elements are also in `stage_params`, at the ZeRO rate, so they are moved."""
    numel = dict(zip((p for p, _ in plan.model.tied), plan.model.tied_numel, strict=True))
    owner = {p: r.name for r in plan.model.regions for p in r.params}
    out = [[0, 0] for _ in plan.stage_regions]
    for names, stages in plan.ties:
        for s in set(stages):
            for n in names:
                out[s][0] += numel.get(n, 0)
                out[s][1] += numel.get(n, 0) if owner.get(n) in plan.stage_regions[s] else 0
    return tuple((a, b) for a, b in out)


def state_split(costs: ModelCosts, zero: int, replicas: int) -> tuple[float, float, float]:
    """Bytes per parameter per rank of (weights, gradients, optimizer state) at a ZeRO stage
    over `replicas`: the paper's (`zero_bytes_per_param`), except under bf16-mixed at ZeRO-1/2,
    where the runtime keeps Megatron-LM's distributed-optimizer layout
    (`runtime.execute.zero`): bf16 weights whole, fp32 gradients (whole at ZeRO-1) and the
    fp32 master weights sharded with the moments (2 + 4 + 12/N at ZeRO-1)."""
    e, o, n = costs.element_size, costs.optimizer_bytes, replicas
    grads = e / n if zero >= 2 else e
    low = costs.wire_element_size
    if zero in (1, 2) and 0 < low < e:
        return low, grads, (e + o) / n
    return e / n if zero >= 3 else e, grads, o / n if zero >= 1 else o


def cast_bytes(costs: ModelCosts, regions: Sequence[str], zero: int) -> int:
    """bf16-mixed at ZeRO-0: the step's one bf16 cast of the fp32 parameters that matmuls
    read (`runtime.execute.chunk_math.ChunkMath.step_casts`), held from the first forward to
    the step's end. ZeRO-1/2/3 keep their flat buffers in bf16 and cast nothing."""
    low = costs.wire_element_size
    if zero or not 0 < low < costs.element_size or not costs.cast_params:
        return 0
    return low * sum(costs.cast_params[costs.regions.index(r)] for r in regions)


def static_bytes(plan: Plan, costs: ModelCosts) -> tuple[int, ...]:
    """Per rank: parameters (and their bf16 casts), gradients and optimizer state of the
    stages it holds."""
    params = stage_params(plan, costs)
    per = sum(state_split(costs, plan.zero, plan.shard_ways))
    whole = sum(state_split(costs, 0, plan.shard_ways))
    tied = tied_copies(plan)
    return tuple(round(sum(per * (params[s] - tied[s][1]) + whole * tied[s][0]
                           + cast_bytes(costs, plan.stage_regions[s], plan.zero)
                           for s in rp.stages)) for rp in plan.ranks)


def activation_bytes(plan: Plan, costs: ModelCosts, microbatch_size: int,
                     recompute: bool | None = None) -> tuple[int, ...]:
    """Per stage: bytes one microbatch's forward keeps for its backward (on the stages
    `recomputed(plan, recompute)`: its regions' inputs)."""
    again = recomputed(plan, recompute)
    policy = recompute_policy(plan, recompute)
    return tuple(round(costs.activation_bytes_of(rs, microbatch_size, s in again and policy))
                 for s, rs in enumerate(plan.stage_regions))


def recompute_bytes(costs: ModelCosts, regions: Sequence[str], microbatch_size: int,
                    policy: str = "full") -> tuple[int, int]:
    """What recompute adds to a stage's kept inputs: the largest region its backward
    rebuilds while it runs, and what a split backward's I leaves for W (W's products, up
    to the rest of the forward's saved tensors)."""
    kept = round(costs.activation_bytes_of(regions, microbatch_size, policy))
    return (round(costs.recompute_peak_bytes_of(regions, microbatch_size, policy)),
            round(costs.activation_bytes_of(regions, microbatch_size)) - kept)


@dataclass(frozen=True)
class StageMemory:
    """Per stage, the bytes a microbatch's tasks hold and free: its kept activations (`act`),
    the largest region a recompute rebuilds (`rebuilt`, during B or I), what a split
    backward's I leaves for W (`held`), ZeRO-3's gathered parameters while a chunk runs and
    ZeRO-2/3's full gradient from a backward to its reduce-scatter. One account for the
    simulated peak (`peak_memory`) and the planner's bound from Orders
    (`planner.search.memory_bound`), so the two agree by construction."""

    act: tuple[int, ...]
    rebuilt: tuple[int, ...]
    held: tuple[int, ...]
    gathered: tuple[int, ...]
    grad_buf: tuple[int, ...]
    recompute: frozenset[int]

    @staticmethod
    def of(stage_regions: Sequence[Sequence[str]], costs: ModelCosts, microbatch_size: int,
           zero: int, recompute: Collection[int], bucket_bytes: int = 0,
           early: Collection[int] = (), paired: bool = False, policy: str = "full"
           ) -> StageMemory:
        """`early`: stages whose ZeRO-2/3 units of at most `bucket_bytes` (or one larger
        parameter) start their reduce-scatters inside the backward
        (`runtime.execute.buckets.early_reduce_scatters`): two units' gradients alive at most.
        ZeRO-3's units are gathered two at a time inside a chunk unless the schedule runs
        overlapped pairs (`paired`; `runtime.execute.unit_gather.unit_gathers`)."""
        again = frozenset(recompute)
        act = tuple(round(costs.activation_bytes_of(rs, microbatch_size,
                                                    s in again and policy))
                    for s, rs in enumerate(stage_regions))
        extra = [recompute_bytes(costs, rs, microbatch_size, policy) if s in again
                 else (0, 0) for s, rs in enumerate(stage_regions)]
        size = gathered_element_size(costs, zero)  # ZeRO-3's gathered copies, their grads
        full = tuple(size * costs.params_of(rs) for rs in stage_regions)
        # ZeRO-1/2's microbatch gradients are in the master's dtype (fp32 main gradients)
        grad_size = size if zero == 3 else costs.element_size
        none = tuple(0 for _ in full)
        gathered = full
        if zero == 3 and bucket_bytes and not paired:  # FSDP's units inside the chunk
            gathered = tuple(min(f, 2 * size * max(bucket_bytes // costs.element_size,
                                                   costs.largest_param_of(rs) or 0))
                             for f, rs in zip(full, stage_regions, strict=True))
        grad = [grad_size * costs.params_of(rs) if zero >= 2 else 0 for rs in stage_regions]
        for s in early:
            largest = costs.largest_param_of(stage_regions[s])
            if largest is not None:
                unit = max(bucket_bytes, grad_size * largest)
                grad[s] = min(grad[s], 2 * unit)
        return StageMemory(act, tuple(r for r, _ in extra), tuple(h for _, h in extra),
                           gathered if zero == 3 else none, tuple(grad), again)

    def peak(self, base: int, tasks: Iterable[tuple[Kind, int]]) -> int:
        """The highest total over `tasks` (kind, stage) run in order from `base` bytes: a
        forward allocates when it starts and a backward frees when it ends, so the
        backward's own working set is counted while it runs."""
        return self.peak_parts(base, tasks)[0]

    def peak_parts(self, base: int, tasks: Iterable[tuple[Kind, int]]
                   ) -> tuple[int, int, int, int]:
        """(peak, activations, temporaries, communication buffers) at the peak of `peak`:
        activations are what microbatches keep (and W's products), temporaries ZeRO-3's
        gathered parameters and what a recompute rebuilds, buffers a full gradient waiting
        for its reduce-scatter."""
        live = base
        best = (base, 0, 0, 0)
        for kind, st in tasks:
            at = None
            if kind is Kind.FWD:
                live += self.act[st]
                at = (live - base, self.gathered[st], 0)
            elif kind is Kind.BWD_I and st in self.recompute:  # the rebuild runs in I
                at = (live - base, self.gathered[st] + self.rebuilt[st], 0)
                live += self.held[st]
            elif kind.ends_backward:
                work = self.rebuilt[st] if kind is Kind.BWD else 0
                at = (live - base, self.gathered[st] + work, self.grad_buf[st])
                live -= self.act[st] + (self.held[st] if kind is Kind.BWD_W else 0)
            if at is not None and base + sum(at) > best[0]:
                best = (base + sum(at), *at)
        return best


@dataclass(frozen=True)
class MemoryParts:
    """One rank's bytes at its simulated peak, by what holds them."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    temporaries: int
    """ZeRO-3's gathered parameters, what a recompute rebuilds."""
    buffers: int
    """Communication buffers: a full gradient waiting for its reduce-scatter."""

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.temporaries + self.buffers)

    def line(self) -> str:
        """One line, in the unit of the total (GiB, MiB or KiB)."""
        unit, size = next((u, b) for u, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                          if self.total >= b or u == "KiB")
        return (f"weights {self.weights / size:.2f} {unit}, gradients "
                f"{self.gradients / size:.2f}, optimizer {self.optimizer / size:.2f}, "
                f"activations {self.activations / size:.2f}, temporaries "
                f"{self.temporaries / size:.2f}, communication buffers "
                f"{self.buffers / size:.2f} (total {self.total / size:.2f} {unit})")


def static_parts(plan: Plan, costs: ModelCosts) -> tuple[tuple[int, int, int], ...]:
    """Per rank: (weights, gradients, optimizer state) bytes of `static_bytes`, each sharded
    as its ZeRO stage shards it (tied copies whole)."""
    per = state_split(costs, plan.zero, plan.shard_ways)
    at_zero0 = state_split(costs, 0, plan.shard_ways)
    params, tied = stage_params(plan, costs), tied_copies(plan)
    out = []
    for rp in plan.ranks:
        sharded = sum(params[s] - tied[s][1] for s in rp.stages)
        whole = sum(tied[s][0] for s in rp.stages)
        w, g, o = (round(b * sharded + z * whole) for b, z in zip(per, at_zero0, strict=True))
        w += sum(cast_bytes(costs, plan.stage_regions[s], plan.zero) for s in rp.stages)
        out.append((w, g, o))
    return tuple(out)


def _timeline(plan: Plan, costs: ModelCosts, microbatch_size: int, spans: Iterable[Span],
              recompute: bool | None) -> tuple[StageMemory, list[list[tuple[Kind, int]]]]:
    """The plan's per-stage accounts, and per rank its (kind, stage) tasks in the order
    they ran on the simulated timeline."""
    mem = StageMemory.of(plan.stage_regions, costs, microbatch_size, plan.zero,
                         recomputed(plan, recompute), plan.bucket_bytes,
                         early_reduce_scatters(plan), plan.paired,
                         recompute_policy(plan, recompute))
    by_rank: dict[int, list[tuple[float, float, int, Span]]] = {rp.rank: [] for rp in plan.ranks}
    # ties in time (zero-length tasks) keep the executor's completion order, which is causal
    for i, s in enumerate(spans):
        by_rank[s.rank].append((s.start, s.end, i, s))
    return mem, [[(s.task.kind, s.task.stage) for _, _, _, s in sorted(by_rank[rp.rank])]
                 for rp in plan.ranks]


def peak_memory(plan: Plan, costs: ModelCosts, microbatch_size: int,
                spans: Iterable[Span], recompute: bool | None = None) -> tuple[int, ...]:
    """Per rank: the highest static + live-activation total along the simulated timeline
    (`StageMemory.peak`; under recompute: the largest region a backward rebuilds, during B
    or I; after I, W's products until W ends). `recompute` as in `activation_bytes`."""
    mem, tasks = _timeline(plan, costs, microbatch_size, spans, recompute)
    return tuple(mem.peak(base, ts)
                 for ts, base in zip(tasks, static_bytes(plan, costs), strict=True))


def memory_parts(plan: Plan, costs: ModelCosts, microbatch_size: int,
                 spans: Iterable[Span]) -> tuple[MemoryParts, ...]:
    """Per rank: `peak_memory`'s peak, by what holds the bytes (`MemoryParts`)."""
    mem, tasks = _timeline(plan, costs, microbatch_size, spans, None)
    out = []
    for ts, base, (w, g, o) in zip(tasks, static_bytes(plan, costs),
                                   static_parts(plan, costs), strict=True):
        _, act, temp, buf = mem.peak_parts(base, ts)
        # the static split rounds per part: what rounding left goes to the weights
        out.append(MemoryParts(w + base - (w + g + o), g, o, act, temp, buf))
    return tuple(out)
