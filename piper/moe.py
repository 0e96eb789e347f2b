"""Routed experts written so expert parallelism can shard them: `piper.Experts`.

The documented way to write an MoE layer for piper-plan: route in ordinary PyTorch, then
hand the tokens, their top-k expert ids and gate weights to an `Experts` module, inside a
region of its own (by convention tagged `experts`):

    scores = self.router(x).softmax(-1)
    gate, idx = scores.topk(self.k, dim=-1)
    with piper.annotate("experts"):
        y = self.experts(x, idx, gate)

`Experts` stores its E feed-forward networks stacked (`w1: [E, dim, hidden]`,
`w2: [E, hidden, dim]`) and runs them on a fixed-shape dispatch buffer `[E, C, dim]`, C the
token count, so nothing is ever dropped and every shape is static (the graph captures once).
Under `Shard(..., degree=ep)` each rank keeps E/ep experts; an all-to-all sends every
expert's rows to the rank that holds it and a second one brings the results back. The
arithmetic per token is the same either way, which is what makes EP loss-equivalent to
single-device training.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from piper.collectives import EP_GROUP, all_to_all


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
        t, d = x.shape
        k = idx.shape[1]
        e, c = self.num_experts, t
        chosen = idx.reshape(-1)  # [T*k], token-major
        onehot = F.one_hot(chosen, e)
        rank_in_expert = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # arrival order
        slot = chosen * c + rank_in_expert  # a unique row of the [E*C] buffer
        rows = x.repeat_interleave(k, dim=0)
        buf = x.new_zeros(e * c, d).index_add(0, slot, rows).view(e, c, d)
        out = self._local(self._exchange(buf)) if self.ep > 1 else self._ffn(buf)
        y = out.reshape(e * c, d).index_select(0, slot).view(t, k, d)
        return (y * gate.unsqueeze(-1)).sum(1)

    def _ffn(self, buf: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.gelu(torch.bmm(buf, self.w1)), self.w2)

    def _exchange(self, buf: torch.Tensor) -> torch.Tensor:
        """[E, C, d] by expert -> [E/ep, ep*C, d]: this rank's experts, rows from every rank."""
        e, c, d = buf.shape
        got = all_to_all(buf, EP_GROUP).view(self.ep, e // self.ep, c, d)
        return got.transpose(0, 1).reshape(e // self.ep, self.ep * c, d)

    def _local(self, buf: torch.Tensor) -> torch.Tensor:
        """Run the local experts, then send each source rank its rows back: [E, C, d]."""
        el, rows, d = buf.shape
        out = self._ffn(buf).view(el, self.ep, rows // self.ep, d).transpose(0, 1)
        return all_to_all(out.reshape(self.ep * el, rows // self.ep, d), EP_GROUP)


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
