"""Activation recompute of a stage module: `torch.utils.checkpoint` per region or segment.

A recomputed stage (`piper.Recompute`, policy `full`) runs each of its regions (each run of
one region's ops, in graph order) under non-reentrant checkpointing: the forward keeps only
what enters the region, and the backward re-runs the region's forward when it first needs
one of its saved tensors. That is Megatron's full recompute, layer by layer, and what the
cost models price (`cost_models.saved`: a region's inputs kept, one region's activations
rebuilt at a time). The selective policies (`attention`, `op`) checkpoint the segments
`runtime.execute.selective` picks instead, each on its own, and nothing else.

It composes with the rest of the runtime because the backward still walks the nodes the
first forward made; the recompute only refills their saved tensors:
- split backward: those nodes defer their weight products to the store that was collecting
  in forward; the recompute also runs inside that store (`context_fn`), so a region's
  forward sees the same state both times;
- ZeRO-3: regions take the parameters as views of the stage's flat buffer, which the
  backward's ALL_GATHER refills before the backward (and so the recompute) starts;
- in-graph collectives (TP f/g, EP all-to-all) run again in the recompute: every rank of a
  group runs the same backward tasks in the same order, so they meet.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from runtime.execute.memory import keep_inputs
from runtime.execute.selective import segments
from runtime.execute.stage_module import StageModule
from runtime.execute.weight_grad import collecting, current_store


class _Checkpointed(torch.nn.Module):
    """One region's part of a stage module, run under `checkpoint` (inputs kept only)."""

    def __init__(self, part: torch.nn.Module) -> None:
        super().__init__()
        self.part = part

    def forward(self, *args: Any) -> Any:
        keep_inputs(args)  # what this region holds until backward (memory ledger)
        store = current_store()

        def contexts() -> tuple[contextlib.AbstractContextManager, ...]:
            return contextlib.nullcontext(), collecting(store)

        return checkpoint(self.part, *args, use_reentrant=False, context_fn=contexts)


def recomputing(sm: StageModule, node_region: Mapping[str, int], policy: str = "full"
                ) -> StageModule:
    """`sm` recomputing by `policy` (`piper.directives.recompute.POLICIES`; `node_region`:
    the capture's op name -> region). Under `full` every region's ops are checkpointed on
    their own; a region split by another's ops counts as two, so the parts always follow the
    graph's order."""
    if policy != "full":
        kinds = [kind for kind, _ in sm.inputs]
        return checkpointing(sm, segments(sm.module, node_region, kinds, policy))
    run, last, part = {}, None, -1
    for n in sm.module.graph.nodes:
        if n.op == "call_function":
            region = node_region.get(n.name, last)
            if region != last:
                part, last = part + 1, region
            run[n.name] = max(part, 0)
    if not run:
        return sm
    gm = split_module(sm.module, None, lambda n: run[n.name], keep_original_order=True)
    for name, child in list(gm.named_children()):
        setattr(gm, name, _Checkpointed(child))
    return replace(sm, module=gm)


def checkpointing(sm: StageModule, picked: list[list[torch.fx.Node]]) -> StageModule:
    """`sm` with each of the segments `picked` (consecutive nodes) checkpointed on its own."""
    if not picked:
        return sm
    segment = {n.name: i for i, seg in enumerate(picked) for n in seg}
    part, last, ids, checkpointed = -1, None, {}, set()
    for n in sm.module.graph.nodes:
        if n.op != "call_function":
            continue
        key = segment.get(n.name, -1)
        if key != last:
            part, last = part + 1, key
            if key >= 0:
                checkpointed.add(part)
        ids[n.name] = part
    gm = split_module(sm.module, None, lambda n: ids[n.name], keep_original_order=True)
    for name, child in list(gm.named_children()):
        if int(name.rsplit("_", 1)[1]) in checkpointed:
            setattr(gm, name, _Checkpointed(child))
    return replace(sm, module=gm)
