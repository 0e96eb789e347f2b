"""`examples/llama.py` with its norms written out op by op, as Hugging Face's LlamaRMSNorm
is (fp32 upcast, pow, mean, rsqrt, two products): ops no fused kernel of the runtime covers,
so autograd keeps the normalised copies, and the `op` recompute policy has work to do."""

from pathlib import Path

import torch
from torch import nn

from piper.pyfile import import_user_file

_llama = import_user_file(Path(__file__).parents[2] / "examples" / "llama.py", "model file")
BATCH_SIZE = _llama.BATCH_SIZE
TP_PLAN = _llama.TP_PLAN
example_batch = _llama.example_batch
loss_fn = _llama.loss_fn


class HandNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def build_model(size: str = "tiny", **dims: int) -> nn.Module:
    model = _llama.build_model(size, **dims)
    for layer in model.layers:
        layer.attn_norm = HandNorm(layer.c.dim)
        layer.mlp_norm = HandNorm(layer.c.dim)
    return model
