"""`piper-plan search`: capture, search, optionally measure the best few, write the outputs
(each step a library call)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from piper.errors import PiperError


def search(args: argparse.Namespace) -> int:
    from cost_models.accuracy import accuracy_line
    from planner.commands.common import (
        EXIT_FAILED,
        EXIT_OK,
        batch_of,
        cluster_of,
        device_of,
        emit,
        experts_note,
        log,
        planned_precision,
        spec_of,
        tell_regions,
    )
    from planner.report.advice import context_fit, warnings_for
    from planner.report.export import write_figures, write_outputs
    from planner.report.tables import pareto, predicted_line, results_table, summary_line, unused
    from planner.search.evaluate import Evaluator
    from planner.search.replicas import stands_for
    from planner.search.space import PRICED_AS, search_space

    spec = spec_of(args)
    if args.trials < 1:
        raise PiperError(f"--trials must be >= 1, got {args.trials}")
    if args.measure < 0:
        raise PiperError(f"--measure must be >= 0, got {args.measure}")
    device = None
    if args.measure:  # refuse a run this machine cannot host before searching, not after
        from runtime.cluster.launcher import check_workers

        device = device_of(args)
        check_workers(args.gpus, device, args.address)
    cluster, cluster_name = cluster_of(args, announce=True)
    batch = batch_of(args, spec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    storage = args.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    if args.storage:
        from planner.search.loop import open_storage

        open_storage(storage)  # a bad URL is said now, not after the capture
    t0 = time.perf_counter()
    ev = Evaluator(spec, args.gpus, batch, cluster, precision=planned_precision(args, cluster),
                   expert_skew=args.expert_skew, **PRICED_AS.get(args.target or "", {}))
    graph = ev.graph
    folded = "".join(f"; traced 2 of {r.length} identical {r.fqn}" for r in ev.captured.folded)
    log(f"captured {spec.path}: {len(graph.regions)} regions, "
        f"{sum(r.param_numel for r in graph.regions) / 1e6:,.1f}M parameters{folded} "
        f"({time.perf_counter() - t0:.1f} s)")
    tell_regions(ev)
    router = experts_note(args, graph)
    if router:
        log(router)
    space, dropped = search_space(ev, cluster.gpus_per_node)
    for line in dropped:
        log(f"left out {line}")
    if args.target:  # only what the framework runs, priced as it runs; its config written
        from planner.search.space import target_space

        space = target_space(space, args.target, ev)
        args.to = [*(args.to or ()), args.target]
        log(f"target {args.target}: the space holds only what {args.target} runs")
    log(f"search space: {len(space.points())} valid strategies; {args.trials} trials, "
        f"{args.sampler} sampler, {args.backend} backend")
    common = {"trials": args.trials, "timeout": args.timeout, "sampler": args.sampler,
                  "storage": storage, "study_name": args.study_name, "seed": args.seed}
    # a Ray search that measures after keeps one Ray: a second join of a cluster through
    # Ray Client right after the first can fail on a loaded head (and a local Ray's start
    # is the slow part of measuring)
    one_ray: Any = contextlib.nullcontext()
    if args.backend == "ray" and args.measure > 0:
        from runtime.cluster.join import joined

        one_ray = joined(args.address, [spec.source[0]])
    with one_ray:
        if args.backend == "ray":
            from planner.search.ray_search import run_ray_search

            result = run_ray_search(ev, space, address=args.address, out=str(out), **common)
        else:
            from planner.search.loop import run_search

            result = run_search(ev, space, progress=not args.json, **common)
        log(f"{result.trials + result.pruned_trials + result.failed_trials} trials: "
            f"{result.trials} simulated ({result.trials - result.repeats} distinct "
            "strategies, "
            f"{result.feasible_trials} of them fit in memory), "
            f"{result.pruned_trials} pruned (invalid or over memory by formula), "
            f"{result.failed_trials} failed")
        measured: list[Any] = []
        if args.measure and result.best is not None:
            from planner.report.tables import measured_table
            from planner.search.measure import measure

            log(f"measuring the {args.measure} best predicted strategies on {args.gpus} "
                f"{device} workers")
            if args.cluster is None or (device == "cpu" and cluster_name != "cpu"):
                log(f"  predicted times are for {cluster_name}, measured ones for this "
                    "machine: compare the order, not the values (--cluster FILE from "
                    "`piper-plan profile` predicts this machine)")
            measured = measure(spec, result.records, args.measure, gpus=args.gpus,
                               batch_size=batch, device=device, seed=args.seed,
                               address=args.address, log=log, per_node=cluster.gpus_per_node)
            log(measured_table(measured))
            if measured and measured[0].median_s is not None:
                result = dataclasses.replace(result, best=measured[0].record)
    recipe = None  # the framework's own default, priced once for both uses below
    if args.target and result.best is not None:
        from planner.report.frameworks.recipes import best_recipe
        from planner.search.space import layer_units_mb

        recipe = best_recipe(args.target, ev, layer_units_mb(ev))
        result = _recipe_if_faster(args.target, recipe, result)
    files = write_outputs(out, spec, cluster_name, args.gpus, batch, result, ev.precision)
    log(results_table(result.records))
    total = time.perf_counter() - t0
    best_eval = ev.evaluate(result.best.program) if result.best is not None else None
    warnings = warnings_for(gpus=args.gpus, batch=batch, result=result,
                            best_spans=list(best_eval.prediction.spans) if best_eval else [],
                            best_summary=result.best.summary if result.best else None,
                            memory_bytes=cluster.memory_bytes)
    if result.best is None:
        log(f"no feasible strategy among {result.trials} trials (memory limit "
            f"{cluster.memory_bytes / 1024**3:.0f} GiB per device)")
        for w in warnings:
            log(f"warning: {w}")
        if args.json:
            emit({"best": None, "trials": result.trials, "feasible_trials": 0,
                   "search_time_s": total, "pareto": [], "warnings": warnings})
        return EXIT_FAILED
    b = result.best
    files.update(write_figures(out, best_eval, result, memory_limit_bytes=cluster.memory_bytes,
                               stands_for=stands_for(best_eval.plan, cluster)))
    for target in dict.fromkeys(args.to or ()):  # the best as the frameworks' configs
        from planner.report.frameworks import SUFFIX, write_config

        path = out / f"best_{target}{SUFFIX[target]}"
        try:
            done = write_config(target, path, b.program, b.summary, batch, args.gpus, spec,
                                ev.precision)
        except PiperError as e:  # the search stands; the target cannot run its pick
            log(f"warning: --to {target}: {e}")
            continue
        files[f"{target}_config"] = path
        for note in done.notes:
            log(f"{target}: {note}")
    left = unused(b.summary)
    # the bound of every point without CP only where no trial without it fit (else there
    # is nothing to say, and a large space takes minutes)
    fit = context_fit(result, _least_without_cp(space, ev, cluster.memory_bytes)
                      if b.summary.get("cp", 1) > 1 and not any(
                          r.feasible and r.summary.get("cp", 1) == 1 for r in result.records)
                      else None, cluster.memory_bytes)
    if fit:
        log(f"note: {fit}")
    parts = ev.memory_parts(best_eval)
    top = max(range(len(parts)), key=lambda i: parts[i].total)
    log(f"best: {summary_line(b.summary)}\n      {predicted_line(b.predicted)}\n"
        f"      memory of rank {best_eval.prediction.ranks[top]} at its peak: "
        f"{parts[top].line()}\n"
        + (f"      {'; '.join(left)}\n" if left else "")
        + f"wrote {files['strategy_file']} and {files['strategy_json']} ({total:.1f} s), "
        f"{files['timeline'].name}, {files['pareto'].name}, {files['trace'].name}, "
        f"{files['trials'].name} (every trial) and {files['summary'].name}")
    for w in warnings:
        log(f"warning: {w}")
    default = _target_default(args.target, recipe, b) if args.target else None
    said = accuracy_line(cluster.name, moe=bool(ev.graph.experts))
    log(said)
    if args.json:
        best: dict[str, Any] = {"strategy_file": str(files["strategy_file"]),
                                "program": json.loads(b.program.to_json()),
                                "summary": b.summary, "predicted": b.predicted,
                                "unused": left,
                                "memory": {"rank": best_eval.prediction.ranks[top],
                                           **dataclasses.asdict(parts[top])}}
        obj: dict[str, Any] = {
            "best": best,
            "trials": result.trials,
            "feasible_trials": result.feasible_trials,
            "search_time_s": total,
            "pareto": [{"trial": r.number, "summary": r.summary, "predicted": r.predicted}
                       for r in pareto(result.records)],
            "distinct_strategies": result.trials - result.repeats,
            "warnings": warnings,
            "notes": [n for n in (fit, router) if n],
            "accuracy": said,
        }
        if default is not None:
            obj["target_default"] = default
        if measured:
            winner = measured[0]
            if winner.median_s is not None:
                best["measured"] = {"step_time_s": winner.median_s,
                                    "peak_memory_bytes": list(winner.peak_memory_bytes)}
            obj["measured"] = [m.json() for m in measured]
        emit(obj)
    else:
        print(b.program.to_python([f"best of {result.trials} trials: {summary_line(b.summary)}"]))
    return EXIT_OK


def _least_without_cp(space: Any, ev: Any, limit: int) -> int | None:
    """The fewest bytes per device any strategy of `space` without context parallelism
    needs, by the memory bound (milliseconds a point), or the first found within `limit`
    (one that fits is all `context_fit` needs to know); None: the space has none."""
    least = None
    for p in space.points():
        if p.get("cp", 1) != 1:
            continue
        for v in space.variants(p):
            need = ev.peak_memory_bound(space.program(**v))
            least = need if least is None else min(least, need)
            if least <= limit:
                return least
    return least


def _recipe_if_faster(target: str, found: Any, result: Any) -> Any:
    """`result` with the framework's own default recipe (`found`: its label and
    evaluation, or None) as its best when no trial beat it: a targeted search answers with
    at least what the framework would run by default."""
    from cost_models import predicted_json
    from planner.commands.common import log
    from planner.search.records import TrialRecord

    if found is None:
        return result
    label, e = found
    pred = predicted_json(e.prediction)
    if pred["step_time_s"] >= result.best.predicted["step_time_s"]:
        return result
    log(f"target {target}: its default ({label}) is predicted faster than every trial: "
        "the pick is that recipe")
    best = TrialRecord(-1, e.program.summary(), e.program, pred, True)
    return dataclasses.replace(result, best=best)


def _target_default(target: str, found: Any, best: Any) -> dict[str, Any] | None:
    """The framework's own default recipe for the model (`found`), in the same simulator,
    against the targeted search's pick: said on stderr, returned for --json."""
    from cost_models import predicted_json
    from planner.commands.common import log
    from planner.report.tables import predicted_line

    if found is None:
        log(f"{target}'s default recipes: none fits or applies to this model and cluster")
        return None
    label, e = found
    pred = predicted_json(e.prediction)
    gain = pred["step_time_s"] / best.predicted["step_time_s"]
    log(f"{target}'s default for this model ({label}): {predicted_line(pred)}\n"
        f"      the pick is {gain:.2f}x its speed")
    return {"label": label, "summary": e.summary, "predicted": pred, "speedup": gain}
