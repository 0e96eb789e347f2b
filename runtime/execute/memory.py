"""Memory ledger per rank: what the rank holds, by category, and the step's peaks.

On CUDA the allocator's own peak is the truth for the total; on CPU we count the tensors we
own. Categories: model state (parameters, gradients, optimizer state — what ZeRO shards),
transient buffers (ZeRO's gathered parameters and unsharded gradients) and the activations
saved for backward (every tensor autograd keeps, counted once per storage).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from runtime.execute.zero import ShardedStage, storage_key


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def optimizer_state_bytes(optim: torch.optim.Optimizer) -> int:
    return sum(_nbytes(v) for st in optim.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


class MemoryLedger:
    """Observed after the tasks of a compute lane, so it keeps what a task cannot change —
    parameter bytes, optimizer state once its tensors exist, the gradients of stages the
    task does not touch — instead of walking every tensor again (asking a parameter for its
    gradient wraps a new Python object: ~1 µs a parameter, a few percent of a small
    model's step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._peak = 0
        self._model_state_peak = 0
        self._param_bytes: dict[Any, tuple[list[int], int]] = {}  # by stage: sizes, sum
        self._optim_bytes: dict[int, tuple[int, int]] = {}  # id(optim): (states, bytes)
        self._grad_bytes: dict[Any, int] = {}  # by stage, as last counted

    def _optimizer(self, optim: torch.optim.Optimizer) -> int:
        states, nbytes = self._optim_bytes.get(id(optim), (-1, 0))
        if states != len(optim.state):  # its state appears at the first update, then stays
            nbytes = optimizer_state_bytes(optim)
            self._optim_bytes[id(optim)] = (len(optim.state), nbytes)
        return nbytes

    def start_step(self) -> None:
        self._peak = 0
        self._grad_bytes.clear()  # an update at the end of the last step may have freed them
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def observe(self, params: dict[int, list[torch.nn.Parameter]],
                optim: dict[int, torch.optim.Optimizer], sharded: dict[int, ShardedStage],
                saved: dict[Any, Any], touched: int | None = -1, cleared: bool = False
                ) -> None:
        """Account for the rank's state now. `touched`: the stage whose gradients the task
        just run may have changed (-1: any stage, None: none); keys ("tied", s) and
        ("experts", s) belong to stage s; `cleared`: the task may have freed gradients (an
        update). A backward only adds gradients, so a stage whose every parameter has one
        is not counted again until an update clears them."""
        model, transient = 0, 0
        for s, ps in list(params.items()):
            if s in optim:
                model += self._optimizer(optim[s])
            if s in sharded:
                model += sharded[s].model_state_bytes()
                transient += sharded[s].transient_bytes()
                continue
            known = self._param_bytes.get(s)
            if known is None or len(known[0]) != len(ps):
                sizes = [_nbytes(p) for p in ps]
                known = self._param_bytes[s] = (sizes, sum(sizes))
            sizes, total = known
            stage = s[1] if isinstance(s, tuple) else s
            grads = self._grad_bytes.get(s)
            if grads is None or ((touched == -1 or touched == stage)
                                 and (cleared or grads < total)):
                # a gradient has its parameter's size
                grads = self._grad_bytes[s] = sum(n for p, n in zip(ps, sizes)
                                                  if p.grad is not None)
            model += total + grads
        live = 0
        for sv in list(saved.values()):  # another stream may add entries meanwhile
            live += sv.activation_bytes  # what autograd saved, the outputs and inputs
            # a split backward's gradients (per ZeRO unit), from I to W
            live += sum(_nbytes(g) for g in sv.flat_grad or ())
            live += sv.deferred.nbytes() if sv.deferred is not None else 0
        self._model_state_peak = max(self._model_state_peak, model)
        self._peak = max(self._peak, model + transient + live)

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._peak

    def model_state_peak(self) -> int:
        """Peak of parameters + gradients + optimizer state over every step so far."""
        return self._model_state_peak


_local = threading.local()


class SavedTensors:
    """Counts the distinct storages autograd saves during one chunk's forward (parameters
    and buffers aside: model state), as a `saved_tensors_hooks` pair; `bytes_with`
    adds the chunk's outputs and activation inputs, each storage once. A recomputed region
    saves nothing through the hooks (checkpointing packs its own): it reports the inputs
    it keeps instead (`keep_inputs`)."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude  # storages of the chunk's parameters and buffers
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)  # the same while ZeRO-3 frees and refills it
        if key not in self.exclude:
            self.storages[key] = t.untyped_storage().nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Count what forwards on this thread keep for backward, until the block ends."""
        before = getattr(_local, "kept", None)
        _local.kept = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            _local.kept = before

    def bytes_with(self, tensors: list[torch.Tensor]) -> int:
        seen = dict(self.storages)
        for t in tensors:
            seen[storage_key(t)] = t.untyped_storage().nbytes()
        return sum(seen.values())


def keep_inputs(tensors: Iterable[Any]) -> None:
    """Count `tensors` as kept for backward by the chunk forward now counting, if any."""
    kept = getattr(_local, "kept", None)
    if kept is not None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                kept.pack(t)
