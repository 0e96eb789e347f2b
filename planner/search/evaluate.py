"""Score a Program without running it: capture once, then apply, schedule and simulate."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from cost_models import ClusterSpec, ModelCosts, Prediction, simulate
from cost_models.analytical import with_precision
from cost_models.memory import MemoryParts, memory_parts
from cost_models.sharded import InGraphComm, with_expert_skew, with_in_graph_comm
from cost_models.task_costs import task_costs
from piper.capture import ModelGraph
from piper.dag import TrainingDAG, single_device_dag
from piper.directives import (
    Order,
    Place,
    Recompute,
    Replicate,
    Shard,
    ShardSequence,
    ShardTensor,
    Split,
    SplitBackward,
    Stream,
)
from piper.errors import PiperError
from piper.loading import load_model
from piper.model_file import ModelSpec
from piper.program import Program
from piper.sharding import ModelSharding
from planner.search.cache import EvaluationCache, evaluation_key
from planner.search.memory_bound import device_peaks, early_reduce_scatter_stages
from planner.search.repeats import PlanningCapture, planning_capture
from planner.search.replicas import representative_replicas
from runtime.execute.rank_stages import align
from runtime.lowering.lower import apply_for, program_microbatch_size, split_failure
from runtime.lowering.mesh import Mesh
from runtime.lowering.plan import Plan
from runtime.lowering.scheduler import schedule
from search_spaces.base import Infeasible

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
    cache: EvaluationCache[Evaluation] = field(default_factory=EvaluationCache)
    """Shared between evaluators to reuse results across clusters or searches: keys say
    everything a result depends on."""
    precision: str = "fp32"
    """What the strategies will train in (`piper-plan run --precision`)."""
    tp_overlap: bool = False
    """Price tensor-parallel collectives as overlapped with the GEMMs (Megatron's
    --tp-comm-overlap; `cost_models.sharded.overlapped`): for published runs that used it
    and what-ifs; piper's runtime runs them in line, so the planner leaves this off."""
    ep_overlap: bool = False
    """Price expert all-to-alls as hidden behind another microbatch's math (Megatron's
    --overlap-moe-expert-parallel-comm): for published runs that used it; piper's runtime
    runs them in line."""
    param_gather_overlap: bool = False
    """Price ZeRO-1/2's parameter all-gather of a plan whose gradient collectives overlap
    the backward as run under the next step's forward (Megatron's --overlap-param-gather,
    `TaskCosts.gather_under_forward`); piper's runtime gathers at the end of the step."""
    expert_skew: float = 1.0
    """The busiest rank's share of routed rows over the mean (`--expert-skew`): 1 prices a
    perfectly balanced router; a measured router's max/mean load prices its imbalance
    (`cost_models.sharded.with_expert_skew`)."""
    fold: bool = True
    """Trace two copies of each repeated layer and grow the rest (`planner.search.repeats`): the
    same graph and costs, a fraction of the capture time."""
    _sharded: dict[ModelSharding, tuple[ModelCosts, InGraphComm, dict[str, float]]] = field(
        default_factory=dict, repr=False)
    _stage_cuts: dict[tuple, tuple[list, list]] = field(default_factory=dict, repr=False)
    _shardings: dict[tuple, ModelSharding] = field(default_factory=dict, repr=False)
    _last_plan: tuple[Program, Plan] | None = field(default=None, repr=False)

    @cached_property
    def captured(self) -> PlanningCapture:
        return planning_capture(self.spec, CAPTURE_BATCH, fold=self.fold)

    @property
    def graph(self) -> ModelGraph:
        return self.captured.graph

    @cached_property
    def costs(self) -> ModelCosts:
        """The capture's costs, priced for the precision the strategy will train in."""
        return with_precision(self.captured.costs, self.precision)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for Ray workers: the model file travels as its path (functions from a
        file imported by path do not pickle), captures and sharded costs as data."""
        state = dict(self.__dict__)
        from runtime.cluster.join import remote_source

        state["spec"] = remote_source(self.spec.source)  # as a cluster's nodes find it
        state["cache"] = EvaluationCache()  # results stay where they were computed
        state["_last_plan"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, spec=load_model(*state["spec"]))

    def on(self, cluster: ClusterSpec, gpus: int, batch_size: int) -> Evaluator:
        """This model on another cluster, device count or batch: the captures and what is
        priced from them (they depend on the model and precision alone) are shared."""
        other = dataclasses.replace(self, cluster=cluster, gpus=gpus, batch_size=batch_size,
                                    _last_plan=None)
        for name in ("captured", "costs", "dag"):
            if name in self.__dict__:
                other.__dict__[name] = self.__dict__[name]
        other._sharded = self._sharded
        return other

    @cached_property
    def dag(self) -> TrainingDAG:
        return single_device_dag(self.captured.graph)

    def sharded_costs(self, sharding: ModelSharding) -> tuple[ModelCosts, InGraphComm]:
        """Costs of one rank's tensor/expert-parallel slice (captured once per sharding)."""
        return self._slice(sharding)[:2]

    def _slice(self, sharding: ModelSharding
               ) -> tuple[ModelCosts, InGraphComm, dict[str, float]]:
        """`sharded_costs`, and the share of each value crossing stages a rank holds."""
        if sharding not in self._sharded:
            try:
                cap = planning_capture(self.spec, CAPTURE_BATCH, sharding, fold=self.fold)
            except PiperError as e:  # a one-line input error, as `capture_sharded` says it
                raise Infeasible(split_failure(sharding, e)) from None
            assert cap.traffic is not None
            costs = with_precision(cap.costs, self.precision)
            self._sharded[sharding] = (costs, cap.traffic.in_precision(costs),
                                       self._crossing_share(cap.graph, sharding))
        return self._sharded[sharding]

    def _crossing_share(self, graph: ModelGraph, sharding: ModelSharding) -> dict[str, float]:
        """Per value crossing regions (the plan's names): the share of it a rank holds
        under `sharding` (1/tp of the sequence with sequence parallelism, 1/cp with context
        parallelism, else whole)."""
        if not sharding.sp and sharding.cp == 1:
            return {}
        whole = self.captured.graph
        rename = align(graph, whole, 0, (sharding.tp if sharding.sp else 1) * sharding.cp)
        return {b: graph.value(a).nbytes / max(1, whole.value(b).nbytes)
                for a, b in rename.items()}

    def region_costs(self) -> tuple[float, ...]:
        return tuple(float(self.costs.forward_flops_of([r], 1)) or 1.0
                     for r in self.captured.graph.names)

    def skeleton(self, program: Program) -> TrainingDAG:
        """`program` applied without its microbatches and orders: the stages, replicas and
        sharding it sets, at a small fraction of the cost of the whole DAG."""
        kept = [d for d in program.directives
                if not isinstance(d, (Split, SplitBackward, Order, Stream))]
        return apply_for(Program(kept, name=program.name), self.dag, self.gpus)

    def peak_memory_bound(self, program: Program) -> int:
        """Most bytes any rank of `program` holds, from its directives without scheduling or
        simulating (`planner.search.memory_bound`): never above the simulated peak.

        Milliseconds even on 1024 devices: the stage cut comes from applying the Place
        directives alone to the one-device DAG, the sharding from one skeleton per set of
        sharding directives; both are memoised, as thousands of points share them."""
        ds = program.directives
        places = tuple(d for d in ds if isinstance(d, Place))
        if places not in self._stage_cuts:
            dag = Program(list(places)).apply(self.dag)
            self._stage_cuts[places] = ([s.regions for s in dag.stages],
                                        [s.device for s in dag.stages])
        regions, devices = self._stage_cuts[places]
        rep = next((d for d in ds if isinstance(d, Replicate)), None)
        shards = tuple(d for d in ds if isinstance(d, (ShardTensor, Shard, ShardSequence)))
        sharding = ModelSharding()
        if shards:
            if shards not in self._shardings:
                self._shardings[shards] = self.skeleton(program).sharding
            sharding = self._shardings[shards]
        costs = self.costs if sharding.trivial else self.sharded_costs(sharding)[0]
        rc = next((d for d in ds if isinstance(d, Recompute)), None)
        again = rc.chosen(len(regions)) if rc else ()
        orders = [d for d in ds if isinstance(d, Order)]
        dp, zero = (rep.degree, rep.zero) if rep else (1, 0)
        dp *= sharding.cp  # ZeRO shards over the context-parallel ranks too
        bucket = rep.bucket_bytes if rep else 0
        moved = [k for d in ds if isinstance(d, Stream) for k in d.kinds.split()]
        return max(device_peaks(
            regions, devices, orders, dp=dp, zero=zero, costs=costs,
            microbatch_size=program_microbatch_size(program, self.batch_size),
            recompute=frozenset(again), bucket_bytes=bucket,
            early=early_reduce_scatter_stages(orders, dp=dp, zero=zero, bucket_bytes=bucket,
                                              moved=moved),
            policy=rc.policy if rc else "full"))

    def _plan(self, program: Program) -> Plan:
        """The simulation view of `program`'s Plan: one replica of each kind, so its cost
        does not grow with dp. Programs that differ only in the bucket cap or sequence
        parallelism (a search scores each of a point's `SearchSpace.variants`) share one DAG
        and schedule: those change how tasks are priced, not which tasks run."""
        rep = next((d for d in program.directives if isinstance(d, Replicate)), None)
        bucket = rep.bucket_bytes if rep else 0
        sp = any(isinstance(d, ShardTensor) and d.sequence_parallel
                 for d in program.directives)
        key = Program([dataclasses.replace(d, bucket_mb=None) if d is rep
                       else dataclasses.replace(d, sequence_parallel=False)
                       if isinstance(d, ShardTensor) else d
                       for d in program.directives], name=program.name)
        last = self._last_plan
        if last is None or last[0] != key:
            s = program.summary()
            over = bool(s.get("ep_over_tp"))
            mesh = Mesh(s["pp"], s["dp"], s["tp"], s["ep"] // s["tp"] if over else s["ep"],
                        s["cp"], over)
            kept = representative_replicas(mesh, self.cluster)
            dag = dataclasses.replace(self.dag, kept=kept)
            # no separate deadlock dry run: the simulator's timeline is one, and raises the same
            last = self._last_plan = (key, schedule(apply_for(key, dag, self.gpus),
                                                    check=False))
        plan = last[1]
        return dataclasses.replace(plan, bucket_bytes=bucket,
                                   sharding=dataclasses.replace(plan.sharding, sp=sp))

    def memory_parts(self, result: Evaluation) -> tuple[MemoryParts, ...]:
        """Per simulated rank of `result`: its peak by what holds the bytes (weights,
        gradients, optimizer, activations, temporaries, communication buffers)."""
        plan = result.plan
        costs = self.costs if plan.sharding.trivial else self.sharded_costs(plan.sharding)[0]
        return memory_parts(plan, costs, result.microbatch_size, result.prediction.spans)

    def evaluate(self, program: Program) -> Evaluation:
        """Apply, schedule and simulate `program`, or return the cached result for its key."""
        mb = program_microbatch_size(program, self.batch_size)
        key = evaluation_key(program, self.captured.graph, self.costs, self.cluster, mb,
                             self.gpus, tp_overlap=self.tp_overlap,
                             expert_skew=self.expert_skew, ep_overlap=self.ep_overlap,
                             param_gather_overlap=self.param_gather_overlap)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        plan = self._plan(program)
        under = (self.param_gather_overlap and plan.zero in (1, 2)
                 and program.summary()["comm_stream"])
        if plan.sharding.trivial:
            tc = dataclasses.replace(task_costs(plan, self.costs, self.cluster, mb),
                                     gather_under_forward=under)
            pred = simulate(plan, self.costs, self.cluster, mb, durations=tc)
        else:  # the rank's slice of the math, plus the collectives inside its chunks
            costs, traffic, share = self._slice(plan.sharding)
            tc = with_expert_skew(task_costs(plan, costs, self.cluster, mb), plan, costs,
                                  self.expert_skew)
            tc = dataclasses.replace(tc, gather_under_forward=under)
            if share:  # what crosses stages is 1/tp (SP) or 1/cp of the sequence per rank
                tc = dataclasses.replace(tc, value_bytes=tuple(
                    (v, round(b * share.get(v, 1.0))) for v, b in tc.value_bytes))
            durations = with_in_graph_comm(tc, plan, traffic, self.cluster, mb,
                                           self.tp_overlap, self.expert_skew,
                                           self.ep_overlap)
            pred = simulate(plan, costs, self.cluster, mb, durations=durations)
            # MFU counts the whole model's FLOPs; the slice's are 1/tp of them (and its
            # tokens 1/cp of each sequence's)
            full, part = self.costs.forward_flops_per_sample, costs.forward_flops_per_sample
            if part > 0:
                pred = dataclasses.replace(pred, mfu=pred.mfu * full / part)
            if costs.tokens_per_sample != self.costs.tokens_per_sample:
                pred = dataclasses.replace(pred, tokens_per_s=pred.tokens_per_s
                                           * self.costs.tokens_per_sample
                                           / costs.tokens_per_sample)
        ev = Evaluation(program, plan, pred, mb)
        self.cache.put(key, ev)
        return ev
