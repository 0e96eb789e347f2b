"""FSDP's gathers inside a chunk: a ZeRO-3 stage in several units holds two at most.

Without this, a ZeRO-3 chunk gathers its whole stage before it runs (`runtime.execute.zero`), so a
one-stage 70B model gathers 140 GB. With units, the chunk's ops are bracketed per unit,
as FSDP brackets each wrapped module:

- forward: the unit is gathered just before the first op that reads one of its
  parameters (the next unit's all-gather starts then, one ahead) and freed after the last
  (every reading op checks it is gathered: cheap, and a recompute may start anywhere);
- backward: autograd saved views of the unit's storage, which the forward freed; a hook on
  the tensors leaving the unit's ops fires when the first of their gradients is ready,
  before any backward op of the unit can run, and gathers the unit again (the one before
  it starting, one ahead); the unit is freed once every one of its parameters' gradients
  is in (or at the chunk's end).

A recompute re-runs the forward's ops inside the backward: there the brackets gather but
never free, so the backward that follows finds the unit it needs.

Not under overlapped pairs (`dualpipev`): a paired backward runs on the pair lane's thread,
and its gathers would meet the other lane's on one data-parallel communicator in an order
the ranks do not agree on; there the ALL_GATHER brings the stage whole, as without units.

`bracketed` rewrites a stage module's graph once; `UnitGathers` is what its brackets call.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import fx

from runtime.execute.stage_module import StageModule
from runtime.execute.zero import ShardedStage
from runtime.lowering.plan import Plan


def unit_gathers(plan: Plan) -> bool:
    """Whether `plan`'s ZeRO-3 units are gathered one by one inside the chunks (the memory
    and cost models ask the same)."""
    return plan.zero == 3 and plan.bucket_bytes > 0 and not plan.paired


class UnitGathers:
    """The calls a bracketed stage module makes, on the stage's `ShardedStage` (`shard`,
    set once it exists). `order`: units by their first op in the forward."""

    def __init__(self, order: Sequence[int]) -> None:
        self.order = tuple(order)
        self._next = dict(zip(self.order, self.order[1:], strict=False))
        self._prev = dict(zip(self.order[1:], self.order, strict=False))
        self.shard: ShardedStage | None = None
        self.backward = False
        """True while a backward (and any recompute inside it) runs: brackets never free."""

    @property
    def first(self) -> int:
        return self.order[0]

    @property
    def last(self) -> int:
        return self.order[-1]

    def enter(self, k: int) -> None:
        self._bring(k, backward=self.backward)

    def leave(self, k: int, *outs: Any) -> None:
        assert self.shard is not None
        if self.backward:
            return
        tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _grads: self._before_backward(k), mode="any")
        self.shard.release(k)

    def _before_backward(self, k: int) -> None:
        self._bring(k, backward=True)

    def _bring(self, k: int, backward: bool) -> None:
        """Unit k gathered, and the unit the pass reaches next on its way (the one before
        it in forward order when going backward)."""
        assert self.shard is not None
        self.shard.gather(k)
        ahead = (self._prev if backward else self._next).get(k)
        if ahead is not None:
            self.shard.prefetch(ahead)

    def free_when_done(self, views: Sequence[torch.Tensor]) -> list[Any]:
        """Free each unit as soon as the coming backward has put all its parameters'
        gradients on `views`; the hooks' handles, to remove after that backward."""
        assert self.shard is not None
        shard = self.shard
        missing: dict[int, int] = {}
        for i in range(len(views)):
            missing[shard.unit_of(i)] = missing.get(shard.unit_of(i), 0) + 1

        def hook(k: int) -> Any:
            def ready(_v: torch.Tensor) -> None:
                missing[k] -= 1
                if missing[k] == 0:
                    shard.release(k)
            return ready
        return [v.register_post_accumulate_grad_hook(hook(shard.unit_of(i)))
                for i, v in enumerate(views)]


def _reads(node: fx.Node) -> list[fx.Node]:
    """The ops that read `node` or a view of it (views share its storage, and making one
    checks the storage's size: they are inside the bracket too)."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output":
                continue
            out.append(u)
            schema = getattr(u.target, "_schema", None)
            if schema is not None and any(r.alias_info is not None for r in schema.returns):
                todo.append(u)  # a view: its readers read the parameter
    return out


def bracketed(sm: StageModule, unit_of_input: dict[int, int],
              node_region: Mapping[str, int] | None = None
              ) -> tuple[StageModule, UnitGathers, dict[str, int]]:
    """`sm` with every op that reads a unit preceded by `UnitGathers.enter` (a no-op once
    the unit is gathered) and the unit's last op followed by `leave` (`unit_of_input`:
    stage-module input position -> its parameter's unit). Also the region of each
    inserted call (`node_region`: the capture's op -> region): that of the op it brackets,
    so a recomputed region (`runtime.execute.recompute`) re-runs its own gathers."""
    node_region = node_region or {}
    graph = fx.Graph()
    env = graph.graph_copy(sm.module.graph, {})
    graph.output(env)
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    readers: dict[int, set[fx.Node]] = {}
    for i, k in unit_of_input.items():
        readers.setdefault(k, set()).update(_reads(placeholders[i]))
    spans = {k: [min(pos[n] for n in rs), max(pos[n] for n in rs)]
             for k, rs in readers.items() if rs}
    for k, (lo, hi) in spans.items():  # a tuple-valued op's items belong to it
        for n in nodes[lo:hi + 1]:
            hi = max([hi, *(pos[u] for u in n.users if u.target is operator.getitem)])
        spans[k][1] = hi
    order = sorted(spans, key=lambda k: spans[k][0])
    gathers = UnitGathers(order)
    regions: dict[str, int] = {}
    for k in order:
        lo, hi = spans[k]
        inside = set(nodes[lo:hi + 1])
        outs = [n for n in nodes[lo:hi + 1] if _tensor(n)
                and any(u not in inside for u in n.users)]
        for r in sorted(readers[k], key=pos.__getitem__):
            with graph.inserting_before(r):
                call = graph.call_function(gathers.enter, (k,))
            if r.name in node_region:
                regions[call.name] = node_region[r.name]
        with graph.inserting_after(nodes[hi]):
            call = graph.call_function(gathers.leave, (k, *outs))
        if nodes[hi].name in node_region:
            regions[call.name] = node_region[nodes[hi].name]
    module = fx.GraphModule(sm.module, graph)
    return replace(sm, module=module), gathers, regions


def _tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)
