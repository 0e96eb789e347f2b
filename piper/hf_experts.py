"""The experts of unmodified Hugging Face MoE models, run as piper's routed experts.

transformers (5.x) builds the experts of its MoE families on one interface
(`@use_experts_implementation`): the E expert FFNs stacked in one module, `gate_up_proj`
(or `up_proj` for an ungated FFN) and `down_proj`, optional biases, stored transposed in
some families, the gate and activation in the module's own `_apply_gate` / `act_fn`, called
as `experts(hidden_states, top_k_index, top_k_weights)` after the model's router. Only the
experts' computation is swapped, through transformers' own extension point (an experts
implementation registered under `IMPLEMENTATION`, chosen with `set_experts_implementation`):
the router (top-k, normalisation, shared experts, auxiliary losses) stays the model's code,
and the experts run as `piper.moe.routed_forward` with the model's own weights, gate and
activation, so expert parallelism can shard them.

A model whose experts are not all of that form keeps its own implementation and runs
unsharded; `experts_notes` says which module could not be mapped and why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from piper.moe import ExpertFFN, routed_forward

IMPLEMENTATION = "piper"
"""The name piper's routed experts are registered under in transformers' ExpertsInterface."""


def _interface_experts(module: nn.Module) -> bool:
    """Built on transformers' experts interface (its decorator sets these attributes)."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed",
                                            "num_experts"))


def experts_ffn(module: nn.Module) -> ExpertFFN | str:
    """How `module` (an interface experts module) computes each expert, or why piper cannot
    run it."""
    if getattr(module, "has_post_expert_norm", False):
        return "it normalises each expert's output with a module of its own"
    gated, bias = bool(module.has_gate), bool(module.has_bias)
    up = "gate_up_proj" if gated else "up_proj"
    names = (up, "down_proj", *((f"{up}_bias", "down_proj_bias") if bias else ()))
    held = dict(module.named_parameters(recurse=False))
    if set(held) != set(names):
        return f"it holds parameters {', '.join(sorted(held))}, not {', '.join(names)}"
    experts = int(module.num_experts)  # type: ignore[arg-type]
    odd = [n for n in names if held[n].dim() < 2 or held[n].shape[0] != experts]
    if odd:
        return f"its {odd[0]} is not stacked by its {experts} experts"
    activate = module._apply_gate if gated else module.act_fn
    halves = 2 if gated and getattr(module, "is_concatenated", True) else 1
    return ExpertFFN(names, activate, transposed=bool(module.is_transposed), bias=bias,
                     halves=halves)


def experts_notes(model: nn.Module) -> list[str]:
    """Why a model's experts run unsharded, if they do: an interface module piper cannot
    map, or experts written outside the interface. Empty when every experts module maps."""
    for name, m in model.named_modules():
        if _interface_experts(m):
            why = experts_ffn(m)
            if isinstance(why, str):
                return [f"expert parallelism: off ({name}: {type(m).__name__}: {why})"]
    for name, m in model.named_modules():
        kind = type(m).__name__
        if (kind.endswith("Experts") and "Shared" not in kind and not _interface_experts(m)
                and any(p.dim() >= 2 for p in m.parameters())):
            return [(f"expert parallelism: off ({name}: {kind} is not built on "
                     "transformers' experts interface)")]
    return []


def adopt_experts(model: nn.Module) -> int:
    """Give every interface experts module of `model` its `piper_ffn` and run them all as
    piper's routed experts; none when any of them cannot be mapped (`experts_notes`).
    Returns how many were adopted."""
    found = [m for m in model.modules() if _interface_experts(m)]
    ffns = [experts_ffn(m) for m in found]
    if not found or any(isinstance(f, str) for f in ffns):
        return 0
    for m, ffn in zip(found, ffns):
        m.piper_ffn = ffn
    _register()
    model.set_experts_implementation(IMPLEMENTATION)  # type: ignore[operator]
    return len(found)


def _piper_experts_forward(self: nn.Module, hidden_states: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                           *_: Any) -> torch.Tensor:
    return routed_forward(self, hidden_states, top_k_index, top_k_weights)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _piper_experts_forward)
