"""Plan a model of L identical layers from a capture of two of them.

Tracing with `torch.export` costs time per op, so capturing a 32-layer Llama takes ~15 s of
CPU and an 80-layer one ~40 s — and the planner captures once more per tensor/expert-parallel
degree. Planning needs only the region graph and per-region costs, which are the same for
every copy of an identical layer. So before tracing, each `nn.ModuleList` of L >= 3
structurally identical children is cut to its first two; after, the region graph and its
costs are grown back to L copies: copy 0 as captured, copies 1..L-1 cloned from copy 1 (its
inputs from copy k-1, its output to whatever followed the last copy), renamed.

Used only when that is provably the same as the full capture up to value names: the two
captured copies own exactly their children's parameters, run the same ops with the same
FLOPs and saved bytes, and connect as a chain; otherwise the caller captures the whole
model. Real runs always capture the whole model (`runtime.lowering.lower.lower`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from cost_models import ModelCosts, model_costs
from cost_models.sharded import InGraphComm, in_graph_comm
from piper.capture import Captured, Flow, ModelGraph, Region, Value, capture
from piper.model_file import ModelSpec
from piper.regions import AutoRegions
from piper.sharding import ModelSharding

KEEP = 2
"""Copies traced: two, so the copy-to-copy flow (k-1 -> k) is seen once."""
MIN_REPEAT = 3
"""Shorter lists gain nothing from folding."""

T = TypeVar("T")


@dataclass(frozen=True)
class Repeat:
    """A ModuleList at `fqn` of `length` identical children, traced as its first KEEP."""

    fqn: str
    length: int


@dataclass(frozen=True)
class PlanningCapture:
    """What planning needs from a capture: the region graph and costs (full model size)."""

    graph: ModelGraph
    costs: ModelCosts
    traffic: InGraphComm | None
    """In-graph collectives per region (sharded captures only)."""
    folded: tuple[Repeat, ...]
    """The repeated lists folded; empty when the whole model was traced."""
    auto: AutoRegions | None = None
    """Automatic regions, when the model was not tagged (`piper.regions`)."""

    def regions_note(self) -> str:
        """The line that tells the user which regions were chosen automatically."""
        if self.auto is None:
            return ""
        return self.auto.describe(sum(n.startswith("layer.") for n in self.graph.names))


def planning_capture(spec: ModelSpec, batch: int, sharding: ModelSharding | None = None, *,
                     fold: bool = True) -> PlanningCapture:
    """Capture `spec` for planning, tracing two copies of each repeated layer when that is
    exact (see module docstring); `fold=False` traces every layer."""
    if fold:
        cut = _Truncate(spec.index_attrs)
        # the modules are cut and sharded by `prepare`; context parallelism is the
        # capture's own (it traces one rank's tokens and rewrites the graph)
        cp = (ModelSharding(cp=sharding.cp, cp_mode=sharding.cp_mode)
              if sharding is not None and sharding.cp > 1 else None)
        cap = capture(spec, batch, cp, prepare=lambda m: _cut_then_shard(cut, m, sharding))
        if cut.repeats:
            grown = _grow(cap, cut.repeats, sharding is not None)
            if grown is not None:
                return grown
        else:
            return _whole(cap, sharding is not None)
    return _whole(capture(spec, batch, sharding), sharding is not None)


def _cut_then_shard(cut: _Truncate, model: nn.Module, sharding: ModelSharding | None) -> None:
    """Cut first, then shard what is left (the experts of cut copies are gone)."""
    cut(model)
    if sharding is not None:
        present = {name for name, _ in model.named_modules()}
        kept = tuple(e for e in sharding.experts if e in present)
        dataclasses.replace(sharding, experts=kept).apply(model, 0, 0)


def _whole(cap: Captured, sharded: bool) -> PlanningCapture:
    return PlanningCapture(cap.graph, model_costs(cap), in_graph_comm(cap) if sharded else None,
                           (), cap.auto)


# ---- before tracing: cut repeated lists ----------------------------------------------------
class _Truncate:
    """`capture(prepare=...)` hook: cuts each repeated ModuleList to KEEP children."""

    def __init__(self, index_attrs: tuple[str, ...] = ()) -> None:
        self.repeats: list[Repeat] = []
        self.index_attrs = index_attrs  # attributes that hold the layer's position

    def __call__(self, model: nn.Module) -> None:
        for fqn, mod in list(model.named_modules()):
            if type(mod) is not nn.ModuleList or len(mod) < MIN_REPEAT or not fqn:
                continue
            if any(fqn.startswith(f"{r.fqn}.") for r in self.repeats):
                continue  # inside a list already cut: renaming nests no further
            if not _identical(list(mod), self.index_attrs):
                continue
            parent, _, attr = fqn.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, nn.ModuleList(list(mod)[:KEEP]))
            self.repeats.append(Repeat(fqn, len(mod)))


def _identical(children: list[nn.Module], index_attrs: tuple[str, ...] = ()) -> bool:
    """Same module tree, parameter/buffer shapes and plain attributes (a layer index stored
    on the module makes copies differ, unless the model declares it only a position:
    `ModelSpec.index_attrs`); no parameter object shared between copies."""
    first = _signature(children[0], index_attrs, 0)
    if any(_signature(c, index_attrs, i) != first for i, c in enumerate(children[1:], 1)):
        return False
    ids = [id(p) for c in children for p in c.parameters()]
    return len(ids) == len(set(ids))


def _signature(m: nn.Module, index_attrs: tuple[str, ...] = (), index: int = 0) -> tuple:
    def plain(k: str, v: object) -> bool:
        return not k.startswith("_") and k != "training" and not (k in index_attrs and
                                                                   v == index)

    tree = tuple((name, type(sub).__qualname__, tuple(sorted(
        (k, repr(v)) for k, v in vars(sub).items() if plain(k, v))))
        for name, sub in m.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in m.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in m.named_buffers())
    return tree, params, buffers


# ---- after tracing: grow the region graph back ---------------------------------------------
@dataclass(frozen=True)
class _Blocks:
    """Region index ranges of the traced copies: copy 0 = [a, b), copy 1 = [b, c)."""

    a: int
    b: int
    c: int
    length: int
    repeats: tuple[Repeat, ...]

    @property
    def width(self) -> int:
        return self.b - self.a

    def part(self, i: int) -> str:
        return "pre" if i < self.a else "0" if i < self.b else "1" if i < self.c else "post"


def _grow(cap: Captured, repeats: Sequence[Repeat], sharded: bool) -> PlanningCapture | None:
    blocks = _blocks(cap.graph, repeats)
    if blocks is None:
        return None
    copy_of = _op_correspondence(cap, blocks)
    if copy_of is None:
        return None
    costs = model_costs(cap)
    for j in range(blocks.width):  # copy 1 must cost what copy 0 does (no index-dependence)
        i0, i1 = blocks.a + j, blocks.b + j
        if (costs.forward_flops[i0], costs.activation_bytes[i0], _costly(costs.ops[i0])) != (
                costs.forward_flops[i1], costs.activation_bytes[i1], _costly(costs.ops[i1])):
            return None
    grown = _grow_graph(cap.graph, blocks, copy_of)
    if grown is None:
        return None
    graph, source = grown
    traffic = in_graph_comm(cap) if sharded else None
    n = len(cap.graph.regions)
    return PlanningCapture(graph, _per_region(costs, source, n, graph.names),
                           _per_region(traffic, source, n) if traffic else None, tuple(repeats),
                           cap.auto)


def _blocks(mg: ModelGraph, repeats: Sequence[Repeat]) -> _Blocks | None:
    """Where the two traced copies sit among the regions, if they sit as a chain."""
    lengths = {r.length for r in repeats}
    if len(lengths) != 1:
        return None

    def copy(param: str) -> int | None:
        for r in repeats:
            for k in range(KEEP):
                if param.startswith(f"{r.fqn}.{k}."):
                    return k
        return None

    owners = [{copy(p) for p in r.params} for r in mg.regions]
    in0 = [i for i, o in enumerate(owners) if 0 in o]
    in1 = [i for i, o in enumerate(owners) if 1 in o]
    if not in0 or not in1:
        return None
    a, b, c = min(in0), max(in0) + 1, max(in1) + 1
    if min(in1) != b or c - b != b - a:
        return None
    names = mg.names
    for j in range(b - a):
        if not owners[a + j] <= {0} or not owners[b + j] <= {1}:
            return None
        base0, _, k0 = names[a + j].rpartition(".")
        base1, _, k1 = names[b + j].rpartition(".")
        if not base0 or base0 != base1 or (k0, k1) != ("0", "1"):
            return None
    return _Blocks(a, b, c, lengths.pop(), tuple(repeats))


def _costly(groups: Sequence[Any]) -> list[Any]:
    """The op groups that take time on a GPU (math or bytes): an entry split is free."""
    return [g for g in groups if g.flops or g.nbytes]


ENTRY_SPLITS = ("piper::sp_split",)
"""Ops a first layer alone may run on entry: sequence parallelism entered at the first layer
(`sequence_split`, Hugging Face decoders) splits its input there, forward free and an
all-gather backward, which copy 0 keeps as captured; the copies after it have none."""


def _op_correspondence(cap: Captured, blocks: _Blocks) -> dict[str, str] | None:
    """Node name in copy 0 -> the same op in copy 1, if both copies run the same ops (copy 0
    may begin with `ENTRY_SPLITS` of its own)."""
    ops: dict[int, list[Any]] = {}
    for n in cap.program.graph.nodes:
        if n.op == "call_function":
            ops.setdefault(cap.node_region[n.name], []).append(n)
    out: dict[str, str] = {}
    for j in range(blocks.width):
        o0, o1 = ops.get(blocks.a + j, []), ops.get(blocks.b + j, [])
        extra = len(o0) - len(o1)
        if extra > 0 and all(_op_name(x) in ENTRY_SPLITS for x in o0[:extra]):
            o0 = o0[extra:]
        if len(o0) != len(o1) or any(x.target != y.target for x, y in zip(o0, o1)):
            return None
        out.update((x.name, y.name) for x, y in zip(o0, o1))
    return out


def _op_name(n: Any) -> str:
    schema = getattr(n.target, "_schema", None)
    return schema.name if schema is not None else ""


def _grow_graph(mg: ModelGraph, bl: _Blocks, copy_of: dict[str, str]
                ) -> tuple[ModelGraph, list[int]] | None:
    """The full model's region graph, and for each of its regions the traced one it copies."""
    n, L = len(mg.regions), bl.length
    source: list[int] = list(range(bl.a))
    for k in range(L):
        source += [(bl.a if k == 0 else bl.b) + j for j in range(bl.width)]
    source += list(range(bl.c, n))
    new_index = {(i, None): i for i in range(bl.a)}
    for k in range(L):
        for j in range(bl.width):
            new_index[((bl.a if k == 0 else bl.b) + j, k)] = bl.a + k * bl.width + j
    for i in range(bl.c, n):
        new_index[(i, None)] = i + (L - KEEP) * bl.width

    def at(i: int, k: int | None = None) -> int:
        return new_index[(i, k if bl.part(i) in ("0", "1") else None)]

    if bl.part(mg.output_region) in ("0", "1"):
        return None
    if any(bl.a <= i < bl.c for _, rs in mg.tied for i in rs):
        return None  # a parameter shared by the copies: not identical layers

    flows: dict[tuple[int, int], list[str]] = {}
    values: dict[str, Value] = {}

    def add(src: int, dst: int, names: Sequence[str], k: int | None) -> None:
        for v in names:
            new = _renamed_value(v, k)
            old = mg.value(v)
            values.setdefault(new, dataclasses.replace(old, name=new, region=src))
            vs = flows.setdefault((src, dst), [])
            if new not in vs:
                vs.append(new)

    for f in mg.flows:
        s, d = bl.part(f.src), bl.part(f.dst)
        if s == "pre" and d in ("pre", "post") or s == "post":
            add(at(f.src), at(f.dst), f.values, None)
        elif (s, d) == ("pre", "0") or (s, d) == ("0", "0"):
            add(at(f.src, 0), at(f.dst, 0), f.values, None)
        elif (s, d) == ("pre", "1"):
            for k in range(1, L):
                add(at(f.src), at(f.dst, k), f.values, None)
        elif (s, d) == ("1", "1"):
            for k in range(1, L):
                add(at(f.src, k), at(f.dst, k), f.values, k)
        elif (s, d) == ("0", "1"):
            add(at(f.src, 0), at(f.dst, 1), f.values, None)
            if any(v not in copy_of for v in f.values):
                return None
            twin = bl.b + (f.src - bl.a)  # copy k-1 >= 1 is a clone of copy 1
            for k in range(2, L):
                add(at(twin, k - 1), at(f.dst, k), [copy_of[v] for v in f.values], k - 1)
        elif (s, d) == ("1", "post"):
            add(at(f.src, L - 1), at(f.dst), f.values, L - 1)
        else:  # e.g. copy 0 feeding what follows the stack: not a chain of copies
            return None

    regions = tuple(_renamed_region(mg.regions[src], i, bl, k)
                    for i, (src, k) in enumerate(_copies(source, bl)))
    order = {name: i for i, name in enumerate(values)}
    graph = dataclasses.replace(
        mg,
        regions=regions,
        flows=tuple(Flow(s, d, tuple(vs)) for (s, d), vs in sorted(flows.items())),
        values=tuple(sorted(values.values(), key=lambda v: (v.region, order[v.name]))),
        output_region=at(mg.output_region),
        tied=tuple((p, tuple(at(i) for i in rs)) for p, rs in mg.tied),
        linears=tuple((name, shape) for lin, shape in mg.linears
                      for name in _renamed_module(lin, bl)),
        experts=tuple((name, count, regions[at(mg.names.index(reg), k)].name if reg else reg)
                      for ex, count, reg in mg.experts
                      for name, k in zip(_renamed_module(ex, bl), _copy_numbers(ex, bl))),
    )
    return graph, source


def _copies(source: list[int], bl: _Blocks) -> list[tuple[int, int | None]]:
    out: list[tuple[int, int | None]] = []
    for i, src in enumerate(source):
        k = (i - bl.a) // bl.width if bl.a <= i < bl.a + bl.length * bl.width else None
        out.append((src, k))
    return out


def _renamed_value(v: str, k: int | None) -> str:
    """Copy 1 keeps its traced value names; copy k >= 2 gets a suffix (names stay unique)."""
    return v if k is None or k <= 1 else f"{v}_copy{k}"


def _renamed_region(r: Region, index: int, bl: _Blocks, k: int | None) -> Region:
    if k is None:
        return dataclasses.replace(r, index=index)
    base = r.name.rpartition(".")[0]
    params = tuple(_renamed_param(p, bl, k) for p in r.params)
    return dataclasses.replace(r, name=f"{base}.{k}", index=index, params=params)


def _renamed_param(p: str, bl: _Blocks, k: int) -> str:
    for rep in bl.repeats:
        for c in range(KEEP):
            head = f"{rep.fqn}.{c}."
            if p.startswith(head):
                return f"{rep.fqn}.{k}.{p[len(head):]}"
    return p


def _child(name: str, bl: _Blocks) -> tuple[str, int, str] | None:
    """(list, copy, rest) of a module name inside a cut list."""
    for rep in bl.repeats:
        for c in range(KEEP):
            head = f"{rep.fqn}.{c}"
            if name == head or name.startswith(f"{head}."):
                return rep.fqn, c, name[len(head):]
    return None


def _copy_numbers(name: str, bl: _Blocks) -> list[int | None]:
    hit = _child(name, bl)
    if hit is None:
        return [None]
    return [0] if hit[1] == 0 else list(range(1, bl.length))


def _renamed_module(name: str, bl: _Blocks) -> list[str]:
    """A module of copy 0 once; of copy 1 once per copy 1..L-1; others unchanged."""
    hit = _child(name, bl)
    if hit is None:
        return [name]
    fqn, c, rest = hit
    return [f"{fqn}.{k}{rest}" for k in ([0] if c == 0 else range(1, bl.length))]


def _keyed(value: object) -> bool:
    return bool(value) and isinstance(value, tuple) and all(
        isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)
        and isinstance(v[1], tuple) for v in value)


def _per_region(obj: T, source: Sequence[int], traced: int,
                names: tuple[str, ...] | None = None) -> T:
    """`obj` (a dataclass of per-region tuples) for the grown regions: every tuple field that
    has one entry per traced region is re-indexed by `source`; `regions` gets `names`."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if not f.init:
            continue
        value = getattr(obj, f.name)
        if f.name == "regions" and names is not None:
            changes[f.name] = names
        elif _keyed(value):  # (name, per-region tuple) pairs: ModelCosts.selective_bytes
            changes[f.name] = tuple((k, tuple(v[i] for i in source) if len(v) == traced
                                     else v) for k, v in value)
        elif isinstance(value, tuple) and len(value) == traced:
            changes[f.name] = tuple(value[i] for i in source)
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
