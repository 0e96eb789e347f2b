"""The space a search walks: the model's default space with activation recompute, a comm
stream for gradient collectives and bucket sizes of data-parallel collectives as choices,
less the tensor/expert-parallel degrees (and pairs of them) its code cannot run at.

`model_space` allows a TP degree when every TP_PLAN linear divides by it, but the model's
forward may still not run split that way (attention heads fewer than the degree, a reshape
with a hard-coded size). Capturing each degree once (two layers of it, `planner.search.repeats`)
finds out before the search, so no trial is spent on a degree that can never run, and every
worker of a Ray search finds the captures ready.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from piper.context_parallel import check_length
from piper.sharding import ModelSharding
from planner.search.evaluate import Evaluator
from search_spaces import Infeasible
from search_spaces.pipeline import PipelineSpace, model_space

BUCKETS_MB = (0, 25, 100)
"""Bucket caps tried (MiB; 0: one per stage): DDP's default and a coarser one; with ZeRO
they are its units (FSDP's), whose reduce-scatters start inside the backward."""


MIN_CP_TOKENS = 1024
"""Fewest tokens a context-parallel rank keeps in a searched point: below that a layer's
attention is a small share of its work and splitting the sequence only adds traffic
(torchtitan and Megatron-LM apply CP to long sequences; a strategy file may use any)."""


def context_degrees(seq: int, gpus: int) -> tuple[int, ...]:
    """Context-parallel degrees a search tries for sequences of `seq` tokens: those that
    divide the devices and cut the sequence into 2 x cp equal chunks of enough tokens."""
    return tuple(c for c in range(1, gpus + 1) if gpus % c == 0 and (
        c == 1 or (check_length(seq, c) is None and seq // c >= MIN_CP_TOKENS)))


RECOMPUTES = (False, True, "attention", "op")
"""Recompute choices a search tries: none, full, and the selective policies
(`piper.Recompute`)."""


DEEPSPEED_PREFETCH_MB = round(4 * 50_000_000 / 2**20, 3)
"""DeepSpeed's default ZeRO-3 prefetch window, stage3_prefetch_bucket_size = 5e7 elements,
as fp32 MiB: the parameters it gathers ahead of use, one window at a time (priced as
units of that size, each gathered under the one before)."""

DEEPSPEED_REDUCE_MB = round(4 * 500_000_000 / 2**20, 3)
"""DeepSpeed's default reduce_bucket_size (and its ZeRO-0 all-reduce buffer), 5e8
elements, as fp32 MiB."""

TARGETS: dict[str, dict[str, Any]] = {
    # torchtitan 0.2: DDP, or FSDP2 resharding after forward or not (ZeRO 3 / 2), every
    # torch.distributed.pipelining schedule, TP always with SP, full or per-op AC, one FSDP
    # unit per transformer block
    "torchtitan": {"zeros": (0, 2, 3), "recomputes": (False, True, "op"), "sp_with_tp": True,
                   "units": "layer"},
    # Megatron-LM: DDP or the distributed optimizer (ZeRO-1), FSDP2 (ZeRO-3) without a
    # pipeline; 1F1B and interleaved 1F1B; full or selective (core attention) recompute;
    # gradient buckets only with --overlap-grad-reduce; TP with SP (and --tp-comm-overlap);
    # its FSDP2 path wraps each transformer layer
    "megatron": {"zeros": (0, 1, 3), "max_zero_in_pipeline": 1, "buckets_with_stream": True,
                 "units": "layer", "unit_layer_zeros": (3,),
                 "buckets": (0, *BUCKETS_MB[1:], 152.588),  # and its default: 40M parameters
                 "schedules": ("1f1b", "interleaved-1f1b"), "sp_with_tp": True,
                 "recomputes": (False, True, "attention")},
    # DeepSpeed: no tensor or expert parallelism of its own, ZeRO 0-1 beside a pipeline,
    # its 1F1B-like pipeline schedule, full recompute; gradient reduction overlaps the
    # backward (overlap_comm) at ZeRO 1-3 (ZeRO-0 all-reduces after the last one); always
    # in buckets: its ZeRO-3 prefetch window and reduce bucket defaults, or 25 MiB
    "deepspeed": {"tps": (1,), "eps": (1,), "cps": (1,), "max_zero_in_pipeline": 1,
                  "schedules": ("1f1b",), "recomputes": (False, True), "stream_zeros": (1, 2),
                  "buckets": (BUCKETS_MB[1], DEEPSPEED_PREFETCH_MB, DEEPSPEED_REDUCE_MB)},
}
"""What each framework runs (`search --target`), as limits of the space."""


PRICED_AS: dict[str, dict[str, bool]] = {
    # as the Megatron export runs: --tp-comm-overlap beside SP, --overlap-param-gather with
    # the distributed optimizer and --overlap-grad-reduce
    "megatron": {"tp_overlap": True, "param_gather_overlap": True},
}
"""How each framework runs a strategy where piper's runtime runs it otherwise, as
`Evaluator` pricing options (`search --target`)."""


def layer_units_mb(evaluator: Evaluator, tp: int = 1) -> float:
    """MiB of one transformer block's fp32 parameters on a rank (an FSDP unit per block, as
    torchtitan and Megatron's FSDP2 wrap): the largest `layer.N` region's (else the
    largest region's)."""
    costs = evaluator.costs
    layers = [p for r, p in zip(costs.regions, costs.params, strict=True)
              if r.startswith("layer.")] or list(costs.params)
    return 4 * max(layers) / tp / 2**20


def target_space(space: PipelineSpace, target: str, evaluator: Evaluator) -> PipelineSpace:
    """`space` limited to what framework `target` runs, priced as it runs (`TARGETS`)."""
    limits = dict(TARGETS[target])
    units = limits.pop("units", None)
    if units == "layer":
        limits["unit_layer_mb"] = layer_units_mb(evaluator)
    for name in ("zeros", "tps", "eps", "cps", "recomputes"):
        if name in limits:
            limits[name] = tuple(v for v in limits[name] if v in getattr(space, name))
    if "schedules" in limits:
        limits["schedules"] = tuple(s for s in limits["schedules"] if s in space.schedules)
    if limits.get("sp_with_tp"):
        limits["sps"] = (True,)
    return dataclasses.replace(space, **limits)


def search_space(evaluator: Evaluator, gpus_per_node: int) -> tuple[PipelineSpace, list[str]]:
    """The viable default space, without activation recompute and with each policy of it
    (`RECOMPUTES`), with and without a comm stream,
    with one collective per stage or in buckets (`BUCKETS_MB`), and a line per
    degree left out (with the reason)."""
    ev = evaluator
    space = model_space(ev.graph, ev.region_costs(), ev.gpus, ev.batch_size, gpus_per_node)
    return viable(dataclasses.replace(space, recomputes=RECOMPUTES,
                                      comm_streams=(False, True), buckets=BUCKETS_MB,
                                      sps=(False, True),
                                      cps=context_degrees(ev.costs.tokens_per_sample,
                                                          ev.gpus)), ev)


def viable(space: PipelineSpace, evaluator: Evaluator) -> tuple[PipelineSpace, list[str]]:
    """`space` without the TP/EP degrees whose sharded capture fails, and without the
    (tp, ep) pairs that fail together although each degree runs alone; captures the rest.

    Single degrees go first, so a failing pair never takes a good degree out with it."""
    first: dict[tuple[int, int], dict[str, Any]] = {}
    for p in space.points():
        if p.get("cp", 1) == 1:  # context parallelism is checked on its own, below
            first.setdefault((p.get("tp", 1), p.get("ep", 1)), p)
    bad_tp, bad_ep, bad_pairs, why = set(), set(), [], []
    for (tp, ep), point in sorted(first.items(), key=lambda kv: (min(kv[0]) > 1, kv[0])):
        if (tp, ep) == (1, 1) or tp in bad_tp or ep in bad_ep:
            continue
        try:
            evaluator.sharded_costs(evaluator.skeleton(space.program(**point)).sharding)
        except Infeasible as e:
            if tp > 1 and ep > 1:
                bad_pairs.append((tp, ep))
                why.append(f"tp={tp} with ep={ep}: {e}")
            else:
                (bad_tp if tp > 1 else bad_ep).add(tp if tp > 1 else ep)
                why.append(f"{'tp' if tp > 1 else 'ep'}={tp if tp > 1 else ep}: {e}")
    space = dataclasses.replace(space, tps=tuple(t for t in space.tps if t not in bad_tp),
                                eps=tuple(e for e in space.eps if e not in bad_ep),
                                bad_shardings=tuple(bad_pairs))
    for cp in space.cps[1:2]:  # a model that splits its sequence two ways splits it any
        try:
            evaluator.sharded_costs(ModelSharding(cp=cp))
        except Infeasible as e:
            why.append(f"context parallelism: {e}")
            space = dataclasses.replace(space, cps=(1,))
    if True in space.sps:  # sequence parallelism needs a model whose ops go token by token
        for (tp, ep), point in sorted(first.items()):
            if tp == 1 or ep > 1 or tp in bad_tp:
                continue
            try:
                evaluator.sharded_costs(evaluator.skeleton(
                    space.program(**point, sp=True)).sharding)
            except Infeasible as e:
                why.append(f"sequence parallelism: {e}")
                space = dataclasses.replace(space, sps=(False,))
                break
    return space, why
