"""A GPT language model tagged for piper-plan: regions `embed`, `layer` (numbered), `head`.

    piper-plan search examples/gpt.py --gpus 16
    piper-plan run examples/gpt.py --model-arg size=tiny --gpus 4 --device cpu --pp 2 --dp 2 \
        --schedule 1f1b --microbatches 4 --steps 3 --seed 0 --check

`--model-arg size=tiny|mini|small|1b` picks a config; the default is about 1.1B parameters;
`--model-arg dim=...` (and `vocab`, `seq`, `layers`, `heads`) overrides one of its fields.
`--model-arg tie=true` ties the output projection to the token embedding.
`TP_PLAN` says how `--tp` / `ShardTensor` splits each block (Megatron column/row pairs).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

import piper


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq: int
    dim: int
    layers: int
    heads: int


CONFIGS = {
    "tiny": GPTConfig(vocab=128, seq=16, dim=32, layers=4, heads=2),
    "mini": GPTConfig(vocab=2048, seq=64, dim=256, layers=8, heads=4),
    "small": GPTConfig(vocab=8192, seq=256, dim=512, layers=8, heads=8),
    "1b": GPTConfig(vocab=50304, seq=1024, dim=2048, layers=18, heads=16),
}
BATCH_SIZE = 32
TP_PLAN = {  # Megatron: attention and MLP each column- then row-parallel
    "blocks.*.qkv": "colwise:3",
    "blocks.*.proj": "rowwise",
    "blocks.*.fc": "colwise",
    "blocks.*.out": "rowwise",
    "tok": "vocab",  # Megatron's vocabulary-parallel embedding and output layer
    "lm_head": "colwise_rep",
    "pos": "sequence",  # with --sp, each rank adds the positions of its share of tokens
}
_config = CONFIGS["1b"]


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.ln2 = nn.LayerNorm(c.dim)
        self.fc = nn.Linear(c.dim, 4 * c.dim)
        self.out = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Written for tensor parallelism: q|k|v split with chunk and heads inferred (-1), so
        # the same code runs on a rank holding only its share of the heads (see TP_PLAN).
        hd = x.shape[-1] // self.heads
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, -1, hd).transpose(1, 2) for z in (q, k, v))
        # fused causal attention (flash on GPUs): no t x t score matrix kept for backward
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig, tie: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        if tie:  # the embedding and the output projection share one matrix
            self.lm_head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with piper.annotate("embed"):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            with piper.annotate("layer"):
                x = block(x)
        with piper.annotate("head"):
            return self.lm_head(self.ln_f(x))


def build_model(size: str = "1b", tie: bool = False, **dims: int) -> GPT:
    """`dims` override fields of the named config: `--model-arg dim=12288 --model-arg
    layers=96 --model-arg heads=96 --model-arg seq=2048 --model-arg vocab=51200` is GPT-3
    175B's shape (Megatron's GPT: MLP 4 x dim, learned positions, untied output)."""
    global _config
    if size not in CONFIGS:
        raise ValueError(f"size must be one of {sorted(CONFIGS)}, got {size!r}")
    known = {f.name for f in fields(GPTConfig)}
    if set(dims) - known:
        raise TypeError(f"unknown config fields {sorted(set(dims) - known)}; known: "
                        f"{sorted(known)}")
    _config = replace(CONFIGS[size], **dims)
    return GPT(_config, tie=tie)


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = _config
    tokens = torch.randint(0, c.vocab, (batch_size, c.seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
