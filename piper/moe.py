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
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn

from piper import lanes
from piper.collectives import EP_GROUP, bound_group, wire_dtype


class Experts(nn.Module):
    """`num_experts` two-layer GELU MLPs, stacked so dimension 0 can be sharded."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.ep = 1  # set by `shard_experts`
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        nn.init.normal_(self.w1, std=1 / math.sqrt(dim))
        nn.init.normal_(self.w2, std=1 / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x: [T, dim] tokens; idx, gate: [T, k] chosen experts and their weights."""
        if torch.compiler.is_exporting():  # one node of fixed shape (see module docstring)
            return routed_experts_op(x, idx, gate, self.w1, self.w2, self.num_experts,
                                     self.ep)
        return routed_experts(x, idx, gate, self.w1, self.w2, self.num_experts, self.ep)


def routed_experts(x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, num_experts: int, ep: int) -> torch.Tensor:
    """sum_k gate[t, k] * FFN_{idx[t, k]}(x[t]) for every token t, each expert computing only
    the rows routed to it; with `ep` > 1 the experts are spread over the EP group (this rank
    holds `w1.shape[0]` of them) and the rows travel by `all_to_all_single`."""
    t, d = x.shape
    k = idx.shape[1]
    flat = idx.reshape(-1)
    meta = x.device.type == "meta"
    if meta:  # shapes only: a balanced router, rows already in expert order
        counts = _balanced(t * k, num_experts)
        order = torch.arange(t * k, device=x.device)
    else:
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows = x.index_select(0, order // k)  # [T*k, d], grouped by expert
    if ep == 1:
        out = grouped_ffn(rows, w1, w2, counts)
    elif meta:
        out = grouped_ffn(rows, w1, w2, _balanced(t * k, w1.shape[0]))
    else:
        out = _expert_parallel(rows, w1, w2, counts, ep)
    y = out.index_select(0, torch.argsort(order)) if not meta else out  # token-major again
    return (y.view(t, k, d) * gate.unsqueeze(-1)).sum(1)


routed_experts._piper_routed = True  # type: ignore[attr-defined]  # cost models


def _balanced(rows: int, experts: int) -> list[int]:
    base, extra = divmod(rows, experts)
    return [base + (1 if e < extra else 0) for e in range(experts)]


def grouped_ffn(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: list[int],
                grouped: bool | None = None) -> torch.Tensor:
    """Each expert's GELU MLP over its consecutive `counts[e]` rows: one grouped GEMM per
    layer (`torch._grouped_mm`) or one GEMM per expert. `grouped` None: grouped on a GPU
    where its alignment rule holds (on a CPU it is no faster than the loop:
    benchmarks/ep_vs_reference.py)."""
    if grouped is None:
        grouped = rows.device.type == "cuda"
    if grouped and _grouped_mm_fits(rows, w1, w2):
        offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        out = torch._grouped_mm(F.gelu(torch._grouped_mm(rows, w1, offs=offs)), w2, offs=offs)
        return _DenseGrad.apply(out)
    parts = rows.split(counts)
    return torch.cat([F.gelu(p @ w1[e]) @ w2[e] for e, p in enumerate(parts)])


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: `torch._grouped_mm`'s backward
    refuses an expanded one (the gradient of a sum, say)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def _grouped_mm_fits(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm wants one 32- or 16-bit float dtype and rows of a multiple of 16
    bytes."""
    if not hasattr(torch, "_grouped_mm") or rows.device.type == "meta":
        return False
    size = rows.element_size()
    return (rows.dtype == w1.dtype == w2.dtype
            and rows.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and rows.shape[-1] * size % 16 == 0
            and w1.shape[-1] * size % 16 == 0 and rows.is_contiguous())


def _expert_parallel(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     counts: list[int], ep: int) -> torch.Tensor:
    """Send each expert's rows to the rank holding it, run the local experts on what came
    from every rank, send the results back (rows in the order they left)."""
    group = bound_group(EP_GROUP)
    local = w1.shape[0]
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
    out = grouped_ffn(arrived.index_select(0, perm), w1, w2, got.sum(0).tolist())
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
@torch.library.custom_op("piper::routed_experts", mutates_args=())
def routed_experts_op(x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor,
                      w1: torch.Tensor, w2: torch.Tensor, num_experts: int, ep: int
                      ) -> torch.Tensor:
    """`routed_experts` as one op for tracing; a captured graph runs the eager function
    instead (`eager_experts`), which autograd differentiates."""
    with torch.no_grad():
        return routed_experts(x, idx, gate, w1, w2, num_experts, ep)


@routed_experts_op.register_fake
def _(x: torch.Tensor, idx: torch.Tensor, gate: torch.Tensor, w1: torch.Tensor,
      w2: torch.Tensor, num_experts: int, ep: int) -> torch.Tensor:
    return torch.empty_like(x)


def eager_experts(gm: fx.GraphModule) -> None:
    """Point every captured `piper::routed_experts` node at `routed_experts`, in place."""
    op = torch.ops.piper.routed_experts.default
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is op:
            n.target = routed_experts
            changed = True
    if changed:
        gm.recompile()


def routed_shapes(n: fx.Node) -> tuple[int, int, int, int, int, int] | None:
    """(tokens T, top-k, dim, hidden, local experts, ep) of a captured `routed_experts` node;
    None for any other node."""
    if not getattr(n.target, "_piper_routed", False):
        return None
    x, idx, _, w1 = (a.meta["val"] for a in n.args[:4])  # type: ignore[union-attr]
    return (int(x.shape[0]), int(idx.shape[1]), int(x.shape[1]), int(w1.shape[2]),
            int(w1.shape[0]), int(n.args[6]))  # type: ignore[arg-type]


def expert_modules(model: nn.Module) -> dict[str, Experts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Experts)}


def shard_experts(model: nn.Module, names: tuple[str, ...], degree: int, rank: int) -> None:
    """Keep rank `rank`'s E/degree experts of each named `Experts` module, in place."""
    if degree == 1:
        return
    modules = expert_modules(model)
    for name in names:
        m = modules[name]
        if m.num_experts % degree:
            raise ValueError(f"{name}: {m.num_experts} experts are not divisible by "
                             f"ep={degree}")
        with torch.no_grad():
            m.w1 = nn.Parameter(m.w1.chunk(degree, dim=0)[rank].clone())
            m.w2 = nn.Parameter(m.w2.chunk(degree, dim=0)[rank].clone())
        m.ep = degree
