"""Cut the captured FX graph into one executable module per stage.

A stage module takes its parameters, buffers, batch inputs and incoming activations as
explicit inputs and returns every value some other stage (or the loss) needs, so the worker
can run forward and backward of a stage on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.export.graph_signature import InputKind

from piper.capture import Captured
from piper.errors import PiperError
from runtime.execute.fused import fuse_elementwise
from runtime.execute.regather import regather_sequence


@dataclass(frozen=True)
class StageModule:
    """`inputs[i]` says where input i comes from: ("param"|"buffer", fqn), ("input", k), or
    ("act", value name); `outputs` are the FX value names the module returns, in order."""

    module: fx.GraphModule
    inputs: tuple[tuple[str, str | int], ...]
    outputs: tuple[str, ...]
    model_outputs: tuple[str, ...]  # the model's own outputs among them (loss input)
    out_spec: Any = None  # the model output's pytree structure
    out_leaves: tuple[tuple[str, Any], ...] = ()  # ("value", name) or ("const", literal)

    def model_output(self, outs: dict[str, torch.Tensor]) -> Any:
        """The model's output as its forward returned it (a ModelOutput, dict, tuple or
        tensor), rebuilt from this stage's values."""
        leaves = [outs[x] if kind == "value" else x for kind, x in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)


def build_stage(captured: Captured, regions: set[int], device: torch.device) -> StageModule:
    ep = captured.program
    g = ep.graph
    sig = ep.graph_signature
    source: dict[str, tuple[str, str | int]] = {}
    user_inputs = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    for s in sig.input_specs:
        if s.kind == InputKind.PARAMETER:
            source[s.arg.name] = ("param", s.target)
        elif s.kind == InputKind.BUFFER:
            source[s.arg.name] = ("buffer", s.target)
        elif s.kind == InputKind.USER_INPUT:
            source[s.arg.name] = ("input", user_inputs.index(s.arg.name))
        else:
            source[s.arg.name] = ("unsupported", str(s.kind))
    free = captured.free
    inside = {n for n in g.nodes if n.op == "call_function" and n.name not in free
              and captured.node_region[n.name] in regions}
    todo = list(inside)  # with the free glue they use, recomputed here
    while todo:
        for a in todo.pop().all_input_nodes:
            if a.name in free and a not in inside:
                inside.add(a)
                todo.append(a)
    nodes = [n for n in g.nodes if n in inside]
    external: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in external:
                external.append(a)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for a in external:
        src = source.get(a.name, ("act", a.name)) if a.op == "placeholder" else ("act", a.name)
        if src[0] == "unsupported":
            raise PiperError(f"captured graph input {a.name} is a {src[1]}, not supported")
        env[a] = new.placeholder(a.name)
        env[a].meta = dict(a.meta)
        inputs.append(src)
    for n in nodes:
        env[n] = new.node_copy(n, lambda a: env[a])
        env[n].args = _retarget(env[n].args, device)
        env[n].kwargs = _retarget(env[n].kwargs, device)
    out_node = next(n for n in g.nodes if n.op == "output")
    model_outs = [a.name for a in out_node.all_input_nodes if a in inside]
    leaves = tuple(("value", a.name) if isinstance(a, fx.Node) else ("const", a)
                   for a in pytree.tree_leaves(out_node.args[0]))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)
               and (n.name not in free or n.name in model_outs)]
    new.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule(torch.nn.Module(), new)
    regather_sequence(gm)
    fuse_elementwise(gm, device)
    return StageModule(gm, tuple(inputs), tuple(n.name for n in outputs), tuple(model_outs),
                       captured.out_spec, leaves if model_outs else ())


TRACED = ("cpu", "meta")
"""Devices a capture may bake into ops (it traces fake CPU tensors; older paths meta)."""


def _retarget(arg: Any, device: torch.device) -> Any:
    """Ops traced on fake tensors baked the trace's device into their arguments (`device=`
    of a factory, the positional device of `to.device`); point them at the stage's."""
    return fx.node.map_aggregate(
        arg, lambda a: device if isinstance(a, torch.device) and a.type in TRACED else a)
