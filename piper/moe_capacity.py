"""An expert capacity factor: routed rows over an expert's capacity are dropped.

GShard and Switch bound how many of a group's tokens each expert takes (its capacity,
`factor` x the group's routed rows / experts) and drop the rest: a dropped row adds nothing
to its token's output, which the residual path carries on. Megatron-Core's
`--moe-expert-capacity-factor` counts capacity over the tokens a rank routes and, by
default (`--moe-token-drop-policy probs`), keeps each expert's highest-gated rows.

Here the group is one sequence (`group` consecutive tokens): which rows are dropped then
depends on the sequence alone, not on how a strategy splits the batch into microbatches,
replicas or expert-parallel ranks, so every strategy with the same factor trains as
single-device training with it does (Megatron's own choice at one sequence per
microbatch). Each expert keeps at most ceil(factor x group x k / experts) rows of a
sequence: the highest-gated, ties to the earlier row. A dropped row leaves
`routed_experts` with expert id `experts` (none) and gate 0; it is neither sent nor
computed. The cost model prices the routed rows of a balanced router, which drops none at
a factor of 1 or more.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def capacity(factor: float, group: int, k: int, experts: int) -> int:
    """Rows of one group each expert keeps."""
    return math.ceil(factor * group * k / experts)


def capacity_keep(idx: torch.Tensor, gate: torch.Tensor, experts: int, factor: float,
                  group: int) -> torch.Tensor:
    """[T, k] bool: which routed rows (token t's k-th choice, expert idx[t, k], weight
    gate[t, k]) their expert keeps, each `group` consecutive tokens a group."""
    t, k = idx.shape
    if t % group:
        raise ValueError(f"capacity groups of {group} tokens do not divide the {t} tokens "
                         "the experts were given")
    n = group * k
    ids = idx.reshape(t // group, n)
    # rows by expert, within an expert by falling gate, ties by position (stable sorts)
    by_gate = torch.argsort(-gate.detach().reshape(t // group, n).float(), dim=1,
                            stable=True)
    order = by_gate.gather(1, torch.argsort(ids.gather(1, by_gate), dim=1, stable=True))
    sorted_ids = ids.gather(1, order)
    counts = torch.zeros(t // group, experts, dtype=torch.long, device=idx.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    first = counts.cumsum(1) - counts  # where each expert's rows start in `order`
    rank = torch.arange(n, device=idx.device) - first.gather(1, sorted_ids)
    kept = rank < capacity(factor, group, k, experts)
    return torch.empty_like(kept).scatter_(1, order, kept).reshape(t, k)


def apply_capacity(module: nn.Module, idx: torch.Tensor, gate: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, gate) with the rows over capacity dropped, for an experts module with a
    capacity (`limit_capacity`); as given otherwise."""
    limit = getattr(module, "piper_capacity", None)
    if limit is None:
        return idx, gate
    experts = int(module.num_experts)  # type: ignore[arg-type]
    keep = capacity_keep(idx, gate, experts, *limit)
    return (torch.where(keep, idx, torch.full_like(idx, experts)),
            gate * keep.to(gate.dtype))


def limit_capacity(model: nn.Module, names: Iterable[str], factor: float, group: int
                   ) -> None:
    """Give the experts modules `names` of `model` a capacity of `factor` per sequence of
    `group` tokens."""
    for name in names:
        model.get_submodule(name).piper_capacity = (float(factor), int(group))
