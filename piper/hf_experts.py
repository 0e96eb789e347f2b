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
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                           ) -> torch.Tensor:
    """The experts interface's call, as transformers' own implementations take it."""
    return routed_forward(self, hidden_states, top_k_index, top_k_weights)


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _piper_experts_forward)


def stored_as_of(model_type: str) -> Any:
    """`ModelSpec.stored_as` for a transformers model type: its checkpoints may name modules
    as older versions did and keep each expert's FFN apart (Mixtral's
    `block_sparse_moe.experts.3.w1.weight`), which transformers' own conversion mapping
    renames and merges into the stacked parameters at load time (`MergeModulelist` stacks
    the experts, `Concatenate` joins gate and up); here the same mapping says which stored
    tensors make a parameter, so each rank reads only its own experts. None when
    transformers has no mapping for the type."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    mapping = get_checkpoint_conversion_mapping(model_type) or []
    renames = [(_plain(r.source_patterns[0]), _plain(r.target_patterns[0])) for r in mapping
               if type(r).__name__ == "WeightRenaming"]
    merges = []
    for c in mapping:
        ops = [type(o).__name__ for o in getattr(c, "operations", ())]
        if type(c).__name__ != "WeightConverter" or not ops or ops[0] != "MergeModulelist":
            continue
        if set(ops) - {"MergeModulelist", "Concatenate"}:
            continue  # a layout this reader does not take apart: stored as it is, or refused
        cat = next((o.dim - 1 for o in c.operations if type(o).__name__ == "Concatenate"), 0)
        target = c.target_patterns if isinstance(c.target_patterns, str) else c.target_patterns[0]
        merges.append((target, [s.replace("*", "{e}") for s in c.source_patterns], cat))
    if not merges and not renames:
        return None

    def stored(name: str, names: Any) -> str | tuple[tuple[str, ...], int] | None:
        if name in names:
            return None
        for stored_as, loaded_as in renames:
            if name.replace(loaded_as, stored_as) in names:
                return name.replace(loaded_as, stored_as)
        for target, sources, cat in merges:
            if not name.endswith(target):
                continue
            prefix = name[:-len(target)]
            for stored_as, loaded_as in [("", ""), *renames]:  # checkpoint -> model names
                parts = tuple((prefix + s).replace(loaded_as, stored_as) if loaded_as
                              else prefix + s for s in sources)
                if all(p.format(e=0) in names for p in parts):
                    return parts, cat
        return None

    return stored


def _plain(pattern: str) -> str:
    """A renaming pattern as the plain text it matches (transformers writes them as regular
    expressions of literal module names)."""
    return pattern.replace("\\.", ".").replace("^", "").replace("$", "")
