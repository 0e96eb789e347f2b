"""A Llama-style decoder for piper-plan: RMSNorm, rotary embeddings, grouped-query attention
and a SwiGLU MLP. Regions `embed`, `layer` (numbered), `head`.

    piper-plan search examples/llama.py --model-arg size=7b --gpus 16 --cluster h100-80gb
    piper-plan run examples/llama.py --model-arg size=tiny --gpus 4 --device cpu --pp 2 \
        --tp 2 --microbatches 2 --steps 3 --check

Configs (`--model-arg size=...`): `tiny` for tests, `7b` (Llama-2-7B shapes), `70b`
(Llama-2-70B: 8 key/value heads for 64 query heads), `qwen3-1b` (Qwen3-style: RMSNorm on
each head's queries and keys, tied input/output embedding, 151,936-token vocabulary; 1.1B
parameters), `qwen3-tiny` (its shapes scaled down, for tests), `llama3-8b`, `llama3-70b`
and `405b` (Llama 3.1 shapes: 128K vocabulary, 8K context). Any config field can be
overridden: `--model-arg size=405b --model-arg seq=4096`. `--model-arg dtype=bfloat16`
builds the model in bf16 (planning; the CPU runtime trains in the dtype it is given).
Written for tensor parallelism (`TP_PLAN`: heads and the MLP's hidden units split; reshapes
use -1 for the local heads) and sequence parallelism (`--sp`: every op between the split
layers works token by token, and attention reads the sequence length after the gathering
projections).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

import piper


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    seq: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float = 10000.0
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on queries and keys before RoPE
    tie: bool = False  # output projection shares the token embedding
    # torchtitan's Llama copies each key/value head to its query heads before attention
    # (`repeat_kv`), so attention and context parallelism move per-query-head keys and values
    repeat_kv: bool = False


CONFIGS = {
    "tiny": LlamaConfig(vocab=128, seq=16, dim=32, layers=4, heads=4, kv_heads=2, ffn=64),
    "7b": LlamaConfig(vocab=32000, seq=4096, dim=4096, layers=32, heads=32, kv_heads=32,
                      ffn=11008),
    "70b": LlamaConfig(vocab=32000, seq=4096, dim=8192, layers=80, heads=64, kv_heads=8,
                       ffn=28672),
    "qwen3-1b": LlamaConfig(vocab=151936, seq=1024, dim=2048, layers=16, heads=16, kv_heads=8,
                            ffn=6144, rope_theta=1e6, qk_norm=True, tie=True),
    # Llama 3 / 3.1 (paper Table 3; 128,256-token vocabulary, RoPE base 500,000)
    "llama3-8b": LlamaConfig(vocab=128256, seq=8192, dim=4096, layers=32, heads=32, kv_heads=8,
                             ffn=14336, rope_theta=5e5),
    "llama3-70b": LlamaConfig(vocab=128256, seq=8192, dim=8192, layers=80, heads=64,
                              kv_heads=8, ffn=28672, rope_theta=5e5),
    "405b": LlamaConfig(vocab=128256, seq=8192, dim=16384, layers=126, heads=128, kv_heads=8,
                        ffn=53248, rope_theta=5e5),
    "qwen3-tiny": LlamaConfig(vocab=128, seq=16, dim=32, layers=4, heads=4, kv_heads=2, ffn=64,
                              rope_theta=1e6, qk_norm=True, tie=True),
}
BATCH_SIZE = 32
TP_PLAN = {
    "layers.*.wq": "colwise",
    "layers.*.wk": "colwise",
    "layers.*.wv": "colwise",
    "layers.*.wo": "rowwise",
    "layers.*.w1": "colwise",
    "layers.*.w3": "colwise",
    "layers.*.w2": "rowwise",
    "tok": "vocab",  # vocabulary-parallel embedding and output layer
    "out": "colwise_rep",
}
_config = CONFIGS["7b"]


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of x: [b, heads, t, head_dim], angles made on the fly."""
    t, hd = x.shape[-2], x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.c = c
        hd = c.dim // c.heads
        self.attn_norm = nn.RMSNorm(c.dim)
        self.wq = nn.Linear(c.dim, c.heads * hd, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.wo = nn.Linear(c.heads * hd, c.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(c.dim)
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)
        self.q_norm = nn.RMSNorm(hd) if c.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(hd) if c.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        hd = c.dim // c.heads
        h = self.attn_norm(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        # the sequence from q, not x: with sequence parallelism x holds 1/tp of it and the
        # column-parallel projections gather it whole
        b, t = q.shape[:2]
        q = rotate(self.q_norm(q.view(b, t, -1, hd)).transpose(1, 2), c.rope_theta)
        k = rotate(self.k_norm(k.view(b, t, -1, hd)).transpose(1, 2), c.rope_theta)
        v = v.view(b, t, -1, hd).transpose(1, 2)
        if c.repeat_kv:
            rep = c.heads // c.kv_heads
            k, v = (x_.unsqueeze(2).expand(b, -1, rep, t, hd).reshape(b, -1, t, hd)
                    for x_ in (k, v))
        # fused attention (flash on GPUs): no t x t score matrix is kept for backward;
        # enable_gqa lets each key/value head serve heads/kv_heads query heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)
        self.out = nn.Linear(c.dim, c.vocab, bias=False)
        if c.tie:  # one matrix for both: a small init, as the embedding's N(0, 1) would
            # make logits of size sqrt(dim)
            nn.init.normal_(self.tok.weight, std=0.02)
            self.out.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with piper.annotate("embed"):
            x = self.tok(idx)
        for layer in self.layers:
            with piper.annotate("layer"):
                x = layer(x)
        with piper.annotate("head"):
            return self.out(self.norm(x))


def build_model(size: str = "7b", dtype: str = "float32", **dims: int) -> Llama:
    """`dims` override fields of the named config (`--model-arg layers=48 seq=2048`)."""
    global _config
    if size not in CONFIGS:
        raise ValueError(f"size must be one of {sorted(CONFIGS)}, got {size!r}")
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise TypeError(f"dtype must be a torch dtype such as float32 or bfloat16, got "
                         f"{dtype!r}")
    known = {f.name for f in fields(LlamaConfig)}
    if set(dims) - known:
        raise TypeError(f"unknown config fields {sorted(set(dims) - known)}; known: "
                        f"{sorted(known)}")
    _config = replace(CONFIGS[size], **dims)
    return Llama(_config).to(getattr(torch, dtype))


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    c = _config
    tokens = torch.randint(0, c.vocab, (batch_size, c.seq + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
