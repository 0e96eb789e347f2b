"""Automatic regions for a model nobody tagged: its repeated blocks, what runs before them,
what runs after.

Transformers of every family share one shape: an embedding, a `nn.ModuleList` of identical
blocks, a head. The longest such list gives regions `layer.0..N-1`; every other module with
parameters that is not inside it (nor one of its ancestors) is tagged when it runs: `embed`
if no block has run yet in this forward, else `head`. Deciding at call time, not by
registration order, puts a module registered after the final norm but called first into
`embed`. Parameter-free modules (a rotary table, a mask) stay untagged glue, which every
stage that needs it recomputes when it depends on nothing but the batch and buffers.
Modules sharing a region share one tag, so `embed` is one region however many modules it
holds.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from functools import partial

from torch import nn

from piper.annotate import annotate, fixed_tag, tag_calls
from piper.errors import PiperError


@dataclass
class AutoRegions:
    """The blocks chosen, and which modules ran in `embed` and `head` (for the one line
    that tells the user what was chosen)."""

    blocks: str
    count: int
    embed: list[str] = field(default_factory=list)
    head: list[str] = field(default_factory=list)
    started: bool = False

    def describe(self, layers: int | None = None) -> str:
        """`layers`: how many the planned graph has (a folded capture traced fewer)."""
        n = self.count if layers is None else layers
        last = f"layer.0-{n - 1}" if n > 1 else "layer.0"
        return (f"regions: embed ({_modules(self.embed)}), {last}, "
                f"head ({_modules(self.head)}) [automatic: blocks of {self.blocks}]")


def _modules(names: list[str]) -> str:
    return f"{len(names)} module{'s' if len(names) != 1 else ''}"


def find_blocks(model: nn.Module) -> str:
    """Path of the longest `nn.ModuleList` whose children are all of one class."""
    best, size = None, 0
    for path, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > size and len({type(c) for c in m}) == 1:
            best, size = path, len(m)
    if best is None:
        raise PiperError(f"{type(model).__name__}: no regions tagged and no nn.ModuleList of "
                         "repeated blocks to take them from; tag regions with "
                         "piper.annotate or piper.annotate_modules")
    return best


def annotate_automatically(model: nn.Module, blocks: str | None = None) -> AutoRegions:
    """Tag `model`'s regions by the rule in the module docstring (blocks: the list's path,
    default the longest list of same-class blocks). Returns the record the tags fill in."""
    blocks = blocks if blocks is not None else find_blocks(model)
    layers = model.get_submodule(blocks)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise PiperError(f"{type(model).__name__}: {blocks!r} is not a non-empty "
                         "nn.ModuleList of blocks")
    auto = AutoRegions(blocks, len(layers))
    prefix = f"{blocks}."
    ancestors = {blocks.rsplit(".", k)[0] for k in range(1, blocks.count(".") + 1)} | {""}
    taken: list[str] = []
    for path, m in model.named_modules():
        if path in ancestors or path == blocks or path.startswith(prefix):
            continue
        if any(path.startswith(t + ".") for t in taken):
            continue
        if next(m.parameters(), None) is None:
            continue  # no state to place: its ops are glue (`piper.capture`)
        taken.append(path)
        _tag_by_time(m, path, auto)
    for block in layers:
        tag_calls(block, partial(annotate, "layer"))
    model.register_forward_pre_hook(lambda _m, _a: setattr(auto, "started", False))
    layers[0].register_forward_pre_hook(lambda _m, _a: setattr(auto, "started", True))
    return auto


def _tag_by_time(module: nn.Module, path: str, auto: AutoRegions) -> None:
    """`embed` before the first block runs, `head` after; one fixed tag per region."""
    def region() -> contextlib.AbstractContextManager:
        seen = auto.head if auto.started else auto.embed
        if path not in seen:
            seen.append(path)
        return fixed_tag("head" if auto.started else "embed")

    tag_calls(module, region)
