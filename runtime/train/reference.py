"""Plain single-device PyTorch training: the ground truth every strategy must reproduce."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from piper.model_file import ModelSpec
from piper.moe_capacity import limit_capacity
from runtime.train.data import BatchSource
from runtime.train.training import TrainConfig, make_optimizer, make_scheduler


@dataclass(frozen=True)
class ReferenceStep:
    loss: float
    grad_norm: float
    lr: float
    eval_loss: float | None = None  # after this step's update, if the run evaluates then


def reference_run(spec: ModelSpec, *, batch_size: int, steps: int, seed: int,
                  train: TrainConfig | None = None, state: dict | None = None,
                  capacity: tuple[tuple[str, ...], float, int] | None = None
                  ) -> list[ReferenceStep]:
    """`steps` full-batch steps per DESIGN.md's training semantics, with `train`'s data,
    optimizer overrides, LR schedule, clipping (`clip_grad_norm_`) and precision (bf16-mixed:
    the forward under `torch.autocast(bfloat16)`, fp32 parameters and optimizer). `state`,
    if given, receives the trained model's state dict. `capacity`: (experts modules, factor,
    tokens per sequence) of an expert capacity factor (`piper.moe_capacity`)."""
    train = train or TrainConfig()
    torch.manual_seed(seed)
    model = spec.build()
    if capacity is not None:
        limit_capacity(model, *capacity)
    if spec.weights:
        from runtime.train.weights import load_all_weights

        load_all_weights(model, spec)
    if train.precision == "bf16":
        model = model.to(torch.bfloat16)
    opt = make_optimizer(spec, model.parameters(), train)
    sched = make_scheduler(opt, train)
    source = BatchSource(spec, batch_size, seed, train.data, train.data_dtype)
    evals = BatchSource(spec, batch_size, seed, train.eval_data, train.data_dtype,
                        shuffle=False, flag="--eval-data") if train.eval_data else None
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16)
                if train.precision == "bf16-mixed" else nullcontext())
    out = []
    for k in range(steps):
        args, kwargs, targets = source.structured(k, 0, batch_size)
        with autocast:
            loss = spec.loss_fn(model(*args, **kwargs), targets)
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if train.clip_grad is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, train.clip_grad)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        held = None
        if train.evaluates_after(k + 1, steps):
            held = _evaluate(spec, model, evals, train.eval_steps, batch_size, autocast)
        out.append(ReferenceStep(float(loss.detach()), float(norm), float(lr), held))
    if state is not None:
        state.update(model.state_dict())
    return out


def _evaluate(spec: ModelSpec, model: torch.nn.Module, evals: BatchSource | None,
              batches: int, batch_size: int, autocast: object) -> float:
    """Mean loss over the first `batches` evaluation batches, without gradients."""
    assert evals is not None
    total = 0.0
    with torch.no_grad():
        for b in range(batches):
            args, kwargs, targets = evals.structured(b, 0, batch_size)
            with autocast:  # type: ignore[attr-defined]
                total += float(spec.loss_fn(model(*args, **kwargs), targets))
    return total / batches


def reference_losses(spec: ModelSpec, *, batch_size: int, steps: int, seed: int,
                     train: TrainConfig | None = None) -> list[float]:
    return [s.loss for s in reference_run(spec, batch_size=batch_size, steps=steps, seed=seed,
                                          train=train)]


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))
