"""`piper-plan simulate`: one strategy's predicted step, memory and timeline on a cluster."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from planner.commands.common import (
    EXIT_OK,
    apply_from,
    batch_of,
    cluster_of,
    emit,
    experts_note,
    log,
    planned_precision,
    program_of,
    spec_of,
    tell_regions,
)


def simulate(args: argparse.Namespace) -> int:
    from cost_models import predicted_json
    from planner.report.tables import predicted_line, summary_line
    from planner.report.trace import write_trace
    from planner.search.evaluate import Evaluator

    spec = spec_of(args)
    if args.from_:
        apply_from(args)
    cluster, _ = cluster_of(args, announce=False)
    ev = Evaluator(spec, args.gpus, batch_of(args, spec), cluster,
                   precision=planned_precision(args, cluster), expert_skew=args.expert_skew,
                   # what a framework's config overlaps where piper's runtime does not
                   tp_overlap=getattr(args, "tp_overlap", False),
                   param_gather_overlap=getattr(args, "param_gather_overlap", False))
    tell_regions(ev)
    router = experts_note(args, ev.graph)
    if router:
        log(router)
    if getattr(args, "unit_per_layer", False):  # --from torchtitan: FSDP unit per block
        from planner.search.space import layer_units_mb

        args.bucket_mb = layer_units_mb(ev, args.tp)
    result = ev.evaluate(program_of(args, ev))
    pred = predicted_json(result.prediction)
    if args.trace:
        write_trace(result.prediction.spans, args.trace)
    if args.timeline:
        from planner.report.plots import write_timeline
        from planner.search.replicas import stands_for

        write_timeline(result.prediction.spans, args.timeline,
                       stands_for=stands_for(result.plan, cluster),
                       title=f"{summary_line(result.summary)} on {cluster.name}")
    parts = ev.memory_parts(result)
    top = max(range(len(parts)), key=lambda i: parts[i].total)
    rank = result.prediction.ranks[top]
    if args.json:
        emit({"predicted": pred, "summary": result.summary,
               "memory": {"rank": rank, **dataclasses.asdict(parts[top])}})
    else:
        print(f"summary:   {summary_line(result.summary)}")
        print(f"predicted: {predicted_line(pred)}")
        print(f"           step time {pred['step_time_s']!r} s, bubble "
              f"{result.prediction.bubble_fraction * 100:.1f}%")
        fits = "fits" if parts[top].total <= cluster.memory_bytes else "DOES NOT FIT"
        print(f"memory:    rank {rank} at its peak: {parts[top].line()}; {fits} "
              f"{cluster.memory_bytes / 2**30:.0f} GiB")
        print("\n".join(_usage_lines(result.prediction, _alike(result.plan, cluster))))
    return EXIT_OK


def _usage_lines(pred: Any, alike: dict[int, int], most: int = 16) -> list[str]:
    """Per simulated rank: model math and idle time of the compute stream, each stream's
    busy time, and how many other replicas run alike (`alike`: rank -> count)."""
    unit, scale = ("ms", 1e3) if pred.step_time_s >= 1e-3 else ("µs", 1e6)
    lines = []
    for i, (r, busy, idle) in enumerate(zip(pred.ranks, pred.busy_s, pred.idle_s,
                                            strict=True)):
        if i == most:
            lines.append(f"           ... {len(pred.busy_s) - most} more ranks (see --trace)")
            break
        streams = ", ".join(f"{u.stream} {u.busy_s * scale:.3f}" for u in pred.streams
                            if u.rank == r)
        more = alike.get(r, 0)
        also = f" (and {more} replica{'s' if more > 1 else ''} alike)" if more else ""
        lines.append(f"           rank {r}{also}: math {busy * scale:.3f} {unit}, idle "
                     f"{idle * scale:.3f} {unit}; busy streams: {streams} {unit}")
    return lines


def _alike(plan: Any, cluster: Any) -> dict[int, int]:
    """Logical rank of each simulated replica -> the other replicas it stands for."""
    from planner.search.replicas import replica_kinds

    kinds = replica_kinds(plan.mesh, cluster)
    return {rp.rank: len(kinds.get(rp.replica, (rp.replica,))) - 1 for rp in plan.ranks}
