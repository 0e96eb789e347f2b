"""Routed experts written so expert parallelism can shard them: `piper.Experts`.

The documented way to write an MoE layer for piper-plan: route in ordinary PyTorch, then
hand the tokens, their top-k expert ids and gate weights to an `Experts` module, inside a
region of its own (by convention tagged `experts`):

    scores = self.router(x).softmax(-1)
    gate, idx = scores.topk(self.k, dim=-1)
    with piper.annotate("experts"):
        y = self.experts(x, idx, gate)

`Experts` stores its E feed-forward networks stacked (`w1: [E, dim, hidden]`,
`w2: [E, hidden, dim]`) and is dropless at the cost of the routed tokens (MegaBlocks,
Megatron-Core's token dispatcher): the T x k (token, expert) rows are sorted by expert, each
expert multiplies only its own rows (one grouped GEMM, `torch._grouped_mm`, where the shapes
allow it, else a loop over the experts), and the results go back to their tokens, weighted
by the gates. Under `Shard(..., degree=ep)` each rank keeps E/ep experts; the ranks first
exchange how many rows each sends each expert, then `all_to_all_single` with those split
sizes carries exactly the routed rows there and back. The arithmetic per token is the same
on one device or many, which is what makes EP loss-equivalent to single-device training.

The shapes inside depend on the routing, but not those at the module's boundary ([T, dim]
in and out): traced, the module is one custom op (`piper::routed_experts`) whose fake
implementation gives that shape, so the graph captures once; `eager_experts` then points the
captured node at `routed_experts`, which runs the data-dependent work with autograd. On meta
tensors (cost models) it assumes a perfectly balanced router.

Any module with an `ExpertFFN` (`piper_ffn`: which stacked parameters, which activation)
and a `num_experts` routes the same way through `routed_forward`: `piper.hf_experts` gives
the experts modules of unmodified Hugging Face MoE models one.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn

from piper import lanes
from piper.collectives import (
    EP_GROUP,
    TP_GROUP,
    bound_group,
    sp_gather,
    sp_gather_whole,
    sp_scatter,
    sp_split,
    tp_copy,
    tp_reduce,
    wire_dtype,
)
from piper.moe_capacity import apply_capacity


@dataclass(frozen=True)
class ExpertFFN:
    """How each expert of a stacked experts module computes, over the module's parameters
    stacked by expert (dimension 0): `activate(rows @ up + up_bias) @ down + down_bias`.

    `piper.Experts` is one (a GELU MLP); a Hugging Face experts module is another (its
    `gate_up_proj`/`down_proj`, its own gate and activation: `piper.hf_experts`). Any module
    with a `piper_ffn` and a `num_experts` routes through `routed_forward`."""

    weights: tuple[str, ...]
    """The module's stacked parameters in call order: up, down, then up's and down's bias."""
    activate: Callable[[torch.Tensor], torch.Tensor]
    """Applied to the up projection's rows (a gated FFN splits them into gate and up)."""
    transposed: bool = True
    """Weights as [E, in, out] (rows @ W); False: [E, out, in] (F.linear, as nn.Linear)."""
    bias: bool = False
    halves: int = 1
    """Parts the up projection's hidden dimension is stacked from: 2 for a gate and an up
    one after the other ([gate; up]), each split in its own half by expert tensor
    parallelism; 1 otherwise (an interleaved gate keeps its pairs in any contiguous cut)."""

    @property
    def hidden_dims(self) -> tuple[int, int]:
        """The hidden dimension of the stacked up and down weights (expert tensor
        parallelism cuts there: up by its outputs, down by its inputs)."""
        return (2, 1) if self.transposed else (1, 2)

    def widths(self, up: torch.Tensor, down: torch.Tensor) -> tuple[int, int]:
        """(up's output width, down's input width) of stacked weights: what each routed row
        multiplies, 2 * dim * (up + down) FLOPs."""
        if self.transposed:
            return int(up.shape[2]), int(down.shape[1])
        return int(up.shape[1]), int(down.shape[2])


GELU_MLP = ExpertFFN(("w1", "w2"), F.gelu)


class Experts(nn.Module):
    """`num_experts` two-layer GELU MLPs, stacked so dimension 0 can be sharded."""

    piper_ffn = GELU_MLP

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        nn.init.normal_(self.w1, std=1 / math.sqrt(dim))
        nn.init.normal_(self.w2, std=1 / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] tokens; idx, gate: [T, k] chosen experts and their weights."""
        return routed_forward(self, x, idx, gate)


def routed_forward(module: nn.Module, x: torch.Tensor, idx: torch.Tensor,
                   gate: torch.Tensor) -> torch.Tensor:
    """The forward of any routed experts module (`piper_ffn`, `num_experts`; `piper_ep`,
    `piper_etp` once `shard_experts` split it): traced, one node of fixed shape (see the
    module docstring).

    Under expert tensor parallelism each TP rank holds 1/etp of every local expert's hidden
    features, so its rows come out as partial sums: the tokens enter as a column-parallel
    layer's input does (f; with sequence parallelism, each rank's share gathered) and
    leave as a row-parallel layer's output (g; with sequence parallelism, reduce-scattered
    back to each rank's share). When the EP group spans the TP ranks (`piper_ep_tp`), which
    then hold different experts, each TP rank routes its own tokens: with sequence
    parallelism it has them already; without, it takes its 1/tp of them and the outputs
    are gathered whole again."""
    ffn: ExpertFFN = module.piper_ffn  # type: ignore[assignment]
    idx, gate = apply_capacity(module, idx, gate)  # whole sequences here (`moe_capacity`)
    etp, sp = int(getattr(module, "piper_etp", 1)), bool(getattr(module, "piper_sp", False))
    spans = int(getattr(module, "piper_ep_tp", 1))
    if spans > 1 and not sp:  # TP ranks hold the same tokens: each routes its share
        x, idx, gate = (sp_split(t.unsqueeze(0), TP_GROUP, spans).squeeze(0)
                        for t in (x, idx, gate))
    if etp > 1 and sp:
        x, idx, gate = (sp_gather(t.unsqueeze(0), TP_GROUP, etp).squeeze(0)
                        for t in (x, idx, gate))
    elif etp > 1:
        x, gate = tp_copy(x, TP_GROUP), tp_copy(gate, TP_GROUP)
    weights = [getattr(module, n) for n in ffn.weights]
    experts, ep = int(module.num_experts), int(getattr(module, "piper_ep", 1))
    if torch.compiler.is_exporting():
        key = f"{type(module).__qualname__}@{id(module):x}"
        _LIVE[key] = module
        out = routed_experts_op(x, idx, gate, weights, experts, ep, key)
    else:
        out = routed_experts(x, idx, gate, weights, experts, ep, ffn)
    if spans > 1 and not sp:
        return sp_gather_whole(out.unsqueeze(0), TP_GROUP, spans).squeeze(0)
    if etp > 1 and sp:
        return sp_scatter(out.unsqueeze(0), TP_GROUP, etp).squeeze(0)
    return tp_reduce(out, TP_GROUP) if etp > 1 else out


def routed_experts(x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor,
                   weights: Sequence[torch.Tensor], num_experts: int, ep: int,
                   ffn: ExpertFFN = GELU_MLP) -> torch.Tensor:
    """sum_k gate[t, k] * FFN_{idx[t, k]}(x[t]) for every token t, each expert computing only
    the rows routed to it; with `ep` > 1 the experts are spread over the EP group (this rank
    holds `weights[0].shape[0]` of them) and the rows travel by `all_to_all_single`. A row
    routed to expert `num_experts` (over capacity: `piper.moe_capacity`) is dropped."""
    t, d = x.shape
    k = idx.shape[1]
    flat = idx.reshape(-1)
    meta = x.device.type == "meta"
    if meta:  # shapes only: a balanced router, rows already in expert order
        counts = _balanced(t * k, num_experts)
        order = torch.arange(t * k, device=x.device)
    else:
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts + 1).tolist()
        if counts.pop():  # dropped rows sort last: leave them out
            order = order[:sum(counts)]
    rows = x.index_select(0, order // k)  # [T*k, d], grouped by expert
    if ep == 1:
        out = grouped_ffn(rows, weights, counts, ffn)
    elif meta:
        out = grouped_ffn(rows, weights, _balanced(t * k, weights[0].shape[0]), ffn)
    else:
        out = _expert_parallel(rows, weights, counts, ep, ffn)
    if meta:
        y = out
    elif len(order) < t * k:  # dropped rows give nothing
        y = out.new_zeros(t * k, d).index_copy(0, order, out)
    else:  # token-major again
        y = out.index_select(0, torch.argsort(order))
    # gate weights may be wider than the rows (a router's fp32 softmax): sum, then cast back
    return (y.view(t, k, d) * gate.unsqueeze(-1)).sum(1).to(x.dtype)


def _balanced(rows: int, experts: int) -> list[int]:
    base, extra = divmod(rows, experts)
    return [base + (1 if e < extra else 0) for e in range(experts)]


def grouped_ffn(rows: torch.Tensor, weights: Sequence[torch.Tensor], counts: list[int],
                ffn: ExpertFFN = GELU_MLP, grouped: bool | None = None) -> torch.Tensor:
    """Each expert's FFN over its consecutive `counts[e]` rows: one grouped GEMM per
    projection (`torch._grouped_mm`) or one GEMM per expert. `grouped` None: grouped on a
    GPU where its alignment rule holds (on a CPU it is no faster than the loop:
    benchmarks/ep_vs_reference.py)."""
    if grouped is None:
        grouped = rows.device.type == "cuda"
    if grouped and _grouped_mm_fits(rows, weights):
        offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        sizes = torch.tensor(counts, device=rows.device)
        up, down, *biases = weights
        h = _grouped(rows, up, offs, ffn.transposed)
        if ffn.bias:
            h = h + biases[0].repeat_interleave(sizes, dim=0, output_size=rows.shape[0])
        out = _grouped(ffn.activate(h), down, offs, ffn.transposed)
        if ffn.bias:
            out = out + biases[1].repeat_interleave(sizes, dim=0, output_size=rows.shape[0])
        return _DenseGrad.apply(out)
    parts = rows.split(counts)
    return torch.cat([_one_expert(p, [w[e] for w in weights], ffn)
                      for e, p in enumerate(parts)])


def _one_expert(rows: torch.Tensor, w: list[torch.Tensor], ffn: ExpertFFN) -> torch.Tensor:
    """One expert's FFN on its rows, as the model's own loop over experts computes it."""
    def project(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return h @ weight if ffn.transposed else F.linear(h, weight)

    h = project(rows, w[0])
    if ffn.bias:
        h = h + w[2]
    out = project(ffn.activate(h), w[1])
    return out + w[3] if ffn.bias else out


def _grouped(h: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, transposed: bool
             ) -> torch.Tensor:
    return torch._grouped_mm(h, w if transposed else w.transpose(-2, -1), offs=offs)


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: `torch._grouped_mm`'s backward
    refuses an expanded one (the gradient of a sum, say)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def _grouped_mm_fits(rows: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """torch._grouped_mm wants one 32- or 16-bit float dtype and rows (of every operand) of
    a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm") or rows.device.type == "meta":
        return False
    size = rows.element_size()
    mats = weights[:2]
    return (all(w.dtype == rows.dtype for w in weights)
            and rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and rows.shape[-1] * size % 16 == 0
            and all(s * size % 16 == 0 for w in mats for s in w.shape[1:])
            and rows.is_contiguous())


def _expert_parallel(rows: torch.Tensor, weights: Sequence[torch.Tensor], counts: list[int],
                     ep: int, ffn: ExpertFFN) -> torch.Tensor:
    """Send each expert's rows to the rank holding it, run the local experts on what came
    from every rank, send the results back (rows in the order they left)."""
    group = bound_group(EP_GROUP)
    local = weights[0].shape[0]
    sent = torch.tensor(counts, dtype=torch.int64).view(ep, local)  # to rank r, expert j
    got = torch.empty_like(sent)
    with lanes.waiting():  # the per-expert counts first: they size the row exchange
        dist.all_to_all_single(got, sent, group=group)
    send = sent.sum(1).tolist()
    recv = got.sum(1).tolist()
    arrived = _exchange(rows, recv, send)  # by source rank, each by local expert
    # regroup by local expert (all sources' rows of expert 0, then expert 1, ...)
    starts = [0, *torch.tensor(recv).cumsum(0).tolist()]
    within = got.cumsum(1) - got  # offset of expert j's rows inside source s's block
    perm = torch.cat([torch.arange(starts[s] + int(within[s, j]),
                                   starts[s] + int(within[s, j]) + int(got[s, j]))
                      for j in range(local) for s in range(ep)]).to(rows.device)
    out = grouped_ffn(arrived.index_select(0, perm), weights, got.sum(0).tolist(), ffn)
    return _exchange(out.index_select(0, torch.argsort(perm)), send, recv)

def _exchange(x: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
    """`all_to_all_single` with split sizes, differentiable (its backward is the reverse
    exchange), on the wire in the training's collective dtype."""
    wire = wire_dtype()
    src = x if wire is None or not x.is_floating_point() else x.to(wire)
    return _AllToAll.apply(src.contiguous(), recv, send).to(x.dtype)


class _AllToAll(torch.autograd.Function):
    """Rows `send[r]` to rank r, `recv[r]` from it; backward sends the gradients back the
    same way. Each direction runs over the EP communicator of the lane that runs it (an
    overlapped pair's backward may run on the other lane than its forward) and waits as
    in-graph collectives do (`lanes.waiting`), so the other lane computes meanwhile."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recv: list[int], send: list[int]
                ) -> torch.Tensor:
        ctx.recv, ctx.send = recv, send
        return _all_to_all(x, recv, send)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        return _all_to_all(g.contiguous(), ctx.send, ctx.recv), None, None


def _all_to_all(x: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    group = bound_group(EP_GROUP)
    with lanes.waiting():
        dist.all_to_all_single(out, x, recv, send, group=group)
    return out


# ---- capture: one node of fixed shape -------------------------------------------------
_LIVE: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
"""Routed experts modules traced in this process, by the key their node carries: the
module says how its experts compute (`piper_ffn`), which a graph cannot hold as an op
argument."""


@torch.library.custom_op("piper::routed_experts", mutates_args=())
def routed_experts_op(x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor,
                      weights: list[torch.Tensor], num_experts: int, ep: int, module: str
                      ) -> torch.Tensor:
    """`routed_experts` of the traced module `module` (a key of `_LIVE`) as one op; a
    captured graph runs the eager function instead (`eager_experts`), which autograd
    differentiates."""
    with torch.no_grad():
        return routed_experts(x, idx, gate, weights, num_experts, ep,
                              _LIVE[module].piper_ffn)  # type: ignore[arg-type]


@routed_experts_op.register_fake
def _(x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor, weights: list[torch.Tensor],
      num_experts: int, ep: int, module: str) -> torch.Tensor:
    return torch.empty_like(x)


class RoutedCall:
    """What a captured routed-experts node calls: `routed_experts` with its module's FFN."""

    __name__ = "routed_experts"
    _piper_routed = True  # cost models find the node by this

    def __init__(self, ffn: ExpertFFN) -> None:
        self.ffn = ffn

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor,
                 weights: Sequence[torch.Tensor], num_experts: int, ep: int) -> torch.Tensor:
        return routed_experts(x, idx, gate, weights, num_experts, ep, self.ffn)


def eager_experts(gm: fx.GraphModule) -> None:
    """Point every captured `piper::routed_experts` node at its module's `routed_experts`,
    in place."""
    op = torch.ops.piper.routed_experts.default
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is op:
            n.target = RoutedCall(_LIVE[n.args[6]].piper_ffn)  # type: ignore[arg-type]
            n.args = n.args[:6]
            changed = True
    if changed:
        gm.recompile()


class RoutedShapes(NamedTuple):
    """A captured routed-experts node's sizes: what its GEMMs and exchanges cost."""

    tokens: int
    k: int
    dim: int
    up: int  # the up projection's output width (2 x hidden for a gated FFN)
    down: int  # the down projection's input width (hidden)
    local: int  # experts held by this rank
    ep: int


def routed_shapes(n: fx.Node) -> RoutedShapes | None:
    """The sizes of a captured routed-experts node; None for any other node."""
    if not getattr(n.target, "_piper_routed", False):
        return None
    x, idx = (a.meta["val"] for a in n.args[:2])  # type: ignore[union-attr]
    up, down = (w.meta["val"] for w in n.args[3][:2])  # type: ignore[index, union-attr]
    wide_up, wide_down = n.target.ffn.widths(up, down)  # type: ignore[union-attr]
    return RoutedShapes(int(x.shape[0]), int(idx.shape[1]), int(x.shape[1]), wide_up,
                        wide_down, int(up.shape[0]), int(n.args[5]))  # type: ignore[arg-type]


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The routed experts modules of `model` (those with a `piper_ffn`), by name."""
    return {n: m for n, m in model.named_modules()
            if isinstance(getattr(m, "piper_ffn", None), ExpertFFN)}


def expert_params(names: Iterable[str], params: Iterable[str]) -> set[str]:
    """Of parameter names `params`, those stacked by expert: every parameter an experts
    module named in `names` holds itself."""
    owners = set(names)
    return {p for p in params if p.rpartition(".")[0] in owners}


def shard_experts(model: nn.Module, names: tuple[str, ...], degree: int, rank: int,
                  etp: int = 1, tp_rank: int = 0, sequence_parallel: bool = False,
                  spans_tp: int = 1) -> None:
    """Keep rank `rank`'s E/degree experts of each named experts module, in place, and with
    expert tensor parallelism (`etp` > 1) TP rank `tp_rank`'s 1/etp of their hidden
    features (Megatron's expert tensor parallelism: up split by outputs, down by inputs).
    `spans_tp` > 1: the EP group spans that many TP ranks, which hold different experts
    (Megatron's expert mesh)."""
    if degree == 1 and etp == 1:
        return
    if spans_tp > 1 and etp > 1:
        raise ValueError("an EP group over the tensor-parallel ranks holds experts whole: "
                         "expert tensor parallelism must be 1")
    modules = expert_modules(model)
    for name in names:
        m = modules[name]
        if m.num_experts % degree:
            raise ValueError(f"{name}: {m.num_experts} experts are not divisible by "
                             f"ep={degree}")
        ffn: ExpertFFN = m.piper_ffn  # type: ignore[assignment]
        cuts = dict(expert_cuts(ffn)) if etp > 1 else {}
        if etp > 1 and ffn.bias:
            raise ValueError(f"{name}: expert tensor parallelism of experts with biases is "
                             "not supported")
        with torch.no_grad():
            for p, w in list(m.named_parameters(recurse=False)):
                w = w.chunk(degree, dim=0)[rank]
                if p in cuts:
                    w = hidden_slice(w, *cuts[p], etp, tp_rank, f"{name}.{p}")
                setattr(m, p, nn.Parameter(w.clone()))
        m.piper_ep = degree
        if etp > 1 or spans_tp > 1:
            m.piper_etp, m.piper_sp, m.piper_ep_tp = etp, sequence_parallel, spans_tp
            m.tp_split = True  # its parameters differ per TP rank: not replicated over TP


def expert_cuts(ffn: ExpertFFN) -> tuple[tuple[str, tuple[int, int]], ...]:
    """Where expert tensor parallelism cuts an FFN's stacked weights: parameter name ->
    (hidden dimension, halves)."""
    up_dim, down_dim = ffn.hidden_dims
    return ((ffn.weights[0], (up_dim, ffn.halves)), (ffn.weights[1], (down_dim, 1)))


def hidden_slice(w: torch.Tensor, dim: int, halves: int, parts: int, index: int,
                 name: str = "") -> torch.Tensor:
    """Part `index` of `parts` of `w`'s dimension `dim`, cut in each of its `halves`."""
    if w.shape[dim] % (halves * parts):
        raise ValueError(f"{name}: hidden size {w.shape[dim] // halves} is not divisible by "
                         f"etp={parts}")
    return torch.cat([h.chunk(parts, dim)[index] for h in w.chunk(halves, dim)], dim)
