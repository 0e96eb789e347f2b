"""Capture: trace a model on the meta device into an FX graph whose ops carry region tags.

`torch.export` (non-strict) runs the user's Python once under fake tensors; with
`preserve_node_meta` the tags from `piper.annotate` land in `node.meta["custom"]`. Every op is
then assigned to exactly one region, and the region-level dataflow becomes a `ModelGraph`:
pure metadata the DAG, directives and cost models work on. The FX graph itself stays in
`Captured` for the runtime, which cuts it into stage modules.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch import fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from piper.annotate import TAG_KEY, counting_regions
from piper.capture_errors import export_failure, failing_module, user_frame
from piper.context_parallel import sequence_of
from piper.errors import PiperError
from piper.graph_passes import drop_metadata_asserts, outputs_through_last, to_meta
from piper.loss_parallel import parallelize_loss
from piper.model_file import ModelSpec
from piper.moe import eager_experts, expert_cuts, expert_modules
from piper.regions import AutoRegions, annotate_automatically
from piper.sequence_split import local_example, split_sequence
from piper.sharding import ModelSharding


@dataclass(frozen=True, slots=True)
class Region:
    """A tagged region: the unit directives group into stages."""

    name: str
    index: int
    params: tuple[str, ...]  # parameter FQNs first used here (owned by this region)
    param_numel: int
    largest_param: int = 0  # elements of its largest parameter (a ZeRO unit holds >= one)


@dataclass(frozen=True, slots=True)
class Value:
    """A tensor that crosses from one region to another (a candidate P2P message)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    region: int  # producer

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def floating(self) -> bool:
        return getattr(torch, self.dtype).is_floating_point


@dataclass(frozen=True, slots=True)
class Flow:
    """Region `src` produces `values` that region `dst` consumes."""

    src: int
    dst: int
    values: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModelGraph:
    """Region-level view of a captured model, at microbatch size `batch`."""

    regions: tuple[Region, ...]
    flows: tuple[Flow, ...]
    values: tuple[Value, ...]
    output_region: int
    batch: int
    tied: tuple[tuple[str, tuple[int, ...]], ...] = ()  # params used by several regions
    tied_numel: tuple[int, ...] = ()  # element count of each tied parameter
    linears: tuple[tuple[str, tuple[int, int]], ...] = ()  # nn.Linear/Embedding: weight shape
    experts: tuple[tuple[str, int, str], ...] = ()  # Experts modules: (name, count, region)
    expert_cuts: tuple[tuple[str, int, int, int], ...] = ()
    """Expert weights expert tensor parallelism can cut: (parameter, hidden dimension,
    halves, its size); experts with biases have none."""
    tp_plan: tuple[tuple[str, str], ...] = ()  # the model file's TP_PLAN

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def value(self, name: str) -> Value:
        for v in self.values:
            if v.name == name:
                return v
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)

    @property
    def expert_regions(self) -> tuple[str, ...]:
        """Regions holding `piper.Experts`, as `base.*` where a whole numbered family does."""
        held = list(dict.fromkeys(r for _, _, r in self.experts))
        out: list[str] = []
        for r in held:
            base = r.rpartition(".")[0]
            family = [n for n in self.names if base and n.rpartition(".")[0] == base]
            pattern = f"{base}.*" if family and set(family) <= set(held) else r
            out += [pattern] if pattern not in out else []
        return tuple(out)


@dataclass(frozen=True)
class Captured:
    """The exported program plus its region assignment (node name -> region index)."""

    program: ExportedProgram
    graph: ModelGraph
    node_region: dict[str, int]
    free: frozenset[str] = frozenset()
    """Ops every stage that uses them recomputes (`_free_glue`); their region is 0."""
    loss: Callable[[Any, Any], torch.Tensor] | None = field(default=None, compare=False)
    """The model file's loss and its targets on meta: what the loss keeps for backward (a
    log-softmax the size of the logits) is activation memory of the output stage."""
    targets: Any = field(default=None, compare=False)
    auto: AutoRegions | None = field(default=None, compare=False)
    """Automatic regions: what was chosen, for the one line that tells the user."""

    @property
    def out_spec(self) -> Any:
        """The output's pytree structure (tensor, tuple, dict, ModelOutput, dataclass):
        the output stage rebuilds it from the graph's flat outputs for `loss_fn`."""
        return self.program.call_spec.out_spec


def capture(spec: ModelSpec, batch: int, sharding: ModelSharding | None = None, *,
            prepare: Callable[[torch.nn.Module], None] | None = None,
            exact: bool = False, dtype: torch.dtype | None = None) -> Captured:
    """Trace `spec`'s model on meta at microbatch size `batch`; no real memory is touched.

    With `sharding`, the model is first cut to one rank's tensor/expert-parallel slice, so
    the graph has local shapes and the in-graph collectives (what a worker executes).
    `prepare` may rewrite the freshly built model first (the planner keeps two of many
    identical layers, see `planner.search.repeats`, because tracing time grows with op count).
    A model whose forward enters no region is traced again with automatic regions
    (`piper.regions`); `Captured.auto` then says what they are.
    With context parallelism (`sharding.cp`) the model is traced on one rank's share of the
    sequence and rewritten for it (`piper.sequence_split`); `exact` (the runtime's
    capture) also proves that each attention mask it drops is the causal one.
    `dtype`: the model's floating parameters and buffers in it (pure bf16 training), so the
    casts a model writes as `.to(x.dtype)` are traced to the dtype it trains in.
    """
    model, ep, targets, auto = _export(spec, batch, sharding, prepare, False, dtype)
    if not any(_tag(n) for n in ep.graph.nodes if n.op == "call_function"):
        model, ep, targets, auto = _export(spec, batch, sharding, prepare, True, dtype)
    eager_experts(ep.graph_module)  # routed experts run their data-dependent work eagerly
    drop_metadata_asserts(ep.graph_module)
    if sharding is not None and sharding.cp > 1:
        local = sequence_of(ep.example_inputs)
        split_sequence(ep.graph_module, local, sharding.cp, sharding.cp_mode, exact=exact,
                       where=f"{spec.path}: ")
    loss = parallelize_loss(ep, spec.loss_fn, targets)  # tensor-parallel logits: kept sliced
    cap = _regions(ep, spec.path, batch)
    return replace(cap, graph=replace(cap.graph, **_modules(model, cap.graph),
                                      tp_plan=spec.tp_plan),
                   loss=loss or spec.loss_fn, targets=targets,
                   auto=auto or getattr(model, "_piper_regions", None))


TRACE_DEVICE = "cpu"
"""The device type fake tensors claim during capture (`runtime.execute.stage_module` points the
ops that name it at the stage's real device). CPU on every machine, so a capture is the
same wherever it is made; a branch on the device type takes the CPU side, which also runs
on GPUs in the cases we know (transformers' MoE offsets)."""


def _export(spec: ModelSpec, batch: int, sharding: ModelSharding | None,
            prepare: Callable[[torch.nn.Module], None] | None, automatic: bool,
            dtype: torch.dtype | None = None
            ) -> tuple[torch.nn.Module, ExportedProgram, Any, AutoRegions | None]:
    auto = None
    try:
        with torch.device("meta"):
            model = spec.build()
            if automatic:
                auto = annotate_automatically(model)
            if prepare is not None:
                prepare(model)
            if dtype is not None:
                model.to(dtype)
        # traced on fake tensors of a real device type, not meta: code that branches on
        # `x.device.type` (Hugging Face's MoE kernels) takes a branch that can run
        with FakeTensorMode(allow_non_fake_inputs=False):
            _fake_state(model, TRACE_DEVICE)
            args, kwargs, targets = local_example(spec, batch, sharding)
            if sharding is not None:
                sharding.apply(model, 0, 0)
    except PiperError:
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise PiperError(f"{spec.path}: build_model/example_batch failed on the meta device "
                         f"(fake tensors, no data): it reads a tensor's value ({e.func}: "
                         ".item(), .tolist() or a data-dependent shape); build the model "
                         "without looking at tensor values") from None
    except Exception as e:  # noqa: BLE001 - user code
        raise PiperError(f"{spec.path}: build_model/example_batch failed on the meta device "
                         f"(fake tensors, no data): {type(e).__name__}: {e}") from None
    try:
        ep = _trace(model, args, kwargs)
    except Exception as e:  # noqa: BLE001 - user code
        if not (_unknown_output(e) and _register_dataclasses(model, args, kwargs)):
            where = "" if user_frame(str(e).splitlines()) else failing_module(
                partial(_run_fresh, spec, batch, sharding, prepare), spec.path)
            raise PiperError(f"{spec.path}: {export_failure(e, where)}") from None
        try:  # the output is a dataclass torch did not know: now it does
            ep = _trace(model, args, kwargs)
        except Exception as e2:  # noqa: BLE001 - user code
            raise PiperError(f"{spec.path}: {export_failure(e2)}") from None
    return model, ep, to_meta(targets), auto


def _fake_state(model: torch.nn.Module, device: str) -> None:
    """The meta parameters, buffers and tensor attributes of `model` as fake tensors on
    `device` (inside a FakeTensorMode), shared ones (tied weights) still shared."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                    device=device)
            made[id(t)] = (torch.nn.Parameter(f, requires_grad=t.requires_grad)
                           if isinstance(t, torch.nn.Parameter) else f)
        return made[id(t)]

    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for k, t in store.items():
                if t is not None and t.device.type == "meta":
                    store[k] = fake(t)  # type: ignore[assignment]
        for k, t in list(vars(m).items()):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                setattr(m, k, fake(t))


def _trace(model: torch.nn.Module, args: tuple, kwargs: dict) -> ExportedProgram:
    """torch.export; on failure torch prints the partial graph to stderr, which our one
    error line replaces (what it writes on success is passed on)."""
    said = io.StringIO()
    with (contextlib.redirect_stderr(said), fx_traceback.preserve_node_meta(),
          counting_regions()):
        # annotations an earlier trace left in the process-wide metadata (torch's own
        # dynamo-disable tag can outlive a failed export) would merge into our region tags,
        # one dict shared by every node: each trace starts without them (restored after)
        fx_traceback.current_meta.pop("custom", None)
        ep = torch.export.export(model, args, kwargs, strict=False)
    sys.stderr.write(said.getvalue())
    return ep


def _unknown_output(e: Exception) -> bool:
    return "not a known type" in str(e) and "output" in str(e)


def _register_dataclasses(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Make the dataclasses in the model's output pytree nodes (one forward on the fake
    tensors finds them); False when there are none to register."""
    import dataclasses

    fake = next((a for a in pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)), None)
    mode = getattr(fake, "fake_mode", None)
    with counting_regions(), (mode if mode is not None else contextlib.nullcontext()):
        out = model(*args, **kwargs)
    found: list[type] = []

    def walk(x: Any) -> None:
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            if type(x) not in pytree.SUPPORTED_NODES and type(x) not in found:
                found.append(type(x))
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(out)
    for cls in found:
        torch.export.register_dataclass(cls)
    return bool(found)


def _run_fresh(spec: ModelSpec, batch: int, sharding: ModelSharding | None,
               prepare: Callable[[torch.nn.Module], None] | None, seen: dict) -> None:
    """Build the model as `_export` does (a failed export can leave its model patched) and
    run its forward eagerly on fake tensors (`capture_errors.failing_module`)."""
    with torch.device("meta"):
        model = spec.build()
        if prepare is not None:
            prepare(model)
    seen["model"] = model
    with FakeTensorMode(allow_non_fake_inputs=False):
        _fake_state(model, TRACE_DEVICE)
        args, kwargs, _ = local_example(spec, batch, sharding)
        if sharding is not None:
            sharding.apply(model, 0, 0)
        with counting_regions():
            model(*args, **kwargs)


def _modules(model: torch.nn.Module, mg: ModelGraph) -> dict:
    """The layers tensor and expert parallelism can split, for directives to check against."""
    owner = {p: r.name for r in mg.regions for p in r.params}
    linears = tuple((n, tuple(m.weight.shape)) for n, m in model.named_modules()
                    if type(m) in (torch.nn.Linear, torch.nn.Embedding))
    modules = expert_modules(model)
    experts = tuple((n, m.num_experts, owner.get(f"{n}.{m.piper_ffn.weights[0]}", ""))
                    for n, m in modules.items())
    cuts = tuple((f"{n}.{p}", dim, halves, int(getattr(m, p).shape[dim]))
                 for n, m in modules.items() if not m.piper_ffn.bias
                 for p, (dim, halves) in expert_cuts(m.piper_ffn))
    return {"linears": linears, "experts": experts, "expert_cuts": cuts}


def _tag(node: fx.Node) -> str | None:
    custom = node.meta.get("custom") or {}
    return custom.get(TAG_KEY)


def _final_names(tags: list[str]) -> dict[str, str]:
    """`layer#3` -> `layer.3` when `layer` repeats, `embed#0` -> `embed` when it does not."""
    count: dict[str, int] = defaultdict(int)
    for t in tags:
        count[t.split("#")[0]] += 1
    out = {}
    for t in tags:
        base, k = t.split("#")
        out[t] = base if count[base] == 1 else f"{base}.{k}"
    seen: dict[str, str] = {}
    for t, name in out.items():
        if name in seen:
            raise PiperError(f"region name {name!r} is given twice (tags {seen[name]!r} and "
                             f"{t!r}); rename one of them")
        seen[name] = t
    return out


def _regions(ep: ExportedProgram, path: str, batch: int) -> Captured:
    g = ep.graph
    ops = [n for n in g.nodes if n.op == "call_function"]
    tags: list[str] = []
    for n in ops:
        t = _tag(n)
        if t is not None and t not in tags:
            tags.append(t)
    if not tags:
        raise PiperError(f"{path}: no regions tagged; wrap parts of forward in "
                         "piper.annotate(name) or use piper.annotate_modules")
    try:
        names = _final_names(tags)
    except PiperError as e:
        raise PiperError(f"{path}: {e}") from None
    index = {t: i for i, t in enumerate(tags)}
    region: dict[str, int] = {}
    for n in ops:  # forward pass: tagged ops, then untagged glue follows its latest input
        t = _tag(n)
        if t is not None:
            region[n.name] = index[t]
            continue
        srcs = [region[a.name] for a in n.all_input_nodes if a.name in region]
        if srcs:
            region[n.name] = max(srcs)
    sig = ep.graph_signature
    param_of = {s.arg.name: s.target for s in sig.input_specs
                if s.kind == InputKind.PARAMETER}
    free = _free_glue(ops, region, set(param_of))
    for n in reversed(ops):  # glue fed only by inputs joins its first consumer
        if n.name not in region:
            users = [region[u.name] for u in n.users if u.name in region]
            region[n.name] = 0 if n.name in free else min(users) if users else 0
    shapes = {p: tuple(n.meta["val"].shape) for n in g.nodes if (p := param_of.get(n.name))}
    owned: dict[int, list[str]] = defaultdict(list)
    tied = []
    for n in g.nodes:
        if n.op != "placeholder" or n.name not in param_of:
            continue
        users = sorted({region[u.name] for u in n.users if u.name in region})
        if not users:
            continue
        owned[users[0]].append(param_of[n.name])
        if len(users) > 1:
            tied.append((param_of[n.name], tuple(users)))

    ops += outputs_through_last(g, region)
    flows: dict[tuple[int, int], list[str]] = defaultdict(list)
    values: dict[str, Value] = {}
    for n in ops:
        if n.name in free:
            continue  # recomputed where used, never sent
        for u in n.users:
            dst = region.get(u.name)
            if dst is None or dst == region[n.name]:
                continue
            if n.name not in flows[(region[n.name], dst)]:
                flows[(region[n.name], dst)].append(n.name)
            values[n.name] = _value(n, region[n.name], path)
    out_node = next(n for n in g.nodes if n.op == "output")
    out_regions = {region[a.name] for a in out_node.all_input_nodes if a.name in region}
    if len(out_regions) != 1:
        raise PiperError(f"{path}: the model output must come from exactly one region, "
                         f"got {sorted(names[tags[i]] for i in out_regions)}")
    regions = tuple(
        Region(name=names[t], index=i, params=tuple(owned[i]),
               param_numel=sum(_numel(shapes[p]) for p in owned[i]),
               largest_param=max((_numel(shapes[p]) for p in owned[i]), default=0))
        for i, t in enumerate(tags))
    mg = ModelGraph(
        regions=regions,
        flows=tuple(Flow(s, d, tuple(v)) for (s, d), v in sorted(flows.items())),
        values=tuple(values.values()),
        output_region=out_regions.pop(),
        batch=batch,
        tied=tuple(tied),
        tied_numel=tuple(_numel(shapes[p]) for p, _ in tied),
    )
    for f in mg.flows:
        if f.src > f.dst:
            raise PiperError(f"{path}: region {regions[f.src].name} feeds the earlier region "
                             f"{regions[f.dst].name}; regions must be tagged in call order")
    return Captured(program=ep, graph=mg, node_region=region, free=frozenset(free))


def _free_glue(ops: list[fx.Node], region: dict[str, int], params: set[str]) -> set[str]:
    """Untagged ops fed only by the batch, buffers, constants and each other (position
    ids, causal masks): every stage that needs one recomputes it, so no region has to send
    it to all the others (which would also break the chain of identical layers). Seeded
    random ops are not free: two stages would draw differently."""
    free: set[str] = set()
    for n in ops:
        if n.name in region or _seeded(n):
            continue
        if all((a.op == "placeholder" and a.name not in params) or a.name in free
               for a in n.all_input_nodes):
            free.add(n.name)
    return free


def _seeded(n: fx.Node) -> bool:
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _value(n: fx.Node, region: int, path: str) -> Value:
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise PiperError(f"{path}: op {n.name} passes a non-tensor between regions")
    return Value(name=n.name, shape=tuple(int(d) for d in val.shape),
                 dtype=str(val.dtype).removeprefix("torch."), region=region)
