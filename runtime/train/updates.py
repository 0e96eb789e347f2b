"""A rank's optimizer steps: the learning-rate schedule, the global gradient norm and
clipping by it.

Each UPDATE task hands its optimizer here once the gradients it updates are final (summed
over replicas, or reduce-scattered to this rank's ZeRO shard). Without clipping the step
runs right there, as scheduled, and the gradient norm is only reported. With clipping every
step must see the norm over *all* gradients of the model, so the steps wait for the end of
the training step: each rank sums the squares of the gradient elements it owns (`Held`:
a tensor/expert/ZeRO shard counts on the rank holding it, a copy held by several ranks on
one of them, a tied weight once), one all-reduce over every rank adds them up, and all
gradients are scaled as single-device `clip_grad_norm_` scales them. The result equals the
single-device norm up to the order of the additions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime.train.layout import Box
from runtime.train.training import TrainConfig, make_scheduler


@dataclass
class Held:
    """What one optimizer entry updates: a parameter or a ZeRO shard (`param`), the blocks
    of the model's tensors its elements are (`boxes`, of the flat `param`), and for ZeRO-1/2
    the gathered buffer every parameter of the unit lives in (`whole`, its boxes)."""

    key: Any  # the optimizer's key in the executor
    param: torch.Tensor
    boxes: list[Box]
    whole: tuple[torch.Tensor, list[Box]] | None = None


@dataclass
class Updater:
    optim: dict[Any, torch.optim.Optimizer]
    held: list[Held]
    cfg: TrainConfig
    device: torch.device
    done: int = 0  # updates before this run (a resumed one)
    keep: Callable[[Any], None] = lambda _ts: None  # CUDA: tensors other streams made
    scheds: dict[Any, Any] = field(default_factory=dict)
    _pending: list[Any] = field(default_factory=list)
    _sq: list[torch.Tensor] = field(default_factory=list)  # owned squares, per update

    def __post_init__(self) -> None:
        self.scheds = {k: make_scheduler(o, self.cfg, self.done) for k, o in self.optim.items()}
        self._owned: dict[Any, list[tuple[torch.Tensor, list[Box]]]] = {}
        for h in self.held:
            mine = [b for b in h.boxes if b.owner]
            self._owned.setdefault(h.key, []).append((h.param, mine))

    @property
    def lr(self) -> float:
        """This step's learning rate (of the first optimizer: all follow one schedule)."""
        if not self.optim:
            return float("nan")
        return float(next(iter(self.optim.values())).param_groups[0]["lr"])

    def ready(self, key: Any) -> None:
        """Optimizer `key`'s gradients are final: step it now, or at the end of the step."""
        if self.cfg.clip_grad is not None:
            self._pending.append(key)
            return
        self._sq.append(self._owned_sq(key))
        self._step(key)

    def waiting(self, key: Any) -> bool:
        """Optimizer `key`'s step waits for the end of the training step."""
        return key in self._pending

    def finish(self) -> float:
        """End of a training step (every rank calls it): clip and step what waited, advance
        the schedules; the global gradient norm."""
        parts = self._sq + [self._owned_sq(k) for k in self._pending]
        total = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64,
                                                                    device=self.device)
        dist.all_reduce(total)
        norm = math.sqrt(float(total))
        pending, self._pending, self._sq = self._pending, [], []
        if self.cfg.clip_grad is not None:
            norm_t = torch.tensor(norm, dtype=torch.float32, device=self.device)
            for key in pending:
                torch.nn.utils.clip_grads_with_norm_(self._params(key), self.cfg.clip_grad,
                                                     norm_t)
                self._step(key)
        for s in self.scheds.values():
            s.step()
        self.done += 1
        return norm

    def _params(self, key: Any) -> list[torch.Tensor]:
        return [p for g in self.optim[key].param_groups for p in g["params"]
                if p.grad is not None]

    def _owned_sq(self, key: Any) -> torch.Tensor:
        """Sum of squares of the gradient elements this rank owns, on the device (no
        synchronisation per tensor). fp32 gradients go through one fused norm over all of
        them, as `clip_grad_norm_` computes it (a float64 copy of every gradient cost ~2%
        of a small model's step); lower precisions are summed in float64."""
        views = [b.view(param.grad) for param, boxes in self._owned.get(key, ())
                 if param.grad is not None for b in boxes]
        if not views:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        if all(v.dtype == torch.float32 for v in views):
            return torch.nn.utils.get_total_norm(views, 2.0, foreach=True).double().square()
        return torch.stack([torch.linalg.vector_norm(v, dtype=torch.float64).square()
                            for v in views]).sum()

    def _step(self, key: Any) -> None:
        opt = self.optim[key]
        self.keep(p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
