"""Boxes: a rank's flat carriers (parameters cut by TP/EP, ZeRO shards) as blocks of the
model's tensors. Every element lands once, at the right place, whatever the cut."""

from __future__ import annotations

import math

import pytest
import torch

from piper.sharding import ModelSharding
from piper.tensor_parallel import _rows
from runtime.train.layout import Slicing, range_boxes


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 7), (4, 1)])
def test_range_boxes_cover_each_flat_range_contiguously(shape):
    n = math.prod(shape)
    t = torch.arange(n).view(shape)
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            got = []
            for off, sizes in range_boxes(shape, lo, hi):
                start = sum(o * s for o, s in zip(off, strides))
                block = t[tuple(slice(o, o + s) for o, s in zip(off, sizes))].reshape(-1)
                assert torch.equal(block, torch.arange(start, start + math.prod(sizes)))
                got += block.tolist()
            assert got == list(range(lo, hi))


def _slicing(tp_rank: int, style: str) -> Slicing:
    sh = ModelSharding(tp=2, tp_plan=(("fc", style),))
    return Slicing(sh, ["", "fc"], {"fc.weight": (12, 4), "fc.bias": (12,)}, tp_rank, 0)


@pytest.mark.parametrize("style", ["colwise", "colwise:3", "rowwise"])
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_tp_and_zero_boxes_tile_the_model_tensor_once(style, shards):
    """Each TP rank's local weight (as `shard_linears` cuts it), split in `shards` ZeRO
    ranges: the boxes' views of the local data equal the model tensor's blocks, and all
    ranks' boxes together cover it exactly once."""
    full = torch.arange(48.0).view(12, 4)
    seen = torch.zeros(12, 4)
    for r in range(2):
        kind, _, parts = style.partition(":")
        local = (_rows(full, int(parts or 1), 2, r) if kind == "colwise"
                 else full.chunk(2, dim=1)[r]).contiguous()
        n = local.numel()
        cut = math.ceil(n / shards)
        for k in range(shards):
            lo, hi = k * cut, min(n, (k + 1) * cut)
            shard = local.reshape(-1)[lo:hi]  # the rank's ZeRO shard of it
            for b in _slicing(r, style).boxes("fc.weight", lo, hi, -lo, owner=True):
                block = full[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))]
                assert torch.equal(b.view(shard), block)
                seen[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))] += 1
    assert torch.equal(seen, torch.ones(12, 4))


def test_replicated_tensors_are_not_tp_split():
    s = _slicing(1, "rowwise")
    assert s.tp_split("fc.weight") and not s.tp_split("fc.bias")
    assert [(p.local, p.sizes, p.full) for p in s.pieces("fc.bias")] == [((0,), (12,), (0,))]


def test_expert_tensor_parallel_pieces_tile_stacked_experts_once():
    """A gated [gate; up] expert weight [E, 2I, d] under ep=2 x etp=2: each rank's pieces
    (its experts, 1/etp of each half of the hidden features) are what `shard_experts` keeps,
    and the four ranks cover the model tensor exactly once."""
    from piper.moe import hidden_slice

    full = torch.arange(4 * 8 * 3.0).view(4, 8, 3)
    sh = ModelSharding(tp=2, ep=2, etp=2, experts=("m.experts",),
                       expert_cuts=(("m.experts.gate_up_proj", 1, 2),))
    seen = torch.zeros_like(full)
    for ep_rank in range(2):
        for tp_rank in range(2):
            s = Slicing(sh, ["", "m", "m.experts"], {"m.experts.gate_up_proj": (4, 8, 3)},
                        tp_rank, ep_rank)
            assert s.tp_split("m.experts.gate_up_proj")
            local = hidden_slice(full.chunk(2, dim=0)[ep_rank], 1, 2, 2, tp_rank)
            assert s.local_shape("m.experts.gate_up_proj") == tuple(local.shape) == (2, 4, 3)
            for b in s.boxes("m.experts.gate_up_proj", 0, local.numel(), 0, owner=True):
                at = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))
                assert torch.equal(b.view(local.reshape(-1)), full[at])
                seen[at] += 1
    assert torch.equal(seen, torch.ones_like(full))


def test_an_expert_mesh_gives_each_tensor_parallel_rank_its_own_experts():
    sh = ModelSharding(tp=2, ep=4, ep_tp=True, experts=("m.experts",))
    seen = torch.zeros(8)
    for replica in range(2):
        for t in range(2):
            s = Slicing(sh, ["", "m", "m.experts"], {"m.experts.w1": (8, 3, 5)}, t,
                        sh.ep_rank(replica, t))
            assert s.tp_split("m.experts.w1"), "each TP rank's copy counts"
            (p,) = s.pieces("m.experts.w1")
            seen[p.full[0]:p.full[0] + p.sizes[0]] += 1
    assert torch.equal(seen, torch.ones(8)), "the 8 experts, 2 per process, each once"
