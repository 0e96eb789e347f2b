"""`piper-plan`: a thin CLI over the library. Logs go to stderr; `--json` prints one object.

Exit codes: 0 ok; 1 no feasible strategy or `--check` failed; 2 bad input; 3 runtime failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from piper.errors import PiperError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_RUNTIME = 0, 1, 2, 3
DEFAULT_CLUSTER = "h100-80gb"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as DESIGN.md promises
        raise PiperError(message)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    from planner.strategy import add_shorthand_flags

    p = _Parser(prog="piper-plan", description="Search, simulate and run distributed "
                "training strategies for a PyTorch model.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def model_cmd(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help)
        c.add_argument("model", help="model file defining build_model() and example_batch()")
        c.add_argument("--gpus", type=int, required=True, help="devices to plan for")
        c.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                       help="keyword argument for build_model (repeatable)")
        c.add_argument("--batch-size", type=int, help="global batch (default: BATCH_SIZE)")
        c.add_argument("--seed", type=int, default=0)
        c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        return c

    s = model_cmd("search", "search for the best strategy")
    s.add_argument("--cluster", help=f"catalog name or TOML file (default {DEFAULT_CLUSTER})")
    s.add_argument("--trials", type=int, default=64)
    s.add_argument("--timeout", type=float, help="stop asking for trials after S seconds")
    s.add_argument("--sampler", default="tpe", choices=["tpe", "grid"])
    s.add_argument("--backend", default="optuna", choices=["optuna"])
    s.add_argument("--storage", help="Optuna storage URL (default sqlite:///OUT/study.db)")
    s.add_argument("--study-name", default="piper-plan")
    s.add_argument("--device", choices=["cpu", "cuda"])
    s.add_argument("--out", default="piper_plan_out", help="output folder")

    r = model_cmd("run", "train a strategy for real on Ray workers")
    r.add_argument("--strategy", help="strategy file (.py with strategy() or .json)")
    add_shorthand_flags(r)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--device", choices=["cpu", "cuda"])
    r.add_argument("--address", help="existing Ray cluster address")
    r.add_argument("--check", action="store_true",
                   help="compare losses with single-device training (rtol 1e-4)")
    r.add_argument("--trace", help="write the measured timeline as a Perfetto trace")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds before a rank is "
                   "declared hung")

    m = model_cmd("simulate", "predict step time and memory of a strategy")
    m.add_argument("--strategy", help="strategy file (.py with strategy() or .json)")
    add_shorthand_flags(m)
    m.add_argument("--cluster", help=f"catalog name or TOML file (default {DEFAULT_CLUSTER})")
    m.add_argument("--trace", help="write the predicted timeline as a Perfetto trace")

    sub.add_parser("clusters", help="list the built-in cluster catalog")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return {"search": cmd_search, "run": cmd_run, "simulate": cmd_simulate,
                "clusters": cmd_clusters}[args.command](args)
    except PiperError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug of ours: still one line, with the way to see more
        if os.environ.get("PIPER_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {' '.join(str(e).split())} "
              "(set PIPER_DEBUG=1 for a traceback)", file=sys.stderr)
        return EXIT_RUNTIME


# ---- shared --------------------------------------------------------------------------------
def _spec(args: argparse.Namespace) -> Any:
    from piper.model_file import load_model_file, parse_model_args

    if args.gpus < 1:
        raise PiperError(f"--gpus must be >= 1, got {args.gpus}")
    spec = load_model_file(args.model, parse_model_args(args.model_arg))
    if args.batch_size is not None and args.batch_size < 1:
        raise PiperError(f"--batch-size must be >= 1, got {args.batch_size}")
    return spec


def _batch(args: argparse.Namespace, spec: Any) -> int:
    return args.batch_size or spec.batch_size


def _cluster(args: argparse.Namespace, announce: bool) -> tuple[Any, str]:
    from cost_models import load_cluster

    name = args.cluster or DEFAULT_CLUSTER
    if args.cluster is None and announce:
        log(f"cluster: {DEFAULT_CLUSTER} (default; pass --cluster to change)")
    return load_cluster(name), name


def _program(args: argparse.Namespace, ev: Any) -> Any:
    from piper.program import Program
    from planner.strategy import shorthand_program

    if args.strategy:
        shorthand = [f for f in ("pp", "dp", "schedule", "microbatches") if getattr(args, f)]
        if shorthand:
            raise PiperError(f"--strategy and --{shorthand[0]} are mutually exclusive")
        return Program.load(args.strategy)
    return shorthand_program(args, args.gpus, ev.captured.graph.names, ev.region_costs())


def _device(args: argparse.Namespace) -> str:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PiperError("--device cuda: no CUDA device is available here")
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj))


# ---- commands ------------------------------------------------------------------------------
def cmd_clusters(args: argparse.Namespace) -> int:
    from cost_models import CATALOG

    for name, c in CATALOG.items():
        print(f"{name:<11} {c.device:<28} {c.gpus_per_node:>4}/node "
              f"{c.memory_bytes / 1024**3:>6.0f} GiB  {c.flops / 1e12:>7.1f} TFLOP/s")
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from cost_models import predicted_json
    from planner.evaluate import Evaluator
    from planner.report import predicted_line, summary_line
    from planner.trace import write_trace

    spec = _spec(args)
    cluster, _ = _cluster(args, announce=False)
    ev = Evaluator(spec, args.gpus, _batch(args, spec), cluster)
    result = ev.evaluate(_program(args, ev))
    pred = predicted_json(result.prediction)
    if args.trace:
        write_trace(result.prediction.spans, args.trace)
    if args.json:
        _emit({"predicted": pred, "summary": result.summary})
    else:
        print(f"summary:   {summary_line(result.summary)}")
        print(f"predicted: {predicted_line(pred)}")
        print(f"           step time {pred['step_time_s']!r} s, bubble "
              f"{result.prediction.bubble_fraction * 100:.1f}%")
    return EXIT_OK


def cmd_search(args: argparse.Namespace) -> int:
    from cost_models import predicted_json  # noqa: F401 - fail early if cost models are broken
    from planner.evaluate import Evaluator
    from planner.export import write_outputs
    from planner.report import predicted_line, results_table, summary_line
    from planner.search import run_search
    from search_spaces import PipelineSpace
    from search_spaces.pipeline import ALL_SCHEDULES

    spec = _spec(args)
    if args.trials < 1:
        raise PiperError(f"--trials must be >= 1, got {args.trials}")
    cluster, cluster_name = _cluster(args, announce=True)
    batch = _batch(args, spec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    storage = args.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    t0 = time.perf_counter()
    ev = Evaluator(spec, args.gpus, batch, cluster)
    log(f"captured {spec.path}: {len(ev.captured.graph.regions)} regions, "
        f"{sum(r.param_numel for r in ev.captured.graph.regions) / 1e6:,.1f}M parameters")
    space = PipelineSpace(ev.captured.graph.names, ev.region_costs(), args.gpus, batch,
                          schedules=ALL_SCHEDULES, zeros=(0, 1, 2, 3))
    result = run_search(ev, space, trials=args.trials, timeout=args.timeout,
                        sampler=args.sampler, storage=storage, study_name=args.study_name,
                        seed=args.seed, progress=not args.json)
    files = write_outputs(out, spec, cluster_name, args.gpus, batch, result)
    log(results_table(result.records))
    total = time.perf_counter() - t0
    if result.best is None:
        log(f"no feasible strategy among {result.trials} trials (memory limit "
            f"{cluster.memory_bytes / 1024**3:.0f} GiB per device)")
        if args.json:
            _emit({"best": None, "trials": result.trials, "feasible_trials": 0,
                   "search_time_s": total, "pareto": []})
        return EXIT_FAILED
    b = result.best
    log(f"best: {summary_line(b.summary)}\n      {predicted_line(b.predicted)}\n"
        f"wrote {files['strategy_file']} and {files['strategy_json']} ({total:.1f} s)")
    if args.json:
        from planner.report import pareto

        _emit({
            "best": {"strategy_file": str(files["strategy_file"]),
                     "program": json.loads(b.program.to_json()),
                     "summary": b.summary, "predicted": b.predicted},
            "trials": result.trials,
            "feasible_trials": result.feasible_trials,
            "search_time_s": total,
            "pareto": [{"trial": r.number, "summary": r.summary, "predicted": r.predicted}
                       for r in pareto(result.records)],
        })
    else:
        print(b.program.to_python([f"best of {result.trials} trials: {summary_line(b.summary)}"]))
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from cost_models import CATALOG
    from planner.evaluate import Evaluator
    from planner.report import summary_line
    from planner.trace import write_trace
    from runtime.launcher import RuntimeFailure, lower, run
    from runtime.reference import max_rel_diff, reference_losses

    spec = _spec(args)
    if args.steps < 1:
        raise PiperError(f"--steps must be >= 1, got {args.steps}")
    device = _device(args)
    batch = _batch(args, spec)
    ev = Evaluator(spec, args.gpus, batch, CATALOG["cpu"])
    program = _program(args, ev)
    plan = lower(spec, program, args.gpus, batch)
    summary = program.summary()
    if not args.json:
        log(f"running {summary_line(summary)} on {args.gpus} {device} workers")
    try:
        result = run(spec, plan, batch_size=batch, steps=args.steps, seed=args.seed,
                     device=device, address=args.address, timeout_s=args.timeout)
    except RuntimeFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    if args.trace:
        write_trace(result.spans, args.trace)
    out: dict[str, Any] = {
        "steps": [{"step": s.step, "loss": s.loss, "time_s": s.time_s} for s in result.steps],
        "peak_memory_bytes": list(result.peak_memory_bytes),
        "summary": summary,
    }
    passed = True
    if args.check:
        ref = reference_losses(spec, batch_size=batch, steps=args.steps, seed=args.seed)
        diff = max_rel_diff([s.loss for s in result.steps], ref)
        passed = diff <= 1e-4
        out["check"] = {"passed": passed, "max_rel_diff": diff}
    if args.json:
        _emit(out)
    else:
        for s in result.steps:
            print(f"step {s.step}: loss {s.loss:.6f}  {s.time_s * 1e3:.1f} ms")
        if args.check:
            print(f"check: {'passed' if passed else 'FAILED'} (max relative difference "
                  f"{out['check']['max_rel_diff']:.2e} against single-device training)")
    return EXIT_OK if passed else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
