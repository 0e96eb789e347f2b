"""Dropless routed experts: each expert multiplies only its routed rows (FLOPs counted on the
real tensors), the EP exchange moves only those rows (bytes counted on the real calls), and
outputs and gradients equal a token-by-token reference, on one rank or over a gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from piper.collectives import EP_GROUP, bind_group
from piper.moe import grouped_ffn, routed_experts
from tests.gloo_ranks import run_ranks

T, K, D, H, E = 12, 2, 16, 32, 4


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    gate = torch.rand(T, K, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, D, H, generator=g, dtype=torch.float64) / D ** 0.5
    w2 = torch.randn(E, H, D, generator=g, dtype=torch.float64) / H ** 0.5
    return x, idx, gate, w1, w2


def _reference(x, idx, gate, w1, w2):
    """Token by token: sum_k gate * FFN_e(x)."""
    out = []
    for t in range(x.shape[0]):
        out.append(sum(gate[t, j] * (F.gelu(x[t] @ w1[idx[t, j]]) @ w2[idx[t, j]])
                       for j in range(idx.shape[1])))
    return torch.stack(out)


def test_one_rank_matches_token_by_token_experts_and_counts_only_routed_rows():
    x, idx, gate, w1, w2 = _inputs()
    leaves = [t.clone().requires_grad_() for t in (x, gate, w1, w2)]
    ref = [t.clone().requires_grad_() for t in (x, gate, w1, w2)]
    with FlopCounterMode(display=False) as counter:
        y = routed_experts(leaves[0], idx, leaves[1], leaves[2:], E, 1)
    routed = 2 * (T * K) * D * H * 2  # two GEMMs over the T x k rows
    mm = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    assert routed <= mm <= 1.05 * routed, (mm, routed)  # not E x T rows
    want = _reference(ref[0], idx, ref[1], ref[2], ref[3])
    torch.testing.assert_close(y, want)
    y.backward(torch.ones_like(y))
    want.backward(torch.ones_like(want))
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad)


def test_grouped_gemm_and_the_loop_over_experts_agree():
    rows = torch.randn(10, 16)
    w1, w2 = torch.randn(3, 16, 8), torch.randn(3, 8, 16)
    counts = [3, 0, 7]  # an expert no row was routed to
    leaves = [t.clone().requires_grad_() for t in (rows, w1, w2)]
    fast = grouped_ffn(leaves[0], leaves[1:], counts, grouped=True)
    slow = torch.cat([F.gelu(p @ w1[e]) @ w2[e] for e, p in enumerate(rows.split(counts))])
    torch.testing.assert_close(fast, slow)
    fast.sum().backward()  # an expanded gradient, which torch._grouped_mm refuses itself
    assert all(t.grad is not None for t in leaves)
    odd = torch.randn(5, 6)  # rows of 24 bytes: torch._grouped_mm's rule fails, the loop runs
    torch.testing.assert_close(grouped_ffn(odd, [torch.ones(1, 6, 2), torch.ones(1, 2, 6)], [5],
                                           grouped=True),
                               F.gelu(odd @ torch.ones(6, 2)) @ torch.ones(2, 6))


def _worker(rank: int, ep: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ep)
    try:
        bind_group(EP_GROUP, dist.group.WORLD)
        moved: list[int] = []
        real = dist.all_to_all_single

        def counting(output, input, *args, **kwargs):
            if input.is_floating_point():
                moved.append(input.numel() * input.element_size())
            return real(output, input, *args, **kwargs)

        dist.all_to_all_single = counting
        x, idx, gate, w1, w2 = _inputs()
        mine = slice(rank * T // ep, (rank + 1) * T // ep)  # this rank's tokens
        local = slice(rank * E // ep, (rank + 1) * E // ep)  # and experts
        leaves = [x[mine].clone().requires_grad_(), gate[mine].clone().requires_grad_(),
                  w1[local].clone().requires_grad_(), w2[local].clone().requires_grad_()]
        y = routed_experts(leaves[0], idx[mine], leaves[1], leaves[2:], E, ep)
        y.backward(torch.ones_like(y))
        full = [t.clone().requires_grad_() for t in (x, gate, w1, w2)]
        want = _reference(full[0], idx, full[1], full[2], full[3])
        want.backward(torch.ones_like(want))
        errs = [(y - want[mine]).abs().max(), (leaves[0].grad - full[0].grad[mine]).abs().max(),
                (leaves[1].grad - full[1].grad[mine]).abs().max()]
        # expert weights: this rank's share of the gradient, summed over the group
        for w, f in ((leaves[2], full[2]), (leaves[3], full[3])):
            errs.append((w.grad - f.grad[local]).abs().max())
        rows = (T // ep) * K * D * 8  # this rank's routed rows, fp64
        out[rank] = (max(float(e.detach()) for e in errs), sum(moved), rows)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ep", [2])
def test_expert_parallel_exchange_moves_only_routed_rows_and_matches(ep):
    out = run_ranks(_worker, ep)
    assert max(err for err, _, _ in out.values()) < 1e-10
    # forward: the routed rows there and back; backward: their gradients there and back
    # (what a rank receives depends on the router; over the group, sent = received)
    moved, rows = (sum(v[i] for v in out.values()) for i in (1, 2))
    assert moved == 4 * rows, (moved, rows)
