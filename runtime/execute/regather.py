"""Sequence parallelism keeps 1/t of a linear's input for backward, not the gathered whole.

Under sequence parallelism a column-parallel linear's input arrives as this rank's slice of
the sequence and is all-gathered before the GEMM (`piper.collectives.sp_gather`). Left to
autograd, the GEMM saves the gathered input for its weight gradient: t times the slice, the
largest activation of a transformer layer at high tp. Megatron-LM instead saves the slice
and all-gathers it again in backward (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", sec. 4.2.2), which is what its activation
formula (34·s·b·h/t bytes per layer) assumes. `regather_sequence` rewrites a stage module
so: each linear reading a gathered input becomes `weight_matmul` with the slice as `shard`;
linears sharing one gather (q, k, v) share one re-gather (`weight_grad.Regather`). The
input gradient still flows through the gather's own backward (a reduce-scatter).
"""

from __future__ import annotations

import torch
from torch import fx

from runtime.execute.weight_grad import regather, weight_matmul

_LINEAR = torch.ops.aten.linear.default


def is_sequence_gather(node: fx.Node) -> bool:
    op = getattr(node.target, "_schema", None)
    return node.op == "call_function" and op is not None and op.name == "piper::sp_gather"


def regathering_users(gather: fx.Node) -> list[fx.Node]:
    """The linears that read `gather` as their input (each gathers it again in backward)."""
    return [u for u in gather.users
            if u.op == "call_function" and u.target is _LINEAR and not u.kwargs
            and len(u.args) >= 2 and u.args[0] is gather and gather not in u.args[1:]]


def regather_sequence(gm: fx.GraphModule) -> int:
    """Rewrite `gm` in place; returns how many linears now keep the slice."""
    rewritten = 0
    for n in list(gm.graph.nodes):
        if not is_sequence_gather(n):
            continue
        users = regathering_users(n)
        if not users:
            continue
        shard, group, degree = n.args[:3]
        with gm.graph.inserting_after(n):
            again = gm.graph.call_function(regather, (group, degree, len(users)))
        for u in users:
            b = u.args[2] if len(u.args) > 2 else None
            u.target = weight_matmul
            u.args = ("linear", n, u.args[1], b, -1, -1, shard, again)
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
