"""What one training step of a rank keeps between its tasks: per microbatch, the values and
gradients in flight and what each forward saved for its backward; what the step reports."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.execute.weight_grad import WeightGradStore
from runtime.lowering.plan import Task


@dataclass
class Saved:
    acts: list[tuple[str, torch.Tensor]]  # activation inputs (leaves) by value name
    outputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None
    deferred: WeightGradStore | None = None  # split backward: W's products, kept by I
    flat_grad: list[torch.Tensor | None] | None = None  # ZeRO: per unit, from I to W
    views: list[torch.Tensor] = field(default_factory=list)  # ZeRO: this forward's params
    activation_bytes: int = 0  # what this chunk keeps for backward (memory ledger)


@dataclass
class StepState:
    """What the streams of one step share (dict and list updates are atomic under the GIL)."""

    events: dict[str, threading.Event]
    acts: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    saved: dict[tuple, Saved] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)  # (isend work, tensor kept alive)
    posted: dict[int, list[tuple[Any, torch.Tensor]]] = field(default_factory=dict)
    gathers: list[int] = field(default_factory=list)  # ZeRO gathers after the updates
    spans: list[tuple[str, Task, float, float]] = field(default_factory=list)  # stream, ...
    loss_sum: float = 0.0
    t0: float = 0.0
    error: BaseException | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # gradient sums (_accumulate)


@dataclass
class StepOutcome:
    loss_sum: float | None  # sum of this rank's scaled microbatch losses (output stage only)
    time_s: float
    peak_memory_bytes: int
    model_state_bytes: int  # peak of parameters + gradients + optimizer state so far
    spans: list[tuple[str, Task, float, float]] = field(default_factory=list)  # stream, ...
    grad_norm: float = float("nan")  # of the whole model's gradient (every rank: the same)
    lr: float = float("nan")  # the learning rate this step used


def accumulate(st: StepState, key: tuple[str, int], g: torch.Tensor) -> None:
    """Add `g` to the gradient of value `key`: the two lanes of an overlapped pair may
    both contribute to one value (a skip connection), so under the step's lock."""
    with st.lock:
        st.grads[key] = st.grads[key] + g if key in st.grads else g


def to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(t, device) for t in x)
    if isinstance(x, dict):
        return {k: to_device(t, device) for k, t in x.items()}
    return x
