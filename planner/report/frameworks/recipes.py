"""Each framework's own default recipe for a model's size, priced in the same simulator, so
a targeted search (`search --target`) says how much its pick gains over what the framework
would run by default.

- torchtitan (torchtitan/models/llama3/train_configs; docs/composability): FSDP over every
  device, one unit per transformer block; from 20B parameters FSDP + TP 8 (with SP, as its
  TP plan does); from 200B also PP 8 (1F1B);
- Megatron-LM (Megatron-Bridge's DGX-H100 performance recipes, ../shared/published/
  gpu_runs.md section 6b): below 20B tp1; below 200B tp4 pp8 vp5 (its 70B recipe); above,
  tp8 pp8 vp8 (405B), with SP and the distributed optimizer;
- DeepSpeed: ZeRO-3 over every device, its parameters gathered in its default prefetch
  window (stage3_prefetch_bucket_size, 5e7 elements).

Each at its fastest microbatch of 1, 2, 4 or 8 samples that fits, with and without full
recompute (as a user tunes a recipe first).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from piper.errors import PiperError
from search_spaces import Infeasible


@dataclass(frozen=True)
class Recipe:
    label: str
    tp: int
    pp: int
    zero: int
    schedule: str = "1f1b"
    v: int = 1
    units: bool = False  # FSDP units of one transformer block
    ddp_buckets: bool = False  # Megatron's DDP buckets (`megatron_bucket_mb`)
    prefetch: bool = False  # DeepSpeed's ZeRO-3 prefetch window (`DEEPSPEED_PREFETCH_MB`)


def megatron_bucket_mb(dp: int) -> float:
    """MiB (fp32 gradients) of Megatron-Core DDP's default bucket with its gradient
    reduction overlapped: max(40M, 1M x dp) parameters (`DistributedDataParallelConfig.
    bucket_size`); without the overlap it makes one bucket."""
    return round(4 * max(40_000_000, 1_000_000 * dp) / 2**20, 3)


def _bucket_mb(r: Recipe, dp: int, unit_mb: float) -> float | None:
    """The bucket (or ZeRO-3 unit) size recipe `r` runs its data-parallel collectives in."""
    from planner.search.space import DEEPSPEED_PREFETCH_MB

    if dp == 1:
        return None
    if r.units:
        return unit_mb
    if r.prefetch:
        return DEEPSPEED_PREFETCH_MB
    return megatron_bucket_mb(dp) if r.ddp_buckets and r.zero < 3 else None


def recipes(target: str, params: float) -> list[Recipe]:
    """`target`'s default layouts for a model of `params` parameters."""
    if target == "torchtitan":
        if params < 20e9:
            return [Recipe("torchtitan's default: FSDP", 1, 1, 3, units=True)]
        if params < 200e9:
            return [Recipe("torchtitan's default: FSDP + TP 8", 8, 1, 3, units=True)]
        return [Recipe("torchtitan's default: FSDP + TP 8 + PP 8", 8, 8, 3, units=True)]
    if target == "megatron":
        if params < 20e9:
            return [Recipe("Megatron's recipe: tp1", 1, 1, 1, ddp_buckets=True)]
        if params < 200e9:
            return [Recipe("Megatron's recipe: tp4 pp8 vp5", 4, 8, 1, "interleaved-1f1b", 5,
                           ddp_buckets=True)]
        return [Recipe("Megatron's recipe: tp8 pp8 vp8", 8, 8, 1, "interleaved-1f1b", 8,
                       ddp_buckets=True)]
    return [Recipe("DeepSpeed's default: ZeRO-3", 1, 1, 3, prefetch=True)]


def best_recipe(target: str, evaluator: Any, unit_mb: float) -> tuple[str, Any] | None:
    """(label, Evaluation) of the fastest fitting default recipe of `target` for the
    evaluator's model, or None where none fits or applies (a layout that does not divide the
    devices or the batch, a model without enough layers)."""
    best = None
    for r in recipes(target, sum(evaluator.costs.params)):
        found, _ = best_setting(r, evaluator, unit_mb)
        if found is not None and (best is None or found[1].prediction.step_time_s
                                  < best[1].prediction.step_time_s):
            best = (f"{r.label}, {found[0]}", found[1])
    return best


def best_setting(r: Recipe, evaluator: Any, unit_mb: float
                 ) -> tuple[tuple[str, Any] | None, list[str]]:
    """The fastest fitting microbatch size and recompute setting of recipe `r` as
    ("mb N[, recompute]", Evaluation) or None, and a line for each setting tried."""
    from planner.search.strategy import shorthand_program

    ev = evaluator
    if ev.gpus % (r.tp * r.pp):
        return None, [f"tp {r.tp} x pp {r.pp} does not divide {ev.gpus} devices"]
    dp = ev.gpus // (r.tp * r.pp)
    best, tried = None, []
    for mbs in (1, 2, 4, 8):
        if ev.batch_size % (dp * mbs):
            continue
        for recompute in (False, True):
            setting = f"mb {mbs}" + (", recompute" if recompute else "")
            args = argparse.Namespace(
                pp=r.pp, dp=dp, tp=r.tp, ep=1, zero=r.zero if dp > 1 else 0,
                schedule=r.schedule if r.pp > 1 else "none",
                virtual_stages=r.v if r.v > 1 else None,
                microbatches=ev.batch_size // (dp * mbs), recompute=recompute,
                bucket_mb=_bucket_mb(r, dp, unit_mb),
                comm_stream=dp > 1 and r.zero < 3, sp=r.tp > 1)
            try:
                e = ev.evaluate(shorthand_program(args, ev.gpus, ev.graph.names,
                                                  ev.region_costs()))
            except (PiperError, Infeasible) as err:  # the layout does not fit this model
                tried.append(f"{setting}: {err}")
                continue
            p = e.prediction
            fits = p.max_memory_bytes <= ev.cluster.memory_bytes
            tried.append(f"{setting} {p.step_time_s:.2f}s{'' if fits else ' (no fit)'}")
            if fits and (best is None or p.step_time_s < best[1].prediction.step_time_s):
                best = (setting, e)
    return best, tried or [f"a batch of {ev.batch_size} does not split over dp={dp}"]
