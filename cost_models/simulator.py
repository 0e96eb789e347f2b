"""The simulator: run a Plan through the runtime's own dry-run engine with cost-model durations.

    pred = simulate(plan, model_costs(captured), load_cluster("h100-80gb"), microbatch_size=4)

The simulator is one more executor of the same Plan the Ray workers run: `runtime.lowering.dryrun`
supplies the blocking semantics (RECV waits, collectives meet), this module only prices
tasks and reads the resulting timeline. It keeps no cache of its own: the planner caches
whole evaluations by a content hash of what they depend on (`planner.search.cache`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cost_models import contention
from cost_models.analytical import ModelCosts
from cost_models.cluster import ClusterSpec
from cost_models.memory import peak_memory
from cost_models.task_costs import TaskCosts, task_costs
from piper.dag import Kind
from runtime.lowering.dryrun import Span
from runtime.lowering.plan import COMPUTE_STREAM, PAIR_STREAM, Plan, Task

MODEL_FLOPS_PER_FORWARD = 3
"""Forward + backward (2x forward): the model FLOPs MFU counts, recompute excluded."""

COMPUTE_KINDS = frozenset(k.value for k in Kind if k.is_compute)
"""Model math, what a rank's busy time counts: `Kind` values, since a set of strings is
faster to test than `Kind.is_compute` or a set of members (an Enum hashes in Python)."""


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """Seconds one logical stream of one rank spends running tasks in a step, and not.

    A RECV's span is time spent waiting for the message, so it counts as idle.
    """

    rank: int
    stream: str
    busy_s: float
    idle_s: float


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted figures of one training step of a Plan on a cluster."""

    step_time_s: float
    peak_memory_bytes: tuple[int, ...]
    """Per rank."""
    tokens_per_s: float
    mfu: float
    """Model FLOPs per second over the cluster's peak (`ClusterSpec.flops` x world size)."""
    busy_s: tuple[float, ...]
    """Per rank: seconds its compute stream runs model math (F, B, I, W, U)."""
    idle_s: tuple[float, ...]
    """Per rank: the rest of the step — the rank's pipeline bubble, comm waits included."""
    bubble_fraction: float
    """Mean over ranks of idle / step time."""
    streams: tuple[StreamUsage, ...]
    """Per rank and logical stream, in plan order."""
    spans: tuple[Span, ...]
    ranks: tuple[int, ...] = ()
    """The logical ranks the per-rank tuples describe (a simulation view keeps one data-
    parallel replica of each kind: `TrainingDAG.kept`)."""

    @property
    def max_memory_bytes(self) -> int:
        return max(self.peak_memory_bytes, default=0)


def simulate(plan: Plan, costs: ModelCosts, cluster: ClusterSpec, microbatch_size: int, *,
             durations: TaskCosts | None = None) -> Prediction:
    """Predict one step of `plan`; `durations` replaces the analytical task costs if given."""
    tc = durations or task_costs(plan, costs, cluster, microbatch_size)
    spans = tuple(contention.timeline(plan, per_shape(tc.duration), per_shape(tc.transfer),
                                      cluster))
    step = max((s.end for s in spans), default=0.0)
    samples = microbatch_size * plan.microbatches * plan.dp
    model_flops = MODEL_FLOPS_PER_FORWARD * costs.forward_flops_per_sample * samples
    if step > 0:
        tokens_per_s = samples * costs.tokens_per_sample / step
        # against the peak of the model's own precision (a bf16 model's is the bf16 peak)
        peak = cluster.peak_flops(low_precision=costs.element_size < 4
                                  or costs.precision != "fp32")
        mfu = model_flops / (step * plan.world_size * peak)
    else:  # nothing costs time (e.g. a zero-cost model): report no rate rather than infinity
        tokens_per_s = mfu = 0.0
    busy, streams = usage(plan, spans, step)
    return Prediction(
        step_time_s=step,
        peak_memory_bytes=peak_memory(plan, costs, microbatch_size, spans),
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        busy_s=busy,
        idle_s=tuple(step - b for b in busy),
        bubble_fraction=_bubble(busy, step),
        streams=streams,
        spans=spans,
        ranks=tuple(rp.rank for rp in plan.ranks),
    )


def per_shape(price: Callable[[int, Task], float]) -> Callable[[int, Task], float]:
    """`price`, asked once per task shape rather than once per task.

    A Plan repeats each stage's work once per microbatch, and microbatches are equal, so a
    price may depend on the rank and on what the task does (kind, stage, group, tensors,
    direction, peer) but not on which microbatch it serves: a step of m microbatches has
    about m times fewer prices to compute than tasks.
    """
    memo: dict[tuple, float] = {}

    def priced(rank: int, task: Task) -> float:
        # `_value_`, not the member: an Enum hashes in Python, a str in C
        key = (rank, task.kind._value_, task.stage, task.group, task.values, task.grad,
               task.peer)
        seconds = memo.get(key)
        if seconds is None:
            seconds = memo[key] = price(rank, task)
        return seconds
    return priced


def usage(plan: Plan, spans: Iterable[Span], step_time: float
          ) -> tuple[tuple[float, ...], tuple[StreamUsage, ...]]:
    """Per rank: seconds of model math on its compute lanes (the time any of them runs some,
    with overlapped pairs); per (rank, stream): busy/idle."""
    index = {rp.rank: i for i, rp in enumerate(plan.ranks)}
    math = [0.0] * len(plan.ranks)
    busy = {(rp.rank, s): 0.0 for rp in plan.ranks for s, _ in rp.streams}
    paired: set[int] = set()  # ranks with math on a pair lane
    recv = Kind.RECV
    for s in spans:
        kind = s.task.kind
        if kind is recv:
            continue
        took = s.end - s.start
        busy[(s.rank, s.stream)] += took
        if kind._value_ in COMPUTE_KINDS and s.stream == COMPUTE_STREAM:
            math[index[s.rank]] += took
        elif kind._value_ in COMPUTE_KINDS and s.stream == PAIR_STREAM:
            paired.add(s.rank)
    for rank in paired:  # two lanes may run math at once: count the union of their spans
        math[index[rank]] = _union([(s.start, s.end) for s in spans if s.rank == rank
                                    and s.task.kind._value_ in COMPUTE_KINDS
                                    and s.stream in (COMPUTE_STREAM, PAIR_STREAM)])
    return tuple(math), tuple(StreamUsage(r, s, b, step_time - b) for (r, s), b in busy.items())


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def bubble_fraction(plan: Plan, spans: Iterable[Span], step_time: float) -> float:
    """Mean over ranks of 1 - (F/B/I/W/U busy time on the compute stream) / step time.

    Waiting on a RECV or a collective counts as bubble: the device does no model math then.
    """
    return _bubble(usage(plan, spans, step_time)[0], step_time)


def _bubble(busy: tuple[float, ...], step_time: float) -> float:
    if step_time <= 0 or not busy:
        return 0.0
    return sum(1 - b / step_time for b in busy) / len(busy)


def predicted_json(pred: Prediction) -> dict:
    """The `"predicted"` object of the CLI's --json output."""
    return {
        "step_time_s": pred.step_time_s,
        "peak_memory_bytes": list(pred.peak_memory_bytes),
        # the logical ranks those peaks are of: one data-parallel replica of each kind
        "ranks": list(pred.ranks),
        "tokens_per_s": pred.tokens_per_s,
        "mfu": pred.mfu,
    }
