"""Analytical compute costs: FLOPs and saved bytes per region, and task durations from them.

`model_costs` re-runs the captured FX graph on meta tensors, one node at a time, under
`torch.utils.flop_counter.FlopCounterMode`: FLOPs come from PyTorch's own per-op formulas and
land on the region that owns the node. Nothing touches real memory, so a 70B model is costed
on a laptop. `TaskCosts` turns those figures and a `ClusterSpec` into the `duration` and
`transfer` callables `runtime.dryrun.dry_run` runs a Plan with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from cost_models import comm
from cost_models.cluster import ClusterSpec
from piper.capture import Captured
from piper.dag import Kind
from runtime.plan import Plan, Task

BACKWARD_FLOPS_RATIO = 2.0
"""Backward = grad wrt inputs + grad wrt weights, each about one forward's matmuls."""

UPDATE_BYTES_PER_PARAM = 28
"""fp32 AdamW streams param, grad, m, v in (16 B) and param, m, v out (12 B): memory-bound."""


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """Per-region compute and memory figures at capture batch `batch`; tuples follow `regions`.

    Figures scale linearly with the samples a task processes, which holds for the dense
    layers that dominate; attention's quadratic term scales with sequence, not batch.
    """

    regions: tuple[str, ...]
    forward_flops: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    """Bytes of the non-aliasing op outputs: an upper bound on what autograd saves."""
    params: tuple[int, ...]
    batch: int
    tokens_per_sample: int
    element_size: int = 4
    """Bytes per parameter element (the model's floating dtype)."""

    def __post_init__(self) -> None:
        n = len(self.regions)
        if not (len(self.forward_flops) == len(self.activation_bytes) == len(self.params) == n):
            raise ValueError("ModelCosts: every per-region tuple must have one entry per region")
        if self.batch < 1:
            raise ValueError(f"ModelCosts: batch must be >= 1, got {self.batch}")

    def _sum(self, figures: tuple[int, ...], regions: Sequence[str]) -> int:
        return sum(figures[self.regions.index(r)] for r in regions)

    def forward_flops_of(self, regions: Sequence[str], samples: float) -> float:
        return self._sum(self.forward_flops, regions) * samples / self.batch

    def activation_bytes_of(self, regions: Sequence[str], samples: float) -> float:
        return self._sum(self.activation_bytes, regions) * samples / self.batch

    def params_of(self, regions: Sequence[str]) -> int:
        return self._sum(self.params, regions)

    @property
    def forward_flops_per_sample(self) -> float:
        return sum(self.forward_flops) / self.batch


def model_costs(captured: Captured) -> ModelCosts:
    """FLOPs, saved bytes and parameters of every region of `captured`, at its capture batch."""
    mg = captured.graph
    ep = captured.program
    counter = _RegionCounter(ep.graph_module, captured.node_region, len(mg.regions))
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    with counter.mode:
        counter.run(*(_to_meta(n.meta.get("val")) for n in placeholders))
    return ModelCosts(
        regions=mg.names,
        forward_flops=tuple(counter.flops),
        activation_bytes=tuple(counter.saved),
        params=tuple(r.param_numel for r in mg.regions),
        batch=mg.batch,
        tokens_per_sample=_tokens_per_sample(captured),
        element_size=_element_size(captured),
    )


class _RegionCounter(fx.Interpreter):
    """Runs the graph on meta; charges each call_function's FLOPs and output bytes to its region.

    One FlopCounterMode spans the run and is read before and after each node, which is the same
    as a mode per node without re-entering it thousands of times.
    """

    def __init__(self, gm: fx.GraphModule, node_region: dict[str, int], regions: int) -> None:
        super().__init__(gm)
        self.node_region = node_region
        self.mode = FlopCounterMode(display=False)
        self.flops = [0] * regions
        self.saved = [0] * regions

    def run_node(self, n: fx.Node) -> object:
        if n.op != "call_function":
            return super().run_node(n)
        before = self.mode.get_total_flops()
        try:
            out = super().run_node(n)
        except Exception:  # noqa: BLE001 - an op without a meta kernel: shapes from capture
            out = _to_meta(n.meta.get("val"))
        r = self.node_region.get(n.name, 0)
        self.flops[r] += self.mode.get_total_flops() - before
        if not _aliases(n):
            self.saved[r] += sum(t.numel() * t.element_size()
                                 for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _aliases(n: fx.Node) -> bool:
    """Views and getitem share their input's storage, so they add no bytes."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return True  # operator.getitem and other Python glue
    return any(r.alias_info is not None for r in schema.returns)


def _to_meta(val: object) -> object:
    """Capture's fake tensors as plain meta tensors of the same shape, stride and dtype."""
    def conv(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return torch.empty_strided([int(d) for d in v.shape], [int(s) for s in v.stride()],
                                       dtype=v.dtype, device="meta")
        return v
    return pytree.tree_map(conv, val)


def _tokens_per_sample(captured: Captured) -> int:
    sig = captured.program.graph_signature
    user = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    vals = {n.name: n.meta.get("val") for n in captured.program.graph.nodes
            if n.op == "placeholder"}
    for name in user:
        v = vals.get(name)
        if isinstance(v, torch.Tensor):
            return max(1, v.numel() // captured.graph.batch)
    return 1


def _element_size(captured: Captured) -> int:
    sig = captured.program.graph_signature
    params = {s.arg.name for s in sig.input_specs if s.kind == InputKind.PARAMETER}
    for n in captured.program.graph.nodes:
        v = n.meta.get("val")
        if n.name in params and isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            return v.element_size()
    return 4


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
    _bytes: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bytes", dict(self.value_bytes))

    def duration(self, rank: int, task: Task) -> float:
        """Busy time of `task` on `rank`'s stream."""
        k = task.kind
        if k is Kind.FWD:
            return self.forward_s[task.stage]
        if k is Kind.BWD:
            return self.backward_s[task.stage]
        if k in (Kind.BWD_I, Kind.BWD_W):  # each about one forward's matmuls
            return self.backward_s[task.stage] / 2
        if k is Kind.UPDATE:
            return self.update_s[task.stage]
        if k is Kind.SEND:
            return 0.0  # isend: the sender posts it and moves on; the wire time is `transfer`
        if k is Kind.RECV:
            return 0.0  # dry_run charges the wait until arrival
        if k is Kind.ALL_REDUCE:
            lat, bw = comm.link(self.cluster, task.group)
            return comm.ring_all_reduce_time(self.gradient_bytes[task.stage], len(task.group),
                                             latency=lat, bandwidth=bw)
        if k in (Kind.ALL_GATHER, Kind.REDUCE_SCATTER):  # ZeRO: parameters or gradients
            lat, bw = comm.link(self.cluster, task.group)
            return comm.ring_all_gather_time(self.gradient_bytes[task.stage], len(task.group),
                                             latency=lat, bandwidth=bw)
        raise NotImplementedError(f"no cost model for task kind {k.name} ({task.name})")

    def transfer(self, rank: int, task: Task) -> float:
        """Wire time of a SEND from `rank` to `task.peer`: alpha + bytes / beta."""
        nbytes = sum(self._bytes[v] for v in task.values)
        lat, bw = comm.link(self.cluster, (rank, task.peer))
        return comm.p2p_time(nbytes, latency=lat, bandwidth=bw)


def task_costs(plan: Plan, costs: ModelCosts, cluster: ClusterSpec,
               microbatch_size: int) -> TaskCosts:
    """Analytical TaskCosts: FLOPs / effective FLOP/s; updates priced by memory bandwidth."""
    rate = cluster.effective_flops
    fwd = tuple(costs.forward_flops_of(rs, microbatch_size) / rate for rs in plan.stage_regions)
    params = tuple(costs.params_of(rs) for rs in plan.stage_regions)
    shards = plan.dp if plan.zero else 1  # ZeRO ranks update only their shard
    if cluster.memory_bandwidth is None:
        update = tuple(0.0 for _ in params)
    else:
        update = tuple(UPDATE_BYTES_PER_PARAM * p / shards / cluster.memory_bandwidth
                       for p in params)
    scale = microbatch_size / plan.model.batch
    return TaskCosts(
        cluster=cluster,
        forward_s=fwd,
        backward_s=tuple(BACKWARD_FLOPS_RATIO * t for t in fwd),
        update_s=update,
        gradient_bytes=tuple(costs.element_size * p for p in params),
        value_bytes=tuple((v.name, round(v.nbytes * scale)) for v in plan.model.values),
    )
