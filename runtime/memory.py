"""Memory ledger per rank: what the rank holds, by category, and the step's peak.

On CUDA the allocator's own peak is the truth; on CPU we count the tensors we own:
parameters, gradients, optimizer state and the activations saved for backward.
"""

from __future__ import annotations

from typing import Any

import torch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryLedger:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.static = 0
        self._peak = 0

    def start_step(self, params: dict[int, list[torch.nn.Parameter]],
                   optim: dict[int, torch.optim.Optimizer]) -> None:
        """Parameters + gradients + optimizer state (the latter exists after the first step)."""
        ps = [p for group in params.values() for p in group]
        state = sum(_nbytes(v) for o in optim.values() for st in o.state.values()
                    for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        self.static = sum(2 * _nbytes(p) for p in ps) + state
        self._peak = self.static
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def observe(self, saved: dict[Any, Any]) -> None:
        live = 0
        for s in saved.values():
            live += sum(_nbytes(t) for t in s.outputs.values())
            live += sum(_nbytes(t) for _, t in s.acts)
        self._peak = max(self._peak, self.static + live)

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._peak
