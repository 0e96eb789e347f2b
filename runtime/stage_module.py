"""Cut the captured FX graph into one executable module per stage.

A stage module takes its parameters, buffers, batch inputs and incoming activations as
explicit inputs and returns every value some other stage (or the loss) needs, so the worker
can run forward and backward of a stage on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.export.graph_signature import InputKind

from piper.capture import Captured
from piper.errors import PiperError


@dataclass(frozen=True)
class StageModule:
    """`inputs[i]` says where input i comes from: ("param"|"buffer", fqn), ("input", k), or
    ("act", value name); `outputs` are the FX value names the module returns, in order."""

    module: fx.GraphModule
    inputs: tuple[tuple[str, str | int], ...]
    outputs: tuple[str, ...]
    model_outputs: tuple[str, ...]  # the model's own outputs among them (loss input)


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
    nodes = [n for n in g.nodes
             if n.op == "call_function" and captured.node_region[n.name] in regions]
    inside = set(nodes)
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
        env[n].kwargs = _retarget(env[n].kwargs, device)
    out_node = next(n for n in g.nodes if n.op == "output")
    model_outs = [a.name for a in out_node.all_input_nodes if a in inside]
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    new.output(tuple(env[n] for n in outputs))
    gm = fx.GraphModule(torch.nn.Module(), new)
    return StageModule(gm, tuple(inputs), tuple(n.name for n in outputs), tuple(model_outs))


def _retarget(kwargs: dict, device: torch.device) -> dict:
    """Ops traced on meta baked `device=meta` into their kwargs; point them at the real one."""
    dev = kwargs.get("device")
    if isinstance(dev, torch.device) and dev.type == "meta":
        return {**kwargs, "device": device}
    return kwargs
