"""Selective recompute: which runs of a stage module's ops keep only their inputs.

Two policies of `piper.Recompute` pick segments here; `runtime.execute.recompute` runs each
picked segment under its own checkpoint (its forward keeps the segment's inputs, its
backward runs the segment again first).

- `attention` (Megatron-LM's selective recompute of the core attention; Korthikanti et al.
  2022, sec. 5): every attention op on its own.
- `op`: every maximal run of cheap ops between the expensive ones (matmuls, attention, the
  in-graph collectives, anything not an ATen op), where checkpointing the run frees more
  bytes than the inputs it must then keep. A norm keeps its input only, not its normalised
  copy; SwiGLU keeps its two inputs, not silu's output; a residual add keeps nothing new.
  That is what fused kernels keep (Megatron/Transformer Engine's fused norms and
  `bias_swiglu`), and what torchtitan's `op` policy and torch.compile's min-cut
  partitioner recompute. Which runs pay is measured, not assumed: the stage module runs
  once on meta tensors under saved-tensor hooks, each packed tensor charged to the node
  that packed it (`runs_worth_recomputing`).

Segments never cross a region boundary, so a region's figure in the memory model (measured
region by region, `cost_models.saved`) is what the runtime keeps for it.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from piper.graph_passes import graph_on_meta
from runtime.execute.zero import storage_key

_aten = torch.ops.aten
ATTENTION = frozenset({
    _aten.scaled_dot_product_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
})
"""Fused attention ops (what `scaled_dot_product_attention` becomes on each device)."""
_EXPENSIVE = frozenset({
    _aten.mm, _aten.bmm, _aten.addmm, _aten.baddbmm, _aten.matmul, _aten.linear,
    _aten.convolution, _aten.conv1d, _aten.conv2d, _aten.conv3d, _aten._grouped_mm,
})
"""ATen ops (overload packets) never recomputed by `op`: the matmul-class kernels."""


def is_attention(n: fx.Node) -> bool:
    """An attention op: ATen's fused ones, or a function marked `_piper_attention`
    (`runtime.execute.fused.attention`, what SDPA runs as on CPU and meta)."""
    return n.op == "call_function" and (n.target in ATTENTION
                                        or getattr(n.target, "_piper_attention", False))


def is_cheap(n: fx.Node) -> bool:
    """An op `op` may recompute: an ATen op that is not matmul-class or attention (the
    in-graph collectives are `piper::` ops; the runtime's own calls are Python functions),
    or a `getitem` of one."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        src = n.args[0]
        return isinstance(src, fx.Node) and is_cheap(src)
    t = n.target
    return (isinstance(t, torch._ops.OpOverload) and t.namespace == "aten"
            and t.overloadpacket not in _EXPENSIVE and not is_attention(n))


def attention_segments(gm: fx.GraphModule, node_region: Mapping[str, int]
                       ) -> list[list[fx.Node]]:
    """Each attention op with the `getitem`s that unpack it (`attention` policy)."""
    del node_region  # one op never crosses a region
    out, nodes = [], list(gm.graph.nodes)
    for i, n in enumerate(nodes):
        if is_attention(n):
            seg = [n]
            for m in nodes[i + 1:]:
                if m.op == "call_function" and m.target is operator.getitem and m.args[0] is n:
                    seg.append(m)
                else:
                    break
            out.append(seg)
    return out


def cheap_runs(gm: fx.GraphModule, node_region: Mapping[str, int]) -> list[list[fx.Node]]:
    """Maximal runs, in graph order, of cheap ops of one region (`op`'s candidates)."""
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    region = None
    for n in gm.graph.nodes:
        r = node_region.get(n.name, region)
        if is_cheap(n) and (not current or r == region):
            current.append(n)
        else:
            if current:
                runs.append(current)
            current = [n] if is_cheap(n) else []
        region = r
    if current:
        runs.append(current)
    return runs


def sink_cheap_ops(gm: fx.GraphModule, node_region: Mapping[str, int]) -> None:
    """Move each cheap op down to just before its first user in the same region, in place,
    so that a chain of them sits in one run (SwiGLU's silu and product are otherwise split
    by the up projection between them). Ops drawing random numbers, and ops no one uses
    (asserts), stay where they are: the order of what they do is observable."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    moved = False
    for n in reversed(list(gm.graph.nodes)):
        if not is_cheap(n) or not n.users or _random(n):
            continue
        first = min(n.users, key=lambda u: order[u])
        if (first.op == "output" or node_region.get(first.name) != node_region.get(n.name)
                or first.prev is n):
            continue
        first.prepend(n)
        moved = True
        order = {m: i for i, m in enumerate(gm.graph.nodes)}
    if moved:
        gm.recompile()


def _random(n: fx.Node) -> bool:
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


class _Packs(fx.Interpreter):
    """Runs a graph on meta, charging every tensor autograd packs to the node running."""

    def __init__(self, gm: fx.GraphModule) -> None:
        # every value stays alive: a freed storage's key could be a later one's
        super().__init__(gm, garbage_collect_values=False)
        self.current: fx.Node | None = None
        self.packs: dict[fx.Node, set[int]] = {}
        self.nbytes: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        self.nbytes[key] = t.untyped_storage().nbytes()
        if self.current is not None:
            self.packs.setdefault(self.current, set()).add(key)
        return t

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        return super().run_node(n)


def _storages(value: Any) -> set[int]:
    return {storage_key(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)}


def runs_worth_recomputing(gm: fx.GraphModule, node_region: Mapping[str, int],
                           args: list[torch.Tensor], state: set[int]
                           ) -> list[list[fx.Node]]:
    """The cheap runs (`cheap_runs`) whose checkpoint frees more than it keeps, greedily in
    graph order. `args`: meta tensors for the module's inputs (parameters and activations
    requiring grad), `state`: the storages among them that are model state (never charged).

    A run frees the storages only its own ops pack (not its inputs, not what an op outside
    packs too: the next matmul keeps a norm's output anyway) and newly keeps its inputs that
    nothing kept before."""
    runs = cheap_runs(gm, node_region)
    if not runs:
        return []
    probe = graph_on_meta(gm)
    interp = _Packs(probe)
    with torch.autograd.graph.saved_tensors_hooks(interp.pack, lambda t: t):
        result = interp.run(*args)
    owners: dict[int, set[object]] = {}
    for node, keys in interp.packs.items():
        for k in keys:
            owners.setdefault(k, set()).add(node)
    for k in _storages(result):  # a stage's outputs are held until sent or used
        owners.setdefault(k, set()).add("output")
    by_name = {n.name: n for n in probe.graph.nodes}
    mine = {n.name: n for n in gm.graph.nodes}
    runs = [[by_name[n.name] for n in run] for run in runs]
    env = interp.env
    nbytes = interp.nbytes
    for n, v in env.items():
        for t in pytree.tree_leaves(v):
            if isinstance(t, torch.Tensor):
                nbytes.setdefault(storage_key(t), t.untyped_storage().nbytes())
    chosen = []
    for run in runs:
        members = set(run)
        inputs = set()
        for n in run:
            for a in n.all_input_nodes:
                if a not in members and a in env:
                    inputs |= _storages(env[a])
        inputs -= state
        packed = set().union(*(interp.packs.get(n, set()) for n in run)) - state
        freed = sum(nbytes[k] for k in packed - inputs if owners.get(k, set()) <= members)
        kept = sum(nbytes[k] for k in inputs if not owners.get(k))
        if freed > kept:
            chosen.append([mine[n.name] for n in run])
            for k in packed:
                owners[k] -= members
            for k in inputs:
                owners.setdefault(k, set()).add(id(run))
    return chosen


def segments(gm: fx.GraphModule, node_region: Mapping[str, int], kinds: list[str],
             policy: str) -> list[list[fx.Node]]:
    """The segments a selective `policy` checkpoints in a stage module whose inputs are of
    `kinds` (`StageModule.inputs`' kinds)."""
    if policy == "attention":
        return attention_segments(gm, node_region)
    if policy == "op":
        sink_cheap_ops(gm, node_region)
        args, state = meta_args(gm, kinds)
        return runs_worth_recomputing(gm, node_region, args, state)
    raise ValueError(f"not a selective recompute policy: {policy!r}")


def meta_args(gm: fx.GraphModule, kinds: list[str]) -> tuple[list[torch.Tensor], set[int]]:
    """Meta tensors for a stage module's inputs from the shapes its capture recorded, as
    training sees them: floating parameters and activations require grad. `kinds[i]`:
    "param", "buffer", "input" or "act". Returns them and the model state's storages."""
    args, state = [], set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for kind, node in zip(kinds, placeholders, strict=True):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise TypeError(f"stage input {node.name} without a tensor shape: {val!r}")
        t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        if kind in ("param", "act") and t.is_floating_point():
            t.requires_grad_(True)
        if kind in ("param", "buffer"):
            state.add(storage_key(t))
        args.append(t)
    return args, state

