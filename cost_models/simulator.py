"""The simulator: run a Plan through the runtime's own dry-run engine with cost-model durations.

    pred = simulate(plan, model_costs(captured), load_cluster("h100-80gb"), microbatch_size=4)

The simulator is one more executor of the same Plan the Ray workers run: `runtime.dryrun`
supplies the blocking semantics (RECV waits, collectives meet), this module only prices
tasks and reads the resulting timeline. Results are cached by (plan, costs, cluster,
microbatch size), all frozen values, so a search that revisits a strategy pays once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cost_models.analytical import ModelCosts, TaskCosts, task_costs
from cost_models.cluster import ClusterSpec
from cost_models.memory import peak_memory
from runtime.dryrun import Span, dry_run
from runtime.plan import COMPUTE_STREAM, Plan

MODEL_FLOPS_PER_FORWARD = 3
"""Forward + backward (2x forward): the model FLOPs MFU counts, recompute excluded."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted figures of one training step of a Plan on a cluster."""

    step_time_s: float
    peak_memory_bytes: tuple[int, ...]
    """Per rank."""
    tokens_per_s: float
    mfu: float
    """Model FLOPs per second over the cluster's peak (`ClusterSpec.flops` x world size)."""
    bubble_fraction: float
    """Mean over ranks of the step's share the compute stream spends not computing."""
    spans: tuple[Span, ...]

    @property
    def max_memory_bytes(self) -> int:
        return max(self.peak_memory_bytes, default=0)


def simulate(plan: Plan, costs: ModelCosts, cluster: ClusterSpec, microbatch_size: int, *,
             durations: TaskCosts | None = None) -> Prediction:
    """Predict one step of `plan`; `durations` replaces the analytical task costs if given."""
    key = (plan, costs, cluster, microbatch_size, durations)
    try:
        hash(key)
    except TypeError:  # a Plan that grew an unhashable field still simulates, uncached
        return _simulate(*key)
    return _cached(*key)


# Small: a Prediction keeps its whole timeline, and a search mostly revisits recent strategies.
@functools.lru_cache(maxsize=64)
def _cached(plan: Plan, costs: ModelCosts, cluster: ClusterSpec, microbatch_size: int,
            durations: TaskCosts | None) -> Prediction:
    return _simulate(plan, costs, cluster, microbatch_size, durations)


def _simulate(plan: Plan, costs: ModelCosts, cluster: ClusterSpec, microbatch_size: int,
              durations: TaskCosts | None) -> Prediction:
    tc = durations or task_costs(plan, costs, cluster, microbatch_size)
    spans = tuple(dry_run(plan, tc.duration, tc.transfer))
    step = max((s.end for s in spans), default=0.0)
    samples = microbatch_size * plan.microbatches * plan.dp
    model_flops = MODEL_FLOPS_PER_FORWARD * costs.forward_flops_per_sample * samples
    if step > 0:
        tokens_per_s = samples * costs.tokens_per_sample / step
        mfu = model_flops / (step * plan.world_size * cluster.flops)
    else:  # nothing costs time (e.g. a zero-cost model): report no rate rather than infinity
        tokens_per_s = mfu = 0.0
    return Prediction(
        step_time_s=step,
        peak_memory_bytes=peak_memory(plan, costs, microbatch_size, spans),
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        bubble_fraction=bubble_fraction(plan, spans, step),
        spans=spans,
    )


def bubble_fraction(plan: Plan, spans: tuple[Span, ...], step_time: float) -> float:
    """Mean over ranks of 1 - (F/B/U busy time on the compute stream) / step time.

    Waiting on a RECV or a collective counts as bubble: the device does no model math then.
    """
    if step_time <= 0 or not plan.ranks:
        return 0.0
    busy = {rp.rank: 0.0 for rp in plan.ranks}
    for s in spans:
        if s.stream == COMPUTE_STREAM and s.task.kind.is_compute:
            busy[s.rank] += s.end - s.start
    return sum(1 - b / step_time for b in busy.values()) / len(busy)


def predicted_json(pred: Prediction) -> dict:
    """The `"predicted"` object of the CLI's --json output."""
    return {
        "step_time_s": pred.step_time_s,
        "peak_memory_bytes": list(pred.peak_memory_bytes),
        "tokens_per_s": pred.tokens_per_s,
        "mfu": pred.mfu,
    }
