"""Score a Program without running it: capture once, then apply, schedule and simulate."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from cost_models import ClusterSpec, ModelCosts, Prediction, model_costs, simulate
from piper.capture import Captured, capture
from piper.dag import TrainingDAG, single_device_dag
from piper.model_file import ModelSpec
from piper.program import Program
from runtime.launcher import apply_for, program_microbatch_size
from runtime.plan import Plan
from runtime.scheduler import schedule

CAPTURE_BATCH = 1  # costs scale linearly with samples, so one capture serves every microbatch


@dataclass(frozen=True)
class Evaluation:
    program: Program
    plan: Plan
    prediction: Prediction
    microbatch_size: int

    @property
    def summary(self) -> dict[str, Any]:
        return self.program.summary()


@dataclass
class Evaluator:
    """Everything that does not depend on the strategy, computed once per search."""

    spec: ModelSpec
    gpus: int
    batch_size: int
    cluster: ClusterSpec

    @cached_property
    def captured(self) -> Captured:
        return capture(self.spec, CAPTURE_BATCH)

    @cached_property
    def costs(self) -> ModelCosts:
        return model_costs(self.captured)

    @cached_property
    def dag(self) -> TrainingDAG:
        return single_device_dag(self.captured.graph)

    def region_costs(self) -> tuple[float, ...]:
        return tuple(float(self.costs.forward_flops_of([r], 1)) or 1.0
                     for r in self.captured.graph.names)

    def evaluate(self, program: Program) -> Evaluation:
        mb = program_microbatch_size(program, self.batch_size)
        plan = schedule(apply_for(program, self.dag, self.gpus))
        return Evaluation(program, plan, simulate(plan, self.costs, self.cluster, mb), mb)
