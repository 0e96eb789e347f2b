"""A tiny MLP whose first region's output skips to the last region (a long skip connection):
under pp=3 the first stage's activation is sent straight to the last stage."""

import torch
import torch.nn.functional as F
from torch import nn

import piper

BATCH_SIZE = 16


class SkipMLP(nn.Module):
    def __init__(self, dim: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.mid = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.out = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with piper.annotate("embed"):
            h0 = torch.tanh(self.inp(x))
        h = h0
        for m in self.mid:
            with piper.annotate("layer"):
                h = torch.tanh(m(h))
        with piper.annotate("head"):
            return self.out(h + h0)


def build_model() -> SkipMLP:
    return SkipMLP()


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 8), torch.randint(0, 5, (batch_size,))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)
