"""Found strategies as the configs of the frameworks users already run: torchtitan's job
TOML, Megatron-LM's arguments, DeepSpeed's JSON (`piper-plan export --to`, `search --to`),
and back (`simulate --from`). May import piper, runtime, cost_models and planner.search.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner.report.frameworks.deepspeed import deepspeed_config
from planner.report.frameworks.layout import Exported, Layout, layout
from planner.report.frameworks.megatron import megatron_args
from planner.report.frameworks.torchtitan import torchtitan_config

TARGETS: dict[str, Callable[[Layout], Exported]] = {
    "torchtitan": torchtitan_config, "megatron": megatron_args, "deepspeed": deepspeed_config}
"""--to TARGET -> the writer of its config."""
SUFFIX = {"torchtitan": ".toml", "megatron": ".args", "deepspeed": ".json"}
"""The file each target's config goes in beside best_strategy.py."""



def write_config(target: str, path: Path, program: Any, summary: dict[str, Any],
                 global_batch: int, gpus: int, spec: Any, precision: str) -> Exported:
    """Write `program` (a search's record: its Program and summary) as `target`'s config to
    `path`; returns what was written, with its notes."""
    exported = TARGETS[target](layout(program, summary, global_batch, gpus, spec, precision))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(exported.text)
    return exported


__all__ = ["SUFFIX", "TARGETS", "Exported", "Layout", "layout", "write_config"]
