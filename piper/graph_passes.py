"""Whole-graph rewrites of a capture that are not about regions: cleanups right after
export, and a copy whose ops make their tensors on meta (what the cost models replay)."""

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
