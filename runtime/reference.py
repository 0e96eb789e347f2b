"""Plain single-device PyTorch training: the ground truth every strategy must reproduce."""

from __future__ import annotations

import torch

from piper.model_file import ModelSpec


def reference_losses(spec: ModelSpec, *, batch_size: int, steps: int, seed: int) -> list[float]:
    """Losses of `steps` full-batch steps per DESIGN.md's training semantics."""
    torch.manual_seed(seed)
    model = spec.build()
    if spec.weights:
        from runtime.weights import load_all_weights

        load_all_weights(model, spec.weights)
    opt = spec.make_optimizer(model.parameters())
    torch.manual_seed(seed)
    args, kwargs, targets = spec.example(batch_size)
    losses = []
    for _ in range(steps):
        loss = spec.loss_fn(model(*args, **kwargs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))
