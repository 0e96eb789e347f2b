"""How a run trains: precision, optimizer overrides, LR schedule, clipping, data.

`TrainConfig` travels from the CLI to every worker and to the single-device reference, so
the three agree on every step's learning rate and clipping by construction: both build
their optimizers with `make_optimizer` and their schedules with `make_scheduler`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from piper.errors import PiperError
from piper.model_file import ModelSpec

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
SCHEDULES = ("constant", "cosine", "linear", "wsd")
WSD_DECAY_FRACTION = 0.2  # warmup-stable-decay: the last fifth of the horizon decays


@dataclass(frozen=True)
class TrainConfig:
    precision: str = "fp32"
    reduce_dtype: str = "fp32"  # gradient all-reduce / reduce-scatter dtype
    lr: float | None = None  # None: the model file's optimizer's own
    weight_decay: float | None = None
    warmup: int = 0
    lr_schedule: str = "constant"
    min_lr: float = 0.0
    decay_steps: int = 0  # the schedule's horizon (0: no decay horizon given)
    clip_grad: float | None = None
    data: str | tuple[str, ...] | None = None  # a token file, or a blend (`runtime.train.data`)
    data_dtype: str = "uint16"
    eval_data: str | tuple[str, ...] | None = None  # held-out tokens, read in order
    eval_every: int = 0  # evaluate after every this many steps (0: after the last only)
    eval_steps: int = 4  # global batches of eval_data each evaluation averages

    def check(self) -> TrainConfig:
        """Every field valid, or a `PiperError` naming the flag."""
        if self.precision not in PRECISIONS:
            raise PiperError(f"--precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise PiperError(f"--reduce-dtype must be fp32 or bf16, got {self.reduce_dtype!r}")
        if self.lr_schedule not in SCHEDULES:
            raise PiperError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, "
                             f"got {self.lr_schedule!r}")
        for flag, v in (("--lr", self.lr), ("--weight-decay", self.weight_decay),
                        ("--min-lr", self.min_lr)):
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise PiperError(f"{flag} must be a finite number >= 0, got {v}")
        if self.warmup < 0:
            raise PiperError(f"--warmup must be >= 0 steps, got {self.warmup}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise PiperError(f"--clip-grad must be > 0, got {self.clip_grad}")
        if self.eval_every < 0 or self.eval_steps < 1:
            raise PiperError(f"--eval-every must be >= 0 and --eval-steps >= 1, got "
                             f"{self.eval_every} and {self.eval_steps}")
        if self.eval_data and not self.data:
            raise PiperError("--eval-data needs --data (a model file's own batches have no "
                             "held-out counterpart)")
        if self.data_dtype not in ("uint16", "uint32"):
            raise PiperError(f"--data-dtype must be uint16 or uint32, got {self.data_dtype!r}")
        return self

    def evaluates_after(self, step: int, steps: int) -> bool:
        """Whether the run evaluates after step `step` (from 1) of `steps`: every
        `eval_every` steps and after the last, when there is evaluation data."""
        return bool(self.eval_data) and ((self.eval_every > 0 and step % self.eval_every == 0)
                                         or step == steps)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.precision == "fp32" else torch.bfloat16

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.reduce_dtype == "bf16" else torch.float32


def lr_factor(cfg: TrainConfig, step: int, base: float) -> float:
    """The learning rate of update `step` (0-based) over `base`: linear warmup to `base`
    over `warmup` updates, then the schedule from `base` down to `min_lr` at `decay_steps`."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    if cfg.lr_schedule == "constant" or base <= 0:
        return 1.0
    span = max(1, cfg.decay_steps - cfg.warmup)
    p = min(1.0, (step - cfg.warmup) / span)
    if cfg.lr_schedule == "linear":
        d = 1.0 - p
    elif cfg.lr_schedule == "cosine":
        d = 0.5 * (1.0 + math.cos(math.pi * p))
    else:  # wsd: stable, then linear decay over the last fraction
        d = min(1.0, (1.0 - p) / WSD_DECAY_FRACTION)
    lo = min(cfg.min_lr, base)
    return (lo + (base - lo) * d) / base


def make_optimizer(spec: ModelSpec, params: Iterable[Any], cfg: TrainConfig
                   ) -> torch.optim.Optimizer:
    """The model file's optimizer over `params`, with `--lr` / `--weight-decay` applied."""
    opt = spec.make_optimizer(list(params))
    for g in opt.param_groups:
        if cfg.lr is not None:
            g["lr"] = cfg.lr
        if cfg.weight_decay is not None:
            if "weight_decay" not in g:
                raise PiperError(f"--weight-decay: the model's optimizer "
                                 f"{type(opt).__name__} has no weight decay")
            g["weight_decay"] = cfg.weight_decay
    return opt


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig, done: int = 0
                   ) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of `opt`, advanced past `done` updates (a resumed run)."""
    def factor(base: float) -> Callable[[int], float]:
        return lambda step: lr_factor(cfg, step, base)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, [factor(g["lr"]) for g in opt.param_groups])
    if done:
        with warnings.catch_warnings():  # "step() before optimizer.step()": on purpose
            warnings.simplefilter("ignore", UserWarning)
            sched.last_epoch = done - 1
            sched.step()
    return sched
