"""A mixture-of-experts GPT for piper-plan: each layer is an `attn` region and an `experts`
region holding top-k routed `piper.Experts`.

    piper-plan run examples/moe.py --model-arg size=tiny --gpus 2 --device cpu --dp 2 --ep 2 \
        --steps 3 --check

Regions: `embed`, then per layer `attn.i` and `experts.i`, then `head`. `--ep E` (or the
directive `Shard("experts.*", degree=E)`) splits every layer's experts over E data-parallel
replicas, with all-to-all dispatch and combine; `--tp T` splits the attention by `TP_PLAN`,
alone or with `--ep`; `--model-arg size=tiny|small|1b`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import piper


@dataclass(frozen=True)
class MoEConfig:
    vocab: int
    seq: int
    dim: int
    layers: int
    heads: int
    experts: int
    top_k: int
    hidden: int


CONFIGS = {
    "tiny": MoEConfig(vocab=128, seq=16, dim=32, layers=2, heads=2, experts=4, top_k=2,
                      hidden=64),
    "small": MoEConfig(vocab=8192, seq=256, dim=512, layers=8, heads=8, experts=8, top_k=2,
                       hidden=1024),
    "1b": MoEConfig(vocab=50304, seq=1024, dim=1024, layers=12, heads=16, experts=16,
                    top_k=2, hidden=2816),
}
BATCH_SIZE = 16
TP_PLAN = {  # Megatron attention (column- then row-parallel); experts are split by --ep
    "attn.*.qkv": "colwise:3",
    "attn.*.proj": "rowwise",
}
_size = "1b"


class Attention(nn.Module):
    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, -1, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return x + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))


class MoE(nn.Module):
    """Top-k routing in plain PyTorch; the experts themselves are a `piper.Experts`."""

    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.top_k = c.top_k
        self.ln = nn.LayerNorm(c.dim)
        self.router = nn.Linear(c.dim, c.experts, bias=False)
        self.experts = piper.Experts(c.experts, c.dim, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln(x).reshape(b * t, d)
        gate, idx = self.router(h).softmax(dim=-1).topk(self.top_k, dim=-1)
        gate = gate / gate.sum(dim=-1, keepdim=True)
        return x + self.experts(h, idx, gate).view(b, t, d)


class MoEGPT(nn.Module):
    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.attn = nn.ModuleList(Attention(c) for _ in range(c.layers))
        self.moe = nn.ModuleList(MoE(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with piper.annotate("embed"):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.tok(idx) + self.pos(pos)
        for attn, moe in zip(self.attn, self.moe):
            with piper.annotate("attn"):
                x = attn(x)
            with piper.annotate("experts"):
                x = moe(x)
        with piper.annotate("head"):
            return self.lm_head(self.ln_f(x))


def build_model(size: str = "1b") -> MoEGPT:
    global _size
    if size not in CONFIGS:
        raise ValueError(f"size must be one of {sorted(CONFIGS)}, got {size!r}")
    _size = size
    return MoEGPT(CONFIGS[size])


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = CONFIGS[_size]
    tokens = torch.randint(0, c.vocab, (batch_size, c.seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
