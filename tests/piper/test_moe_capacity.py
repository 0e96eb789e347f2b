"""A capacity factor: each expert keeps at most its capacity of every sequence's routed
rows, the highest-gated; the dropped rows are neither computed nor sent."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from piper.moe import routed_experts
from piper.moe_capacity import capacity, capacity_keep

S, K, D, H, E = 8, 2, 8, 16, 4


def _kept_by_hand(idx: torch.Tensor, gate: torch.Tensor, factor: float) -> torch.Tensor:
    """Row by row: per sequence and expert, the rows by falling gate then position."""
    keep = torch.zeros_like(idx, dtype=torch.bool)
    limit = math.ceil(factor * S * K / E)
    for s0 in range(0, idx.shape[0], S):
        for e in range(E):
            rows = [(-float(gate[t, j]), (t, j)) for t in range(s0, s0 + S) for j in range(K)
                    if idx[t, j] == e]
            for _, (t, j) in sorted(rows)[:limit]:
                keep[t, j] = True
    return keep


def _routing(sequences: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # a skewed router: expert 0 is everybody's first choice, so it overflows
    idx = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long),
                                  1 + torch.randperm(E - 1, generator=g)[:K - 1]])
                       for _ in range(sequences * S)])
    gate = torch.rand(sequences * S, K, generator=g, dtype=torch.float64)
    gate[3, 0] = gate[5, 0]  # a tie: the earlier row wins
    return idx, gate


def test_each_expert_keeps_its_highest_gated_rows_of_each_sequence() -> None:
    idx, gate = _routing(3)
    for factor in (0.5, 1.0, 1.5):
        keep = capacity_keep(idx, gate, E, factor, S)
        assert torch.equal(keep, _kept_by_hand(idx, gate, factor))
    keep = capacity_keep(idx, gate, E, 1.0, S)
    assert capacity(1.0, S, K, E) == 4 and int(keep[:S, 0].sum()) == 4  # expert 0 full
    # a sequence's drops depend on that sequence alone (microbatching cannot change them)
    assert torch.equal(capacity_keep(idx[S:2 * S], gate[S:2 * S], E, 1.0, S), keep[S:2 * S])


def test_dropped_rows_add_nothing_and_cost_nothing() -> None:
    g = torch.Generator().manual_seed(1)
    idx, gate = _routing(2)
    x = torch.randn(2 * S, D, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, D, H, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, H, D, generator=g, dtype=torch.float64)
    keep = capacity_keep(idx, gate, E, 1.0, S)
    dropped = torch.where(keep, idx, torch.full_like(idx, E))
    with FlopCounterMode(display=False) as counter:
        y = routed_experts(x, dropped, gate * keep, [w1, w2], E, 1)
    mm = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    assert mm == 2 * int(keep.sum()) * D * H * 2  # the kept rows' two GEMMs only
    want = torch.stack([sum((gate[t, j] * (F.gelu(x[t] @ w1[idx[t, j]]) @ w2[idx[t, j]])
                             for j in range(K) if keep[t, j]), torch.zeros(D,
                                                                           dtype=x.dtype))
                        for t in range(2 * S)])
    torch.testing.assert_close(y, want)
