"""Analytical compute costs: FLOPs, ops and saved bytes per region, and chunk durations.

`model_costs` re-runs the captured FX graph on meta tensors, one node at a time, under
`torch.utils.flop_counter.FlopCounterMode`: FLOPs come from PyTorch's own per-op formulas and
land on the region that owns the node, together with the op itself (its size and dtype), so
durations can follow a per-device efficiency curve by matmul size instead of one average
rate. Saved bytes come from autograd's saved-tensor hooks (`cost_models.saved`). Nothing
touches real memory, so a 70B model is costed on a laptop. `cost_models.task_costs` turns
those figures and a `ClusterSpec` into the durations of a Plan's tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import fx
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from cost_models.attention import CAUSAL_WORK, attention_extent, attention_seconds
from cost_models.cluster import ClusterSpec
from cost_models.kernels import Gemm, gemm_seconds
from cost_models.loss_ops import loss_kernels
from cost_models.piper_ops import OpKey, context_attention_flops, routed_keys, routed_saved_bytes
from cost_models.saved import saved_bytes
from piper.capture import Captured
from piper.graph_passes import graph_on_meta, to_meta
from piper.moe import routed_shapes

BACKWARD_FLOPS_RATIO = 2.0
"""Backward = grad wrt inputs + grad wrt weights, each about one forward's matmuls."""

UPDATE_BYTES_PER_PARAM = 28
"""fp32 AdamW streams param, grad, m, v in (16 B) and param, m, v out (12 B): memory-bound."""

_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class OpGroup:
    """`count` ops of one region that cost alike: `flops` each at the capture batch (0: no
    matmul math, so only the per-op overhead and the bytes it moves), in 16-bit floats or
    not, moving `nbytes`."""

    flops: int
    count: int
    low_precision: bool = False
    work: float = 1.0
    """Share of `flops` the kernel runs: a causal fused attention (flash, SDPA with
    `is_causal`) skips the blocks above the diagonal, about half. FLOP counts keep the
    whole figure (the convention MFU is reported in), durations use this share."""
    nbytes: int = 0
    """The bytes the op reads and writes at the capture batch (views move none). An op
    without matmul math (a norm, an activation, a residual add, a cast) is bound by them on
    GPUs (`ClusterSpec.elementwise_bandwidth`); a matmul whose operands are thin (a small
    hidden size) is partly bound by them too."""
    attention: bool = False
    """A fused attention kernel (any of ATen's scaled-dot-product ops): its backward
    recomputes what the forward did not keep (`ATTENTION_BACKWARD_RATIO`)."""
    shape: tuple[int, ...] = ()
    """A GEMM's (batch, m, n, k) at the capture batch (`cost_models.kernels.Gemm`): its
    tiles fill the SMs in waves, and its backward's two GEMMs have shapes of their own. A
    fused attention's (keys per kernel, ring steps) (`cost_models.attention`): its kernel's
    rate depends on them. Empty: timed by FLOPs alone."""
    fp32: bool = False
    """Runs in fp32 whatever the training precision: autocast computes a loss (softmax,
    cross-entropy) in fp32 (`cost_models.loss_ops`), so bf16 training does not halve its
    bytes."""


@dataclass(frozen=True, kw_only=True)
class ModelCosts:
    """Per-region compute and memory figures at capture batch `batch`; tuples follow `regions`.

    Figures scale linearly with the samples a task processes, which holds for the dense
    layers that dominate; attention's quadratic term scales with sequence, not batch.
    """

    regions: tuple[str, ...]
    forward_flops: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    """Bytes autograd saves for backward (saved-tensor hooks); where the hooked run is not
    possible, the non-aliasing op outputs, an upper bound."""
    params: tuple[int, ...]
    batch: int
    tokens_per_sample: int
    element_size: int = 4
    """Bytes per parameter element (the model's floating dtype)."""
    ops: tuple[tuple[OpGroup, ...], ...] = ()
    """Per region, its ops grouped by size; empty: time by total FLOPs only."""
    param_tensors: tuple[int, ...] = ()
    """Per region, parameter tensors it owns (an optimizer step costs per tensor)."""
    recompute_bytes: tuple[int, ...] = ()
    """Per region, what it keeps when recomputed in backward: its inputs."""
    output_bytes: tuple[int, ...] = ()
    """Per region, the part of both figures above that the model's outputs and the loss
    keep until backward (the output region's logits and log-softmax): kept either way,
    never rebuilt."""
    largest_params: tuple[int, ...] = ()
    """Per region, elements of its largest parameter tensor (a ZeRO unit is at least one
    whole parameter); empty: unknown."""
    selective_bytes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Per selective recompute policy (`piper.Recompute` attention, op), per region, what a
    microbatch keeps, measured as the runtime rewrites the region; a policy missing here
    keeps what no recompute keeps."""
    recompute_ops: tuple[tuple[str, tuple[tuple[OpGroup, ...], ...]], ...] = ()
    """Per selective policy, per region, the ops its backward runs again."""
    precision: str = "fp32"
    """What training computes in (`with_precision`): fp32, bf16-mixed or bf16."""
    wire_element_size: int = 0
    """Bytes per element of floating activations sent between stages (0: as captured)."""
    grad_element_size: int = 0
    """Bytes per element of gradient all-reduces and reduce-scatters (0: `element_size`)."""
    optimizer_bytes: int = 8
    """Optimizer state per parameter: AdamW's two moments (fp32: 8 bytes)."""
    routed_flops: tuple[int, ...] = ()
    """Per region, the part of `forward_flops` that is routed experts' GEMMs (`piper.moe`):
    the work a skewed router loads unevenly on the ranks of an EP group."""
    cast_params: tuple[int, ...] = ()
    """Per region, elements of the parameters matmuls read (bf16-mixed casts them once)."""
    _ops_match: bool = field(init=False, repr=False, compare=False, hash=False, default=False)

    def __post_init__(self) -> None:
        n = len(self.regions)
        if not (len(self.forward_flops) == len(self.activation_bytes) == len(self.params) == n):
            raise ValueError("ModelCosts: every per-region tuple must have one entry per region")
        for f in ("ops", "param_tensors", "recompute_bytes", "output_bytes",
                  "largest_params", "routed_flops", "cast_params"):
            if getattr(self, f) and len(getattr(self, f)) != n:
                raise ValueError(f"ModelCosts: {f} must be empty or have one entry per region")
        # op records describe `forward_flops`; figures replaced without them (a what-if
        # model) no longer match, and are then timed by their totals alone
        match = bool(self.ops) and all(
            sum(g.flops * g.count for g in groups) == f
            for groups, f in zip(self.ops, self.forward_flops, strict=True))
        object.__setattr__(self, "_ops_match", match)
        if self.batch < 1:
            raise ValueError(f"ModelCosts: batch must be >= 1, got {self.batch}")

    def _sum(self, figures: tuple[int, ...], regions: Sequence[str]) -> int:
        return sum(figures[self.regions.index(r)] for r in regions)

    def forward_flops_of(self, regions: Sequence[str], samples: float) -> float:
        return self._sum(self.forward_flops, regions) * samples / self.batch

    def activation_bytes_of(self, regions: Sequence[str], samples: float,
                            recompute: bool | str = False) -> float:
        """Bytes a microbatch of `samples` keeps from its forward to its backward, under
        recompute `recompute` (False: none; True or "full"; a selective policy's name)."""
        figures = self.activation_bytes
        if recompute in (True, "full"):
            figures = self.recompute_bytes or figures
        elif recompute:
            figures = dict(self.selective_bytes).get(recompute, figures)
        return self._sum(figures, regions) * samples / self.batch

    def recompute_peak_bytes_of(self, regions: Sequence[str], samples: float,
                                policy: str = "full") -> float:
        """Under recompute, the largest one region rebuilds while its backward runs (a
        selective policy rebuilds one small segment at a time: counted as none)."""
        if policy != "full":
            return 0.0
        kept = self.output_bytes or (0,) * len(self.regions)
        return max((self.activation_bytes[i] - kept[i]
                    for i in map(self.regions.index, regions)), default=0) * samples / self.batch

    def param_tensors_of(self, regions: Sequence[str]) -> int:
        return self._sum(self.param_tensors, regions) if self.param_tensors else len(regions)

    def chunk_seconds(self, regions: Sequence[str], samples: float,
                      cluster: ClusterSpec) -> tuple[float, float]:
        """(forward, backward) seconds of `regions` on `samples`, op by op.

        A matmul of f FLOPs moving b bytes takes `cluster.matmul_seconds(f, b)` forward
        (the rate its math reaches, bounded by the bytes its operands stream) and twice that
        backward (input and weight gradients: two matmuls of the same size; a fused
        attention `ATTENTION_BACKWARD_RATIO` times); every other op costs the cluster's
        per-op overhead plus the bytes it moves over `cluster.elementwise_bandwidth` (twice
        that backward: it reads the output's gradient and what it saved, and writes the
        input's gradient). Every kernel adds `cluster.kernel_overhead_s` (twice backward),
        and the chunk takes at least the host's dispatch of its ops
        (`cluster.host_dispatch_s`). Without op records: FLOPs / effective rate.
        """
        if not self._ops_match:
            fwd = self.forward_flops_of(regions, samples) / cluster.effective_flops
            return fwd, BACKWARD_FLOPS_RATIO * fwd
        return _ops_seconds([g for r in regions for g in self.ops[self.regions.index(r)]],
                            samples / self.batch, cluster)

    def recompute_seconds(self, regions: Sequence[str], samples: float,
                          cluster: ClusterSpec, policy: str = "full") -> float:
        """What a backward of `regions` runs again first under recompute `policy`: the whole
        forward (full), or the ops a selective policy recomputes (`recompute_ops`; none
        recorded: nothing)."""
        if policy == "full":
            return self.chunk_seconds(regions, samples, cluster)[0]
        groups = dict(self.recompute_ops).get(policy)
        if not groups:
            return 0.0
        return _ops_seconds([g for r in regions for g in groups[self.regions.index(r)]],
                            samples / self.batch, cluster)[0]

    def params_of(self, regions: Sequence[str]) -> int:
        return self._sum(self.params, regions)

    def largest_param_of(self, regions: Sequence[str]) -> int | None:
        """Elements of the largest parameter tensor of `regions`; None: unknown."""
        if not self.largest_params:
            return None
        return max((self.largest_params[self.regions.index(r)] for r in regions), default=0)

    @property
    def forward_flops_per_sample(self) -> float:
        return sum(self.forward_flops) / self.batch


def _ops_seconds(groups: Sequence[OpGroup], scale: float, cluster: ClusterSpec
                 ) -> tuple[float, float]:
    """(forward, backward) seconds of op `groups` at `scale` times their capture batch
    (`ModelCosts.chunk_seconds`)."""
    mm = mm_back = other = moved = 0.0
    kernels = 0
    for g in groups:
        if g.flops and g.shape and not g.attention:
            fwd, back = _gemm_seconds(g, scale, cluster)
            mm += g.count * fwd
            mm_back += g.count * back
        elif g.attention:
            fwd, back = attention_seconds(cluster, g.flops * scale, g.work, g.shape,
                                          g.nbytes * scale, g.low_precision)
            mm += g.count * fwd
            mm_back += g.count * back
        elif g.flops:
            t = g.count * cluster.matmul_seconds(g.flops * g.work * scale, g.nbytes * scale,
                                                 g.low_precision)
            mm += t
            mm_back += t * BACKWARD_FLOPS_RATIO
        else:
            other += g.count
            moved += g.count * g.nbytes * scale
        kernels += g.count if g.flops or g.nbytes else 0
    bw = cluster.elementwise_bandwidth
    streamed = moved / bw if bw else 0.0
    launch = kernels * cluster.kernel_overhead_s
    host = kernels * cluster.host_dispatch_s  # the host queues kernels ahead
    return (max(mm + other * cluster.op_overhead_s + streamed + launch, host),
            max(mm_back + BACKWARD_FLOPS_RATIO * (streamed + launch)
                + other * cluster.backward_op_overhead_s, BACKWARD_FLOPS_RATIO * host))


def _gemm_seconds(g: OpGroup, scale: float, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) seconds of one GEMM of `g` on `scale` times its samples: the
    backward's input- and weight-gradient GEMMs each at their own shape."""
    gemm = Gemm(*g.shape).scaled(scale)
    nbytes = g.nbytes * scale
    dx, dw = gemm.gradients()
    return (gemm_seconds(cluster, gemm, nbytes, g.low_precision),
            gemm_seconds(cluster, dx, nbytes, g.low_precision)
            + gemm_seconds(cluster, dw, nbytes, g.low_precision))


def model_costs(captured: Captured) -> ModelCosts:
    """FLOPs, saved bytes and parameters of every region of `captured`, at its capture batch."""
    mg = captured.graph
    ep = captured.program
    counter = _RegionCounter(graph_on_meta(ep.graph_module), captured.node_region,
                             len(mg.regions))
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    with counter.mode:
        outputs = counter.run(*(to_meta(n.meta.get("val")) for n in placeholders))
    head = counter.ops[mg.output_region]
    for nbytes, count in loss_kernels(captured, outputs).items():
        key = (0, False, 1.0, nbytes, False, (), True)
        head[key] = head.get(key, 0) + count
    measured = saved_bytes(captured)
    again = () if measured is None else tuple(
        (policy, tuple(_grouped(counter.node_keys, names) for names in per_region))
        for policy, per_region in measured.recomputed.items())
    return ModelCosts(
        regions=mg.names,
        forward_flops=tuple(counter.flops),
        activation_bytes=measured.saved if measured else tuple(counter.saved),
        params=tuple(r.param_numel for r in mg.regions),
        batch=mg.batch,
        tokens_per_sample=_tokens_per_sample(captured),
        element_size=_element_size(captured),
        ops=tuple(_op_groups(groups) for groups in counter.ops),
        param_tensors=tuple(len(r.params) for r in mg.regions),
        recompute_bytes=measured.inputs if measured else (),
        output_bytes=measured.tails if measured else (),
        largest_params=tuple(r.largest_param for r in mg.regions),
        selective_bytes=tuple(measured.selective.items()) if measured else (),
        recompute_ops=again,
        routed_flops=tuple(counter.routed) if any(counter.routed) else (),
        cast_params=measured.cast if measured else ())


_Key = OpKey


def _op_groups(groups: dict[_Key, int]) -> tuple[OpGroup, ...]:
    return tuple(OpGroup(f, c, lp, w, b, a, shape, fp32)
                 for (f, lp, w, b, a, shape, fp32), c in sorted(groups.items()))


def _grouped(node_keys: dict[str, _Key], names: frozenset[str]) -> tuple[OpGroup, ...]:
    """The op groups of the nodes `names` (those a selective recompute runs again)."""
    counts: dict[_Key, int] = {}
    for name in names:
        if name in node_keys:
            counts[node_keys[name]] = counts.get(node_keys[name], 0) + 1
    return _op_groups(counts)


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
        self.routed = [0] * regions  # routed experts' GEMM FLOPs
        self.ops: list[dict[_Key, int]] = [{} for _ in range(regions)]
        self.node_keys: dict[str, _Key] = {}  # each ATen op's group

    def run_node(self, n: fx.Node) -> object:
        if n.op != "call_function":
            return super().run_node(n)
        args = [self.env[a] for a in n.all_input_nodes if a in self.env]
        before = self.mode.get_total_flops()
        try:
            out = super().run_node(n)
        except Exception:  # noqa: BLE001 - an op without a meta kernel: shapes from capture
            out = to_meta(n.meta.get("val"))
        r = self.node_region.get(n.name, 0)
        flops = self.mode.get_total_flops() - before
        routed = routed_shapes(n)
        if routed is not None:  # dropless experts: GEMMs over the routed rows alone
            flops = 0
            size = n.args[0].meta["val"].element_size()  # type: ignore[union-attr]
            for key, count in routed_keys(routed, _low_precision(out), size):
                self.ops[r][key] = self.ops[r].get(key, 0) + count
                flops += key[0] * count
            self.node_keys[n.name] = key
            self.routed[r] += flops
            # what its autograd keeps besides its output (`routed_saved_bytes`)
            self.saved[r] += routed_saved_bytes(routed, size)
        if getattr(n.target, "_piper_cp", False):  # context-parallel attention
            flops = context_attention_flops(n)
            key = (flops, _low_precision(out), CAUSAL_WORK if n.args[4] else 1.0, 0, True,
                   attention_extent(n), False)
            self.ops[r][key] = self.ops[r].get(key, 0) + 1
            self.node_keys[n.name] = key
        self.flops[r] += flops
        if getattr(n.target, "_schema", None) is not None:  # an ATen op, not Python glue
            attention = bool(flops) and _fused_attention(n)
            key = (flops, _low_precision(out), CAUSAL_WORK if _causal_attention(n) else 1.0,
                   _moved_bytes(n, args, out), attention,
                   attention_extent(n) if attention else _gemm_shape(flops, args, out), False)
            self.ops[r][key] = self.ops[r].get(key, 0) + 1
            self.node_keys[n.name] = key
        if not _aliases(n):
            self.saved[r] += sum(t.numel() * t.element_size()
                                 for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _gemm_shape(flops: int, args: list[object], out: object) -> tuple[int, ...]:
    """(batch, m, n, k) of a GEMM from its output and FLOPs (2 m n k per product): a
    product of two operands of >= 3 dims is batched over the output's leading dims; a
    linear layer's rows are all of its input's leading dims. Empty where it is not one."""
    if not flops or not isinstance(out, torch.Tensor) or out.dim() < 1 or not out.numel():
        return ()
    n = out.shape[-1]
    k, rest = divmod(flops, 2 * out.numel())
    if rest or k < 1:
        return ()
    ranks = [a.dim() for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
    if len(ranks) >= 2 and min(ranks[:2]) >= 3 and out.dim() >= 3:
        return (out.numel() // (out.shape[-2] * n), out.shape[-2], n, k)
    return (1, out.numel() // n, n, k)


def _fused_attention(n: fx.Node) -> bool:
    """Any of ATen's scaled-dot-product attention ops (flash, efficient, cuDNN, math)."""
    return "scaled_dot_product" in str(n.target)


def _causal_attention(n: fx.Node) -> bool:
    """A fused scaled-dot-product attention with `is_causal` (any of ATen's SDPA ops)."""
    if not _fused_attention(n):
        return False
    schema = getattr(n.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "is_causal" not in names:
        return False
    i = names.index("is_causal")
    return bool(n.kwargs.get("is_causal", n.args[i] if i < len(n.args) else False))


_GATHERS = ("aten::embedding", "aten::index_select", "aten::gather", "aten::index.")
"""Ops that read only the rows they pick from their (large) input."""


def _moved_bytes(n: fx.Node, args: list[object], out: object) -> int:
    """Bytes a non-matmul ATen op reads and writes: its tensor inputs and outputs (a gather
    reads what it writes; views and the in-graph collectives, priced as collectives, none)."""
    name = str(n.target._schema.name) + "."  # type: ignore[union-attr]
    if _aliases(n) or name.startswith("piper::"):
        return 0

    def size(x: object) -> int:
        return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(x)
                   if isinstance(t, torch.Tensor))

    written = size(out)
    if name.startswith(_GATHERS):
        return 2 * written
    return size(args) + written


def _low_precision(out: object) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in _LOW_PRECISION
               for t in pytree.tree_leaves(out))


def _aliases(n: fx.Node) -> bool:
    """Views and getitem share their input's storage, so they add no bytes."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return True  # operator.getitem and other Python glue
    return any(r.alias_info is not None for r in schema.returns)


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


def with_precision(costs: ModelCosts, precision: str, reduce_dtype: str = "fp32"
                   ) -> ModelCosts:
    """Costs of training `costs`' (fp32-captured) model in `precision`, as `piper-plan run
    --precision` trains it: bf16-mixed runs every matmul at the bf16 rate and keeps bf16
    activations (half the bytes saved for backward, sent between stages and streamed by
    the ops without matmul math) while
    parameters, gradients and AdamW's state stay fp32; bf16 also holds the parameters,
    gradients and optimizer state in bf16. `reduce_dtype` bf16 halves the gradient
    collectives. Precision is priced per op group and per byte, so a what-if model without
    op records keeps its fp32 compute times."""
    if precision == "fp32" and reduce_dtype == "fp32":
        return costs
    low = precision != "fp32"
    # matmuls at the bf16 rate; every op streams bf16 activations (half the bytes; a
    # matmul's weight is the bf16 copy autocast makes)
    def lowered(groups: tuple[OpGroup, ...]) -> tuple[OpGroup, ...]:
        return tuple(replace(g, low_precision=g.low_precision or bool(g.flops),
                             nbytes=g.nbytes // 2) if low and not g.fp32 else g
                     for g in groups)

    ops = tuple(lowered(groups) for groups in costs.ops)
    half = (lambda t: tuple(x // 2 for x in t)) if low else (lambda t: t)
    element = 2 if precision == "bf16" else costs.element_size
    return replace(
        costs, ops=ops, activation_bytes=half(costs.activation_bytes),
        selective_bytes=tuple((p, half(b)) for p, b in costs.selective_bytes),
        recompute_ops=tuple((p, tuple(lowered(g) for g in per))
                            for p, per in costs.recompute_ops),
        recompute_bytes=half(costs.recompute_bytes), output_bytes=half(costs.output_bytes),
        element_size=element,
        precision=precision, wire_element_size=2 if low else 0,
        grad_element_size=2 if reduce_dtype == "bf16" else element,
        optimizer_bytes=4 if precision == "bf16" else costs.optimizer_bytes)
