"""The loss's kernels: a language model's cross-entropy streams the logits several times.

The model file's `loss_fn` runs outside the captured graph, after the output stage, but
its kernels run on the output stage's device every microbatch: a cross-entropy over a
vocabulary of V reads and writes batch x tokens x V elements a few times (log-softmax
forward, its gradient backward), in fp32 under autocast. For small models with large
vocabularies that is a fifth of the step (MPT-125M: 50,368 entries against a 768-wide
model); fused-loss work such as Liger-Kernel and Cut Cross-Entropy (Wijmans et al. 2024,
arXiv 2411.09009) exists because of it. Here the loss runs on meta tensors and each ATen
op it dispatches is recorded with the bytes it moves, as the captured graph's ops are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.export.graph_signature import OutputKind
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from piper.capture import Captured

_GATHERS = ("aten::nll_loss_forward", "aten::gather", "aten::index")
"""Ops that read only the entries they pick (the target's log-probability per token)."""


class _Recorder(TorchDispatchMode):
    """Counts the non-view ATen ops run under it by the bytes they read and write."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if any(r.alias_info is not None for r in schema.returns):
            return out
        written = _size(out)
        moved = 2 * written if schema.name.startswith(_GATHERS) else (
            _size((args, kwargs)) + written)
        if moved:
            self.ops[moved] = self.ops.get(moved, 0) + 1
        return out


def _size(x: object) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(x)
               if isinstance(t, torch.Tensor))


def loss_kernels(captured: Captured, outputs: Sequence[Any]) -> dict[int, int]:
    """{bytes moved: count} of the loss's forward kernels on the model's outputs; `outputs`
    are the captured graph's flat outputs on meta (what running it returns). Empty without
    a loss or where it cannot run on meta."""
    if captured.loss is None:
        return {}
    kinds = [s.kind for s in captured.program.graph_signature.output_specs]
    recorder = _Recorder()
    try:
        user = [v for v, k in zip(outputs, kinds, strict=True) if k == OutputKind.USER_OUTPUT]
        model_output = pytree.tree_unflatten(user, captured.out_spec)
        with recorder:
            captured.loss(model_output, captured.targets)
    except Exception:  # noqa: BLE001 - a loss that needs real values: left unpriced
        return {}
    return recorder.ops
