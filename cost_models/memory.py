"""Memory model: static training state per rank plus activations held between F and B.

Static bytes are those of ZeRO-0 training: each parameter costs its value and its
gradient in the model dtype plus AdamW's two fp32 moments, 16 bytes for an fp32 model (the
16-psi of the ZeRO paper's accounting). Activations of a microbatch live from the start of its
forward to the end of its backward, which is what separates GPipe from 1F1B.
"""

from __future__ import annotations

from collections.abc import Iterable

from cost_models.analytical import ModelCosts
from piper.dag import Kind
from runtime.dryrun import Span
from runtime.plan import Plan

OPTIMIZER_STATE_BYTES = 8
"""AdamW's exp_avg and exp_avg_sq, fp32, per parameter."""


def bytes_per_param(costs: ModelCosts) -> int:
    """Parameter + gradient in the model dtype, optimizer state in fp32."""
    return 2 * costs.element_size + OPTIMIZER_STATE_BYTES


def stage_params(plan: Plan, costs: ModelCosts) -> tuple[int, ...]:
    return tuple(costs.params_of(rs) for rs in plan.stage_regions)


def static_bytes(plan: Plan, costs: ModelCosts) -> tuple[int, ...]:
    """Per rank: parameters, gradients and optimizer state of the stages it holds."""
    params = stage_params(plan, costs)
    per = bytes_per_param(costs)
    return tuple(per * sum(params[s] for s in rp.stages) for rp in plan.ranks)


def activation_bytes(plan: Plan, costs: ModelCosts, microbatch_size: int) -> tuple[int, ...]:
    """Per stage: bytes one microbatch's forward keeps for its backward."""
    return tuple(round(costs.activation_bytes_of(rs, microbatch_size))
                 for rs in plan.stage_regions)


def peak_memory(plan: Plan, costs: ModelCosts, microbatch_size: int,
                spans: Iterable[Span]) -> tuple[int, ...]:
    """Per rank: the highest static + live-activation total along the simulated timeline.

    A forward allocates when it starts and a backward frees when it ends, so the backward's
    own working set is counted while it runs.
    """
    static = static_bytes(plan, costs)
    act = activation_bytes(plan, costs, microbatch_size)
    by_rank: dict[int, list[tuple[float, float, int, Span]]] = {rp.rank: [] for rp in plan.ranks}
    # ties in time (zero-length tasks) keep the executor's completion order, which is causal
    for i, s in enumerate(spans):
        by_rank[s.rank].append((s.start, s.end, i, s))
    peaks = []
    for rp, base in zip(plan.ranks, static, strict=True):
        live = peak = base
        for _, _, _, s in sorted(by_rank[rp.rank]):
            if s.task.kind is Kind.FWD:
                live += act[s.task.stage]
                peak = max(peak, live)
            elif s.task.kind is Kind.BWD:
                live -= act[s.task.stage]
        peaks.append(peak)
    return tuple(peaks)
