"""Whole-graph rewrites of a capture: cleanups right after export, model outputs routed to
the last region, and a copy whose ops make their tensors on meta (what the cost models
replay)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

_METADATA_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Remove export's checks that a tensor has the dtype it had when traced (before each
    `.to(dtype)` a model calls): the runtime trains the fp32 trace in bf16 too, and the
    cast itself stays in the graph."""
    asserts = [n for n in gm.graph.nodes
               if n.op == "call_function" and n.target is _METADATA_ASSERT and not n.users]
    for n in asserts:
        gm.graph.erase_node(n)
    if asserts:
        gm.recompile()



def to_meta(val: Any) -> Any:
    """Capture's fake tensors (anywhere in a pytree) as plain meta tensors of the same
    shape, stride and dtype: the cost models compute on meta."""
    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty_strided([int(d) for d in v.shape], [int(s) for s in v.stride()],
                                       dtype=v.dtype, device="meta")
        return v
    return pytree.tree_map(conv, val)


def graph_on_meta(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` (same node names) whose ops make their tensors on meta: a capture's
    factories name the trace's device (`piper.capture.TRACE_DEVICE`), and replayed as they are they would
    allocate for real (a causal mask of sequence x sequence, gigabytes at 32K tokens)."""
    graph = copy.deepcopy(gm.graph)
    meta = torch.device("meta")

    def retarget(a: Any) -> Any:
        return meta if isinstance(a, torch.device) else a

    for n in graph.nodes:
        n.args = fx.node.map_aggregate(n.args, retarget)
        n.kwargs = fx.node.map_aggregate(n.kwargs, retarget)
    return fx.GraphModule(gm, graph)


def outputs_through_last(g: fx.Graph, region: dict[str, int]) -> list[fx.Node]:
    """Model outputs made in earlier regions (a Hugging Face MoE model returns each layer's
    router logits beside its logits and loss) pass through the last region that makes one:
    an identity op there, so they reach the output stage as any value crossing stages
    does. Returns the ops added (their region set)."""
    out_node = next(n for n in g.nodes if n.op == "output")
    made = [a for a in out_node.all_input_nodes if a.name in region]
    if not made:
        return []
    last = max(region[a.name] for a in made)
    added = []
    for a in made:
        if region[a.name] == last:
            continue
        with g.inserting_before(out_node):
            via = g.call_function(torch.ops.aten.alias.default, (a,))
        via.meta = {k: v for k, v in a.meta.items() if k in ("val", "tensor_meta")}
        out_node.replace_input_with(a, via)
        region[via.name] = last
        added.append(via)
    return added
