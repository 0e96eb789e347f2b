"""Norm, gated activation and attention keeping for backward what fused kernels keep.

Eager autograd keeps more than a transformer layer needs. `rms_norm` is composite on CPU (and
on meta), so its backward holds the input, the normalised copy and the statistics; SwiGLU's
`silu(gate) * up` holds the gate, silu's output and `up`. The kernels the best stacks run keep
less: Apex/Transformer Engine's fused RMSNorm saves the input and the inverse RMS (the CUDA
`_fused_rms_norm` too), Megatron-LM's `bias_swiglu` saves its input and recomputes silu in
the backward. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", sec. 4) count activations so: a norm keeps its input, a gated MLP its
two inputs and the product the down projection reads.

`fuse_elementwise` rewrites a stage module so (each node keeps its name, so the region map
and the recompute passes still see it): every `aten.rms_norm` becomes `rms_norm`, and every
`silu(a) * b` or `gelu(a) * b` whose activation feeds only the product becomes `gated`.
Both are autograd functions whose forward runs the same ATen ops under the same autocast
state (identical values) and keeps the inputs; the backward runs those ops again, under that
state, and differentiates them. On CPU (and meta) `scaled_dot_product_attention` becomes
`attention`: the same flash kernel, keeping its output in the [b, s, h, d] layout CUDA's
kernels give it, so the output projection reads it without a copy (Korthikanti et al. count
that one tensor). Attention whose keys and values are copies of grouped heads made for it
(`repeat_kv`, as Hugging Face's and torchtitan's Llama write it) reads the grouped heads
(`enable_gqa`): the copies are not made, nor kept for the backward. The memory model builds
its stage modules the same way on meta (`cost_models.saved`), so it counts what the runtime
keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

_aten = torch.ops.aten
_ACTIVATIONS = (_aten.silu.default, _aten.gelu.default)


def autocast_state(device: str) -> tuple[bool, torch.dtype | None]:
    """(enabled, dtype) of autocast on `device` now: what a cast made here must follow."""
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return True, torch.get_autocast_dtype(device)
    return False, None


class _KeepInputs(torch.autograd.Function):
    """Runs `fn(*tensors)` keeping only `tensors`; the backward runs it again and
    differentiates it (a fused kernel's contract: inputs in, nothing else kept)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], *tensors: torch.Tensor | None
                ) -> torch.Tensor:
        ctx.fn = fn
        ctx.mask = [t is not None for t in tensors]
        ctx.device = next(t.device.type for t in tensors if t is not None)
        ctx.autocast = autocast_state(ctx.device)
        ctx.save_for_backward(*(t for t in tensors if t is not None))
        return fn(*tensors)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kept = iter(ctx.saved_tensors)
        args = [next(kept) if present else None for present in ctx.mask]
        need = ctx.needs_input_grad[1:]
        leaves = [a.detach().requires_grad_(bool(n)) if a is not None else None
                  for a, n in zip(args, need, strict=True)]
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(ctx.device, dtype=dtype, enabled=enabled):
            y = ctx.fn(*leaves)
        wanted = [t for t, n in zip(leaves, need, strict=True) if n and t is not None]
        grads = iter(torch.autograd.grad(y, wanted, dy) if wanted else ())
        return (None, *(next(grads) if n and t is not None else None
                         for t, n in zip(leaves, need, strict=True)))


def rms_norm(x: torch.Tensor, shape: Sequence[int], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """`aten.rms_norm` keeping its input and weight only."""
    shape = list(shape)
    return _KeepInputs.apply(lambda a, w: _aten.rms_norm.default(a, shape, w, eps), x, weight)


def gated(a: torch.Tensor, b: torch.Tensor, act: Any, act_kwargs: tuple[tuple[str, Any], ...],
          act_first: bool) -> torch.Tensor:
    """`act(a, **act_kwargs) * b` (or `b * act(...)`) keeping `a` and `b` only."""
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = act(x, **dict(act_kwargs))
        return _aten.mul.Tensor(h, y) if act_first else _aten.mul.Tensor(y, h)

    return _KeepInputs.apply(fn, a, b)


class _Attention(torch.autograd.Function):
    """CPU flash attention with its output laid out [b, s, h, d] (returned as the usual
    [b, h, s, d] view), as CUDA's flash and memory-efficient kernels lay it out: the output
    projection's reshape then reads it in place, so one tensor is kept for both backwards
    (the CPU kernel's own [b, h, s, d] output made the reshape copy it)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, causal: bool, scale: float | None) -> torch.Tensor:
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, k, v, out, lse, 0.0, ctx.causal, attn_mask=mask, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """`scaled_dot_product_attention` on CPU (and meta) through `_Attention` where the flash
    kernel applies (4-d, no dropout, a mask that needs no gradient); cast as autocast casts
    SDPA's operands."""
    if dropout_p and q.dim() == 4 and q.device.type == "meta":  # measured as flash keeps it
        return _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    if (q.dim() != 4 or dropout_p or q.device.type not in _FLASH
            or (attn_mask is not None and attn_mask.requires_grad)):
        return _aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    enabled, dtype = autocast_state(q.device.type)
    if enabled and q.is_floating_point():
        q, k, v = (t.to(dtype) for t in (q, k, v))
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA: -inf where False
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device
                                ).masked_fill_(attn_mask.logical_not(), float("-inf"))
    elif attn_mask is not None:
        attn_mask = attn_mask.to(q.dtype)
    return _Attention.apply(q, k, v, attn_mask, is_causal, scale)


_FLASH = ("cpu", "meta")
"""Devices whose flash kernel returns [b, h, s, d] memory, which `attention` lays out."""
attention._piper_attention = True  # type: ignore[attr-defined]
"""`runtime.execute.selective.is_attention` knows it for the attention policy."""


def _tensor(n: Any) -> bool:
    return isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)


_VIEWS = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)


def _repeated_heads(arg: Any) -> tuple[fx.Node, bool, int] | None:
    """(source, transposed, repeats) where `arg`, a key or value of attention laid out
    [b, heads, s, d], copies each head of `source` `repeats` times in a row (`repeat_kv`:
    unsqueeze, expand, reshape; on [b, kv_heads, s, d], or on [b, s, kv_heads, d] and then
    transposed), each step read by nothing else; None where it is not such a copy."""
    if not _tensor(arg):
        return None
    n, transposed = arg, False
    if n.target is _aten.transpose.int and sorted(n.args[1:]) == [1, 2]:
        n, transposed = n.args[0], True
    if n.target not in _VIEWS or len(n.users) != 1:
        return None
    e = n.args[0]
    if not _tensor(e) or e.target is not _aten.expand.default or len(e.users) != 1:
        return None
    u = e.args[0]
    heads = 2 if transposed else 1  # the heads dim of the source's layout
    if (not _tensor(u) or u.target is not _aten.unsqueeze.default or len(u.users) != 1
            or u.args[1] != heads + 1 or not _tensor(u.args[0])):
        return None
    src = u.args[0]
    shape, big, out = (tuple(x.meta["val"].shape) for x in (src, e, n))
    rep = big[heads + 1] if len(big) == 5 else 0
    if (len(shape) != 4 or big[:heads + 1] != shape[:heads + 1]
            or big[heads + 2:] != shape[heads + 1:]
            or out != shape[:heads] + (shape[heads] * rep,) + shape[heads + 1:]):
        return None
    return src, transposed, rep


def _attend_grouped(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Attention reading copies of its keys' and values' heads (`_repeated_heads`) reads the
    grouped heads themselves (`enable_gqa`, the same values): the copies are neither made nor
    kept for the backward."""
    if len(n.args) < 3:
        return False
    k, v = (_repeated_heads(a) for a in n.args[1:3])
    if k is None or v is None or k[1:] != v[1:]:
        return False
    old = n.args[1:3]
    args = list(n.args)
    for i, (src, transposed, _) in ((1, k), (2, v)):
        if transposed:
            with gm.graph.inserting_before(n):
                t = gm.graph.call_function(_aten.transpose.int, (src, 1, 2))
            t.meta["val"] = src.meta["val"].transpose(1, 2)
            src = t
        args[i] = src
    n.args, n.kwargs = tuple(args), {**n.kwargs, "enable_gqa": True}
    for a in old:  # the copies, now unread
        chain = [a]
        while chain[-1].target is not _aten.unsqueeze.default:
            chain.append(chain[-1].args[0])
        for x in chain:
            gm.graph.erase_node(x)
    return True


def fuse_elementwise(gm: fx.GraphModule, device: torch.device | None = None) -> int:
    """Rewrite `gm` in place (see the module docstring); returns how many ops were fused.
    On a CPU or meta `device` attention also keeps its output in CUDA's layout
    (`attention`)."""
    fused = 0
    flash = device is not None and device.type in _FLASH
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is _aten.scaled_dot_product_attention.default:
            fused += _attend_grouped(gm, n)
            if flash:
                n.target = attention
                fused += 1
        elif n.target is _aten.rms_norm.default and _tensor(n.args[0]) and not n.kwargs:
            x, shape, *rest = n.args
            n.target, n.args = rms_norm, (x, shape, *rest)
            fused += 1
        elif n.target is _aten.mul.Tensor and len(n.args) == 2 and not n.kwargs:
            for i, act in enumerate(n.args):
                other = n.args[1 - i]
                if (isinstance(act, fx.Node) and act.op == "call_function"
                        and act.target in _ACTIVATIONS and len(act.users) == 1
                        and len(act.args) == 1
                        and _tensor(act.args[0]) and _tensor(other) and other is not act
                        and act.meta["val"].shape == n.meta.get("val", act.meta["val"]).shape
                        and other.meta["val"].shape == act.meta["val"].shape):
                    n.target = gated
                    n.args = (act.args[0], other, act.target, tuple(act.kwargs.items()),
                              i == 0)
                    gm.graph.erase_node(act)
                    fused += 1
                    break
    if fused:
        gm.recompile()
    return fused
