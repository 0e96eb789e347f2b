"""Rewrite a graph captured at one rank's share of the sequence for context parallelism.

`capture` traces the model on the tokens one of `cp` ranks holds (t = seq / cp), so every
shape is already local. Three things still assume the rank holds the whole sequence, and
this pass rewrites them:

- attention: each `scaled_dot_product_attention` becomes `piper.context_parallel.attention`,
  which exchanges keys and values. A mask the model built itself is dropped only where it is
  the causal mask (evaluated when `exact`: the runtime's capture); one computed from the
  inputs (padding, documents) is refused.
- positions: each `arange` as long as the local sequence (step 1) becomes the positions of
  the rank's own tokens (`rank_positions`), so RoPE angles, learned position tables and
  position ids are those of the tokens the rank holds.
- anything else that mixes tokens is refused by name: a matmul of two activations with a
  t x t result (attention written out by hand) cannot see the other ranks' tokens.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from piper import context_parallel
from piper.context_parallel import check_length, local_tokens, sequence_of
from piper.errors import PiperError
from piper.model_file import ModelSpec
from piper.sharding import ModelSharding

_aten = torch.ops.aten
_SDPA = _aten.scaled_dot_product_attention.default
_ARANGES = (_aten.arange.default, _aten.arange.start, _aten.arange.start_step)
_MATMULS = (_aten.matmul.default, _aten.bmm.default, _aten.mm.default,
            _aten.baddbmm.default, _aten.einsum.default)
_ASSERT = _aten._assert_tensor_metadata.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")


def split_sequence(gm: fx.GraphModule, length: int, degree: int, mode: str, *,
                   exact: bool = False, where: str = "") -> None:
    """Rewrite `gm` (traced on `length` local tokens) in place for `degree`-way context
    parallelism in `mode` ('ring' or 'all_gather'); raise PiperError naming an op that
    cannot be split along the sequence."""
    g = gm.graph
    data = _data_dependent(g)
    for n in [n for n in g.nodes if n.op == "call_function" and n.target is _SDPA]:
        _attention(g, n, length, degree, mode, exact, data, where)  # masks: aranges as traced
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        if n.target in _ARANGES and _arange_span(n) == (True, length):
            start = n.args[0] if n.target is not _aten.arange.default else 0
            val = n.meta.get("val")
            dtype = val.dtype if isinstance(val, torch.Tensor) else torch.int64
            device = n.kwargs.get("device") or torch.device("cpu")
            with g.inserting_before(n):
                pos = g.call_function(context_parallel.rank_positions,
                                      (start, length, degree, dtype, device))
            pos.meta = dict(n.meta)
            n.replace_all_uses_with(pos)
            g.erase_node(n)
        elif n.target in _MATMULS and _mixes_tokens(n, length, data):
            raise PiperError(f"{where}context parallelism: op {n.name} ({n.target}) "
                             f"multiplies two activations into a {length} x {length} "
                             "matrix (attention written out by hand); only "
                             "scaled_dot_product_attention can be split along the sequence")
    _drop_dead(g)
    gm.recompile()


def _drop_dead(g: fx.Graph) -> None:
    """Remove what only fed a dropped mask: nodes the outputs do not need, with the
    metadata asserts export hangs on them (which `eliminate_dead_code` keeps as impure)."""
    live: set[fx.Node] = set()
    for n in reversed(g.nodes):
        if (n.op in ("output", "placeholder") or n in live
                or (n.is_impure() and n.target is not _ASSERT)):
            live.add(n)
            live.update(n.all_input_nodes)
    for n in reversed(g.nodes):
        if n.target is _ASSERT and all(a in live for a in n.all_input_nodes):
            continue
        if n not in live and n.op == "call_function":
            g.erase_node(n)


def local_example(spec: ModelSpec, batch: int, sharding: ModelSharding | None
                  ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """`example_batch` as one rank holds it: under context parallelism, its share of
    every sequence (a model that cannot be split so is refused here, in one line)."""
    args, kwargs, targets = spec.example(batch)
    if sharding is None or sharding.cp == 1:
        return args, kwargs, targets
    try:
        seq = sequence_of((args, kwargs))
    except ValueError as e:
        raise PiperError(f"{spec.path}: {e}") from None
    why = check_length(seq, sharding.cp)
    if why:
        raise PiperError(f"{spec.path}: {why}")
    return local_tokens((args, kwargs, targets), seq, 0, sharding.cp)


def _arange_span(n: fx.Node) -> tuple[bool, int | None]:
    """(step is 1, number of elements) of an arange with constant bounds."""
    args = n.args
    if n.target is _aten.arange.default:
        start, end, step = 0, args[0], 1
    elif n.target is _aten.arange.start:
        start, end, step = args[0], args[1], 1
    else:
        start, end, step = args[0], args[1], args[2]
    if not all(isinstance(x, int) for x in (start, end, step)):
        return False, None
    return step == 1, end - start


def _data_dependent(g: fx.Graph) -> set[fx.Node]:
    """Nodes whose value depends on a graph input (the batch, parameters or buffers)."""
    out: set[fx.Node] = set()
    for n in g.nodes:
        if n.op == "placeholder" or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _mixes_tokens(n: fx.Node, length: int, data: set[fx.Node]) -> bool:
    val = n.meta.get("val")
    operands = [a for a in n.all_input_nodes if a in data and a.op != "placeholder"]
    return (isinstance(val, torch.Tensor) and val.dim() >= 2
            and tuple(val.shape[-2:]) == (length, length) and len(operands) >= 2)


def _sdpa_args(n: fx.Node) -> dict[str, Any]:
    out: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                           "scale": None}
    out.update(zip(_SDPA_ARGS, n.args))
    out.update(n.kwargs)
    return out


def _attention(g: fx.Graph, n: fx.Node, length: int, degree: int, mode: str, exact: bool,
               data: set[fx.Node], where: str) -> None:
    a = _sdpa_args(n)
    name = f"{where}context parallelism: {n.name} (scaled_dot_product_attention)"
    if a["dropout_p"]:
        raise PiperError(f"{name} has attention dropout {a['dropout_p']}; context "
                         "parallelism runs attention without dropout")
    shapes = [x.meta["val"].shape for x in (a["query"], a["key"])]
    if shapes[0][-2] != length or shapes[1][-2] != length:
        raise PiperError(f"{name} attends {shapes[0][-2]} queries over {shapes[1][-2]} "
                         f"keys; context parallelism splits self-attention over the "
                         f"sequence ({length} tokens per rank)")
    causal = bool(a["is_causal"])
    mask = a["attn_mask"]
    if isinstance(mask, fx.Node):
        if mask in data:
            raise PiperError(f"{name}: its attention mask is computed from the inputs "
                             "(padding or packed documents); context parallelism needs the "
                             "causal mask, or none")
        if exact and not _is_causal_mask(mask, length):
            raise PiperError(f"{name}: its attention mask is not the causal mask; context "
                             "parallelism needs the causal mask, or none")
        causal = True
    with g.inserting_before(n):
        new = g.call_function(context_parallel.attention,
                              (a["query"], a["key"], a["value"], a["scale"], causal, degree,
                               mode))
    new.meta = dict(n.meta)
    n.replace_all_uses_with(new)
    g.erase_node(n)


def _is_causal_mask(mask: fx.Node, length: int) -> bool:
    """Evaluate the (input-free) subgraph that makes `mask` and compare it with the causal
    mask: True below and on the diagonal (a boolean mask) or 0 there and -inf above."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(x: fx.Node) -> None:
        if x in seen:
            return
        seen.add(x)
        for y in x.all_input_nodes:
            visit(y)
        order.append(x)

    visit(mask)
    env: dict[fx.Node, Any] = {}
    cpu = torch.device("cpu")
    for x in order:
        if x.op == "get_attr" or x.op != "call_function":
            return False
        args = fx.node.map_arg(x.args, lambda y: env[y])
        kwargs = fx.node.map_arg(x.kwargs, lambda y: env[y])
        args, kwargs = fx.node.map_aggregate(
            (args, kwargs), lambda v: cpu if isinstance(v, torch.device) else v)
        env[x] = x.target(*args, **kwargs) if x.target is not operator.getitem else \
            args[0][args[1]]
    m = env[mask]
    if not isinstance(m, torch.Tensor) or tuple(m.shape[-2:]) != (length, length):
        return False
    want = torch.ones(length, length, dtype=torch.bool).tril()
    keep = m if m.dtype == torch.bool else m == 0
    return bool((keep == want).all())
