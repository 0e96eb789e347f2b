"""Deferred weight gradients: the W half of a split backward without a second graph walk.

Zero-bubble schedules run a stage's backward in two tasks: I (gradients of the stage's
inputs, which the previous stage waits for) and W (weight gradients, which only the update
needs). Walking the autograd graph twice costs about a backward more. Instead, the stage
module's matmuls against parameters go through `_WeightMatmul`, whose backward returns the
input gradient at once and, while a `WeightGradStore` is collecting, keeps (input, output
gradient) for later: I is then one walk that computes everything except those products, and
W is the products alone (dW = x^T·dy, db = Σdy), with no graph and no parameters needed —
which is why ZeRO-3 may free the gathered parameters right after I.

Handled: `aten.linear` (weight and optional bias), `aten.matmul` / `aten.mm` with a 2-D
weight on the right, `aten.bmm` with a stacked weight on the right (experts), whenever the
weight is a parameter input of the stage module, and the linears `runtime.execute.regather` rewrote
(which keep their input's sequence slice and gather it again in I). Every other parameter
gradient is computed by I's walk, as ordinary autograd computes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.utils.weak import WeakIdKeyDictionary

from piper.collectives import sp_gather
from runtime.execute.fused import autocast_state
from runtime.execute.zero import storage_key

_local = threading.local()

# op -> how its weight (argument 1) enters: y = x·Wᵀ (+ b), y = x·W, y = x ⊙bmm W
_OPS = {
    torch.ops.aten.linear.default: "linear",
    torch.ops.aten.matmul.default: "matmul",
    torch.ops.aten.mm.default: "matmul",
    torch.ops.aten.bmm.default: "bmm",
}


class WeightGradStore:
    """One microbatch's deferred products: (kind, weight key, bias key, x, dy).

    Keys are the stage module's input positions of the weight and bias (-1: no bias, or a
    bias whose gradient I computed). `volatile` holds the storages that will be freed before
    W runs (ZeRO-3's gathered parameters): an input living there is not deferred.
    """

    def __init__(self, volatile: tuple[int, ...] = ()) -> None:
        self.volatile = frozenset(volatile)
        self.entries: list[tuple[str, int, int, torch.Tensor, torch.Tensor]] = []

    def add(self, kind: str, wkey: int, bkey: int, x: torch.Tensor, dy: torch.Tensor) -> None:
        self.entries.append((kind, wkey, bkey, x, dy))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self.entries for t in e[3:])

    def add_to(self, grad_of: Callable[[int], torch.Tensor | None],
               set_grad: Callable[[int, torch.Tensor], None]) -> None:
        """W: add every deferred weight and bias gradient into `grad_of(input position)`,
        or hand it to `set_grad` where there is none yet, releasing each entry's tensors as
        it goes. A product is summed inside its GEMM (addmm_, beta = 1): no temporary the
        size of the weight and no second pass over the gradient, about 8% of a weight
        product on CPU."""
        while self.entries:
            kind, wkey, bkey, x, dy = self.entries.pop(0)
            for key, grad in ((wkey, partial(_weight_grad, kind, x, dy)),
                              (bkey, partial(_bias_grad, dy))):
                if key < 0:
                    continue
                into = grad_of(key)
                if into is None:
                    set_grad(key, grad())
                elif into.dtype != dy.dtype:  # autocast: a low-precision product, added
                    into.add_(grad())
                else:
                    grad(into)


@contextmanager
def collecting(store: WeightGradStore | None) -> Iterator[None]:
    """Forwards run inside defer their weight products to `store` (None: compute them in
    the backward as usual)."""
    before = getattr(_local, "store", None)
    _local.store = store
    try:
        yield
    finally:
        _local.store = before


@contextmanager
def shared_casts() -> Iterator[None]:
    """Inside, `weight_matmul` casts each parameter (a leaf) once and every later forward
    on this thread reuses that cast, as autocast's own cache does for the ATen matmuls while
    an autocast region encloses them (`runtime.execute.chunk_math.ChunkMath.step_casts`):
    one low-precision copy per step instead of one per microbatch in flight."""
    before = getattr(_local, "casts", None)
    _local.casts = WeakIdKeyDictionary()
    try:
        yield
    finally:
        _local.casts = before


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    casts = getattr(_local, "casts", None)
    if casts is None or t.dtype == dtype or not (t.is_leaf and t.requires_grad):
        return t.to(dtype)
    hit = casts.get(t)
    if hit is None or hit.dtype != dtype:
        hit = casts[t] = t.to(dtype)
    return hit


def current_store() -> WeightGradStore | None:
    """The store forwards on this thread defer to now (a recompute collects into it again)."""
    return getattr(_local, "store", None)


def _weight_grad(kind: str, x: torch.Tensor, dy: torch.Tensor,
                 into: torch.Tensor | None = None) -> torch.Tensor:
    """dW of one matmul: new, or added into `into` by the GEMM itself."""
    if kind == "bmm":
        a, b = x.transpose(1, 2), dy
        return a.bmm(b) if into is None else into.baddbmm_(a, b)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    a, b = (dy2.t(), x2) if kind == "linear" else (x2.t(), dy2)  # W is (out, in) / (in, out)
    return a.mm(b) if into is None else into.addmm_(a, b)


def _bias_grad(dy: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """db of one linear: new, or added into `into`."""
    db = dy.reshape(-1, dy.shape[-1]).sum(0)
    return db if into is None else into.add_(db)


def _input_grad(kind: str, dy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if kind == "linear":
        return dy.matmul(w)
    if kind == "bmm":
        return dy.bmm(w.transpose(1, 2))
    return dy.matmul(w.t())


class Regather:
    """A sequence slice that the linears reading its gather (q, k and v) keep once and gather
    once again in backward: the first to ask gathers, the last to ask lets it go. Under
    autocast they also share the slice's cast (one low-precision copy kept, not one each)."""

    def __init__(self, group: int, degree: int, users: int) -> None:
        self.group, self.degree, self.left = group, degree, users
        self.kept: tuple[torch.Tensor, torch.Tensor] | None = None  # (slice, its cast)
        self.full: torch.Tensor | None = None

    def cast(self, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.kept is None or self.kept[0] is not shard or self.kept[1].dtype != dtype:
            self.kept = (shard, shard.detach().to(dtype))
        return self.kept[1]

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        full = self.full if self.full is not None else sp_gather(shard, self.group, self.degree)
        self.left -= 1
        self.full = full if self.left > 0 else None
        return full


def regather(group: int, degree: int, users: int) -> Regather:
    """What a rewritten stage module calls once per forward for a shared gather."""
    return Regather(group, degree, users)


class _WeightMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, kind: str, x: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None, wkey: int, bkey: int, shard: torch.Tensor | None,
                again: Regather | None) -> torch.Tensor:
        store = getattr(_local, "store", None) if wkey >= 0 else None
        kept = x if shard is None else shard
        if store is not None and storage_key(kept) in store.volatile:
            store = None  # x is freed before W could read it
        ctx.kind, ctx.store, ctx.keys = kind, store, (wkey, bkey if b is not None else -1)
        ctx.again = again
        ctx.save_for_backward(kept, w)  # with a shard: 1/t of x, gathered again in backward
        if kind == "linear":
            return F.linear(x, w, b)
        return x.bmm(w) if kind == "bmm" else x.matmul(w)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        _, need_x, need_w, need_b, *_ = ctx.needs_input_grad
        dx = _input_grad(ctx.kind, dy, w) if need_x else None
        if ctx.again is not None and (need_w or ctx.store is not None):
            x = ctx.again.gathered(x)
        if ctx.store is not None:
            ctx.store.add(ctx.kind, *ctx.keys, x, dy)  # W adds dW (and db) into the grads
            return None, dx, None, None, None, None, None, None
        dw = _weight_grad(ctx.kind, x, dy) if need_w else None
        db = _bias_grad(dy) if need_b else None
        return None, dx, dw, db, None, None, None, None


def weight_matmul(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  wkey: int, bkey: int, shard: torch.Tensor | None = None,
                  again: Regather | None = None) -> torch.Tensor:
    """What a rewritten stage module calls in place of a matmul against a parameter. Under
    autocast its operands are cast as autocast would cast a matmul's (autograd records the
    casts, so gradients reach fp32 parameters as fp32).

    `shard`: x is the sequence gather of `shard`, which backward gathers again (`again`)
    rather than keeping x (`runtime.execute.regather`). A negative `wkey`: never deferred to W."""
    enabled, dt = autocast_state(x.device.type)
    if enabled:
        x, w = x.to(dt), _cast(w, dt)
        b = None if b is None else b.to(dt)
        if shard is not None and again is not None:
            shard = again.cast(shard, dt)
    return _WeightMatmul.apply(kind, x, w, b, wkey, bkey, shard, again)


def defer_weight_grads(gm: fx.GraphModule, params: set[int]) -> tuple[fx.GraphModule, int]:
    """A copy of `gm` whose matmuls against parameter inputs (positions in `params`) call
    `weight_matmul`; also returns how many it rewrote. Shapes come from the nodes' meta
    (`val`), so a matmul whose operands are not as handled is left alone."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    position = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    rewritten = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.kwargs:
            continue
        if n.target is weight_matmul:  # a regathered linear (`runtime.execute.regather`)
            (kind, x, w, b, wkey), rest = n.args[:5], n.args[6:]
            if wkey >= 0:
                continue
        elif n.target in _OPS and len(n.args) >= 2:
            kind, x, w, rest = _OPS[n.target], n.args[0], n.args[1], ()
            b = n.args[2] if len(n.args) > 2 else None
        else:
            continue
        wkey = position.get(w, -1) if isinstance(w, fx.Node) else -1
        if wkey not in params or not _shapes_fit(kind, x, w):
            continue
        bkey = position.get(b, -1) if isinstance(b, fx.Node) else -1
        if b is not None and bkey not in params:
            continue  # a computed bias: leave the whole op to autograd
        n.target = weight_matmul
        n.args = (kind, x, w, b, wkey, bkey, *rest)
        rewritten += 1
    graph.lint()
    return fx.GraphModule(gm, graph), rewritten


def _shapes_fit(kind: str, x: Any, w: fx.Node) -> bool:
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    wv = w.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor):
        return False
    if not (xv.is_floating_point() and wv.is_floating_point()):
        return False
    if kind == "bmm":
        return xv.dim() == 3 and wv.dim() == 3
    if kind == "linear":
        return wv.dim() == 2 and xv.dim() >= 1
    return wv.dim() == 2 and xv.dim() >= 2  # x @ W: rows of x times W
