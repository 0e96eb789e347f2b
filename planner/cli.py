"""`piper-plan`: a thin CLI over the library. Logs go to stderr; `--json` prints one object.

Exit codes: 0 ok; 1 no feasible strategy or `--check` failed; 2 bad input; 3 runtime failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any, NoReturn

from piper.errors import PiperError
from piper.model_file import DEFAULT_BATCH_SIZE

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_RUNTIME = 0, 1, 2, 3
DEFAULT_CLUSTER = "h100-80gb"
SAMPLERS = ("tpe", "gp", "nsga2", "grid")
"""Optuna samplers `search --sampler` offers (`planner.samplers` builds them; named here so
that parsing the command line needs no Optuna)."""
OPTIONAL = {"ray": "pip install 'ray[tune]'; `simulate`, `run --launcher local` or "
                   "`--launcher torchrun` and `profile --launcher local` run without it",
            "optuna": "pip install optuna; `simulate` and `run` run without it"}
"""Packages only some commands need, and what to say when one is missing."""
MAX_GPUS = 2**17  # beyond the largest clusters built; a bound that keeps typos from hanging


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as DESIGN.md promises
        raise PiperError(message)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


RAY_ADDRESS_HELP = ("Ray cluster to join: HOST:PORT from one of its nodes, ray://HOST:10001 "
                    "from anywhere, or auto (default: $RAY_ADDRESS, else a Ray of this "
                    "machine's own); docs/cluster.md")


def build_parser() -> argparse.ArgumentParser:
    from planner.run_cmd import add_train_flags
    from planner.strategy import add_shorthand_flags
    from runtime.training import PRECISIONS

    p = _Parser(prog="piper-plan", description="Search, simulate and run distributed "
                "training strategies for a PyTorch model.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def model_cmd(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help)
        c.add_argument("model", help="model file defining build_model() and example_batch(), "
                       "or a Hugging Face config.json / model folder")
        c.add_argument("--gpus", type=int, required=True, help="devices to plan for")
        c.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                       help="keyword argument for build_model (repeatable)")
        c.add_argument("--batch-size", type=int,
                       help="global batch, in samples (default: the model file's BATCH_SIZE, "
                            f"else {DEFAULT_BATCH_SIZE}; a Hugging Face model: "
                            f"{DEFAULT_BATCH_SIZE} sequences)")
        c.add_argument("--seq-len", type=int, help="tokens per sequence (Hugging Face models; "
                       "default: the context, at most 2048)")
        c.add_argument("--seed", type=int, default=0)
        c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        return c

    s = model_cmd("search", "search for the best strategy")
    planned = ("what the strategies will train in (default: bf16-mixed on a GPU cluster, "
               "fp32 on cpu)")
    s.add_argument("--precision", choices=PRECISIONS, help=planned)
    s.add_argument("--cluster", help=f"catalog name or TOML file (default {DEFAULT_CLUSTER})")
    s.add_argument("--trials", type=int, default=64, help="trials to add to the study")
    s.add_argument("--timeout", type=float, help="stop asking for trials after S seconds")
    s.add_argument("--sampler", default="tpe", choices=SAMPLERS,
                   help="tpe (default), gp, nsga2, or grid: every valid point once")
    s.add_argument("--backend", default="optuna", choices=["optuna", "ray"],
                   help="optuna: trials in this process; ray: trials spread by Ray Tune")
    s.add_argument("--address", help=RAY_ADDRESS_HELP + " (--backend ray, --measure)")
    s.add_argument("--gpus-per-node", type=int, help="devices per node, as the strategies are "
                   "priced and --measure places its ranks (default: the --cluster spec's)")
    s.add_argument("--storage", help="Optuna storage URL (default sqlite:///OUT/study.db)")
    s.add_argument("--study-name", default="piper-plan")
    s.add_argument("--measure", type=int, default=0, metavar="K",
                   help="run the K best predicted strategies for real and re-rank them")
    s.add_argument("--device", choices=["cpu", "cuda"], help="where --measure runs")
    s.add_argument("--out", default="piper_plan_out", help="output folder")

    r = model_cmd("run", "train a strategy for real on Ray workers")
    r.add_argument("--strategy", help="strategy file (.py with strategy() or .json)")
    add_shorthand_flags(r)
    add_train_flags(r)
    r.add_argument("--device", choices=["cpu", "cuda"])
    r.add_argument("--address", help=RAY_ADDRESS_HELP)
    r.add_argument("--gpus-per-node", type=int, help="ranks per node: consecutive ranks share "
                   "a node in blocks of this many (default: on a cluster joined, its "
                   "smallest node's GPUs, or CPUs on --device cpu; else all on this machine)")
    r.add_argument("--check", action="store_true",
                   help="compare losses with single-device training (rtol 1e-4 in fp32, "
                        "2e-2 in bf16-mixed against torch.autocast)")
    r.add_argument("--trace", help="write the measured timeline as a Perfetto trace")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds before a rank is "
                   "declared hung")

    m = model_cmd("simulate", "predict step time and memory of a strategy")
    m.add_argument("--precision", choices=PRECISIONS, help=planned)
    m.add_argument("--strategy", help="strategy file (.py with strategy() or .json)")
    add_shorthand_flags(m)
    m.add_argument("--cluster", help=f"catalog name or TOML file (default {DEFAULT_CLUSTER})")
    m.add_argument("--trace", help="write the predicted timeline as a Perfetto trace")
    m.add_argument("--timeline", metavar="PNG",
                   help="write the predicted timeline as a per-rank, per-stream Gantt chart")

    f = model_cmd("profile", "measure this machine and write a cluster spec (TOML)")
    f.add_argument("--device", choices=["cpu", "cuda"])
    f.add_argument("--launcher", choices=["ray", "local"], default="ray",
                   help="ray: Ray actors; local: one process per rank spawned here, no Ray")
    f.add_argument("--out", required=True, metavar="CLUSTER.toml",
                   help="cluster spec to write; pass it to search/simulate as --cluster")

    w = sub.add_parser("show", help="list a search's trials, best and Pareto front")
    w.add_argument("storage", help="Optuna storage URL, .db file, or a search's --out folder")
    w.add_argument("--study-name", default="piper-plan")
    w.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    x = sub.add_parser("export", help="write one trial's strategy (default: the best)")
    x.add_argument("storage", help="Optuna storage URL, .db file, or a search's --out folder")
    x.add_argument("--study-name", default="piper-plan")
    x.add_argument("--trial", type=int, help="trial number (default: the best)")
    x.add_argument("--out", required=True, metavar="FILE",
                   help="strategy to write: .py (script) or .json")

    e = sub.add_parser("export-weights", help="write a checkpoint's model as one "
                       "single-device state dict")
    e.add_argument("checkpoint", help="a checkpoint folder, or a --checkpoint-dir (newest)")
    e.add_argument("--out", required=True, metavar="FILE.safetensors")

    cl = sub.add_parser("clusters", help="list the built-in cluster catalog, or print one "
                                         "entry as a TOML file to edit")
    cl.add_argument("name", nargs="?", help="a catalog entry to show in full")
    cl.add_argument("--toml", action="store_true",
                    help="print the entry as a cluster file (`--cluster FILE` reads it back)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = None
    # torch logs a traceback (or the partial graph) of its own when a model fails under
    # fake tensors or torch.export; the one `error:` line below says it all
    for name in ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        args = build_parser().parse_args(argv)
        return {"search": cmd_search, "run": cmd_run, "simulate": cmd_simulate,
                "clusters": cmd_clusters, "profile": cmd_profile, "show": cmd_show,
                "export": cmd_export, "export-weights": cmd_export_weights}[args.command](args)
    except PiperError as e:
        print(f"error: {_in_file(args, e)}{' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug of ours: still one line, with the way to see more
        missing = (getattr(e, "name", None) or "").split(".")[0]
        if isinstance(e, ImportError) and missing in OPTIONAL:
            print(f"error: {getattr(args, 'command', 'this command')} needs {missing}, which "
                  f"this Python does not have ({OPTIONAL[missing]})", file=sys.stderr)
            return EXIT_BAD_INPUT
        if os.environ.get("PIPER_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {' '.join(str(e).split())} "
              "(set PIPER_DEBUG=1 for a traceback)", file=sys.stderr)
        return EXIT_RUNTIME


def _in_file(args: argparse.Namespace | None, e: PiperError) -> str:
    """A directive's error happens when the Program is applied, after its file was read:
    name the file, so the message says where as well as which directive."""
    from piper.errors import DirectiveError

    path = getattr(args, "strategy", None)
    if isinstance(e, DirectiveError) and path and not str(e).startswith(path):
        return f"{path}: "
    return ""


# ---- shared --------------------------------------------------------------------------------
def _spec(args: argparse.Namespace) -> Any:
    from piper.model_file import load_model, parse_model_args

    if args.gpus < 1:
        raise PiperError(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpus > MAX_GPUS:
        raise PiperError(f"--gpus {args.gpus} is more than {MAX_GPUS:,}, the largest "
                         "cluster piper-plan plans for")
    if getattr(args, "timeout", None) is not None and not args.timeout > 0:
        raise PiperError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.seq_len is not None and args.seq_len < 1:
        raise PiperError(f"--seq-len must be >= 1, got {args.seq_len}")
    options = (("seq_len", args.seq_len),) if args.seq_len is not None else ()
    spec = load_model(args.model, parse_model_args(args.model_arg), options)
    if args.batch_size is not None and args.batch_size < 1:
        raise PiperError(f"--batch-size must be >= 1, got {args.batch_size}")
    for note in spec.notes:
        log(note)
    return spec


def _batch(args: argparse.Namespace, spec: Any) -> int:
    return args.batch_size or spec.batch_size


def _cluster(args: argparse.Namespace, announce: bool) -> tuple[Any, str]:
    from cost_models import load_cluster

    name = args.cluster or DEFAULT_CLUSTER
    if args.cluster is None and announce:
        log(f"cluster: {DEFAULT_CLUSTER} (default; pass --cluster to change)")
    return with_gpus_per_node(load_cluster(name), getattr(args, "gpus_per_node", None)), name


def with_gpus_per_node(cluster: Any, per_node: int | None) -> Any:
    """`cluster` with `--gpus-per-node` where given; below 1 is bad input."""
    if per_node is None:
        return cluster
    if per_node < 1:
        raise PiperError(f"--gpus-per-node must be >= 1, got {per_node}")
    return dataclasses.replace(cluster, gpus_per_node=per_node)


def _program(args: argparse.Namespace, ev: Any) -> Any:
    from piper.program import Program
    from planner.strategy import shorthand_program

    if args.strategy:
        shorthand = [f for f in ("pp", "dp", "tp", "ep", "schedule", "microbatches",
                                 "recompute", "comm_stream", "bucket_mb", "sp")
                     if getattr(args, f, None)]
        if shorthand:
            raise PiperError(f"--strategy and --{shorthand[0].replace('_', '-')} are "
                             "mutually exclusive")
        return _within_node(Program.load(args.strategy), ev.cluster, args.strategy)
    graph = ev.captured.graph
    return _within_node(shorthand_program(args, args.gpus, graph.names, ev.region_costs(),
                                          graph.expert_regions), ev.cluster, None)


def _within_node(program: Any, cluster: Any, path: str | None) -> Any:
    """Tensor parallelism talks at every layer: a TP group spanning nodes is priced over
    the inter-node links (users do run tp 16 over two nodes), and said once."""
    tp = program.summary()["tp"]
    if tp > cluster.gpus_per_node:
        what = f"{path}: tensor-parallel degree {tp}" if path else f"--tp {tp}"
        print(f"warning: {what} spans nodes of cluster {cluster.name} "
              f"({cluster.gpus_per_node} devices each): its collectives cross the "
              "inter-node links at every layer", file=sys.stderr)
    return program


def _tell_regions(ev: Any) -> None:
    """Regions chosen automatically are said once, so the user sees what was planned."""
    note = ev.captured.regions_note()
    if note:
        log(note)


def _device(args: argparse.Namespace) -> str:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PiperError("--device cuda: no CUDA device is available here")
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def planned_precision(args: argparse.Namespace, cluster: Any) -> str:
    """What search and simulate price: `--precision`, else bf16-mixed on a cluster with a
    bf16 rate (GPUs; what `run --device cuda` trains in) and fp32 on CPU."""
    return args.precision or ("bf16-mixed" if cluster.bf16_flops else "fp32")


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj))


# ---- commands ------------------------------------------------------------------------------
def cmd_profile(args: argparse.Namespace) -> int:
    from planner.profile import check_request, profile
    from runtime.jobs import RuntimeFailure

    spec = _spec(args)
    device = _device(args)
    check_request(args.out, args.gpus)
    if not args.json:
        log(f"profiling {args.gpus} {device} ranks (chunks, matmuls, optimizer, collectives)")
    try:
        res = profile(spec, gpus=args.gpus, device=device, batch=_batch(args, spec),
                      out=args.out, launcher=args.launcher)
    except RuntimeFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    fit = dict(res.report.errors)
    log(f"wrote {res.path} in {res.seconds:.1f} s; fit errors (mean abs %): "
        f"{res.report.line()}")
    if args.json:
        from dataclasses import asdict

        _emit({"cluster_file": str(res.path), "cluster": asdict(res.cluster),
               "fit_error_percent": fit, "profile_time_s": res.seconds})
    return EXIT_OK


def cmd_clusters(args: argparse.Namespace) -> int:
    """The catalog with the peak a user plans with (16-bit where the device has one);
    `NAME --toml`: one entry as a file to edit (4 NICs a node instead of 8, say)."""
    from cost_models import CATALOG, to_toml

    if args.name is not None:
        if args.name not in CATALOG:
            raise PiperError(f"unknown cluster {args.name!r}; known: {', '.join(CATALOG)}")
        c = CATALOG[args.name]
        if args.toml:
            # no name: a cluster file is named by its file's stem
            print(f"# {c.device}, from the catalog entry {c.name}: edit the figures, then "
                  "--cluster THIS_FILE.toml")
            print("".join(line + "\n" for line in to_toml(c).splitlines()
                          if not line.startswith("name = ")), end="")
        else:
            for field in dataclasses.fields(c):
                print(f"{field.name:<26} {getattr(c, field.name)}")
        return EXIT_OK
    if args.toml:
        raise PiperError("clusters --toml needs a cluster name, e.g. `piper-plan clusters "
                         "h100-80gb --toml`")
    print(f"{'name':<15} {'device':<36} {'GPUs':>9} {'memory':>9}  {'peak':>14}")
    for name, c in CATALOG.items():
        kind = "bf16" if c.bf16_flops else "fp32"
        peak = c.peak_flops(bool(c.bf16_flops)) / 1e12
        print(f"{name:<15} {c.device:<36} {c.gpus_per_node:>4}/node "
              f"{c.memory_bytes / 1024**3:>5.0f} GiB  {peak:>7.1f} TFLOP/s {kind}")
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from cost_models import predicted_json
    from planner.evaluate import Evaluator
    from planner.report import predicted_line, summary_line
    from planner.trace import write_trace

    spec = _spec(args)
    cluster, _ = _cluster(args, announce=False)
    ev = Evaluator(spec, args.gpus, _batch(args, spec), cluster,
                   precision=planned_precision(args, cluster))
    _tell_regions(ev)
    result = ev.evaluate(_program(args, ev))
    pred = predicted_json(result.prediction)
    if args.trace:
        write_trace(result.prediction.spans, args.trace)
    if args.timeline:
        from planner.plots import write_timeline
        from planner.replicas import stands_for

        write_timeline(result.prediction.spans, args.timeline,
                       stands_for=stands_for(result.plan, cluster),
                       title=f"{summary_line(result.summary)} on {cluster.name}")
    parts = ev.memory_parts(result)
    top = max(range(len(parts)), key=lambda i: parts[i].total)
    rank = result.prediction.ranks[top]
    if args.json:
        _emit({"predicted": pred, "summary": result.summary,
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
    from planner.replicas import replica_kinds

    kinds = replica_kinds(plan.mesh, cluster)
    return {rp.rank: len(kinds.get(rp.replica, (rp.replica,))) - 1 for rp in plan.ranks}


def cmd_search(args: argparse.Namespace) -> int:
    from planner.search_cmd import search

    return search(args)


def cmd_show(args: argparse.Namespace) -> int:
    from planner.studies import load, show_json, show_text

    study = load(args.storage, args.study_name)
    if args.json:
        _emit(show_json(study))
    else:
        print(show_text(study))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from planner.report import predicted_line, summary_line
    from planner.studies import export, load

    path, rec = export(load(args.storage, args.study_name), args.trial, args.out)
    log(f"wrote {path}: trial {rec.number}: {summary_line(rec.summary)}\n"
        f"      {predicted_line(rec.predicted)}")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    from planner.run_cmd import run

    return run(args)


def cmd_export_weights(args: argparse.Namespace) -> int:
    from runtime.export_weights import export_weights

    n = export_weights(args.checkpoint, args.out)
    log(f"wrote {args.out}: {n} tensors")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
