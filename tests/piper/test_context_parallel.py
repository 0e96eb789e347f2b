"""Context-parallel attention on real gloo processes: each rank's output and gradients
equal its tokens' share of one full-sequence `scaled_dot_product_attention`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from piper import context_parallel as cp
from piper.collectives import CP_GROUP, bind_group
from tests.gloo_ranks import run_ranks


def test_head_tail_positions_cover_the_sequence_with_equal_causal_work():
    degree, length = 4, 6
    held = [cp.positions(r, degree, length) for r in range(degree)]
    assert sorted(torch.cat(held).tolist()) == list(range(degree * length))
    work = [int((p + 1).sum()) for p in held]  # keys each rank's queries see, causally
    assert len(set(work)) == 1
    assert cp.check_length(24, 4) is None and "2 x 5" in cp.check_length(24, 5)


def _worker(rank: int, degree: int, port: int, mode: str, causal: bool, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=degree)
    try:
        bind_group(CP_GROUP, dist.group.WORLD)
        g = torch.Generator().manual_seed(0)
        b, heads, kv_heads, seq, d = 2, 4, 2, 8 * degree, 8
        q = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64)
        k = torch.randn(b, kv_heads, seq, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, kv_heads, seq, d, generator=g, dtype=torch.float64)
        dy = torch.randn(b, heads, seq, d, generator=g, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        y = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
        y.backward(dy)
        pos = cp.positions(rank, degree, seq // degree)
        mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
        y_cp = cp.attention(*mine, None, causal, degree, mode)
        y_cp.backward(dy[:, :, pos])
        errs = [(y_cp - y[:, :, pos]).abs().max().item()]
        errs += [(m.grad - f.grad[:, :, pos]).abs().max().item() for m, f in zip(mine, full)]
        out[rank] = max(errs)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("mode", "degree", "causal"), [
    ("ring", 2, True), ("ring", 4, True), ("all_gather", 2, True), ("ring", 2, False)])
def test_attention_matches_full_sequence_sdpa(mode, degree, causal):
    out = run_ranks(_worker, degree, mode, causal)
    assert max(out.values()) < 1e-9, out
