"""What the `piper-plan` commands share: reading the model, batch, cluster, device and
strategy from their flags, the regions note, one JSON object on stdout, and the exit codes
DESIGN.md promises. Public names only: every command module imports them from here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from piper.errors import PiperError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_RUNTIME = 0, 1, 2, 3
DEFAULT_CLUSTER = "h100-80gb"
MAX_GPUS = 2**17  # beyond the largest clusters built; a bound that keeps typos from hanging


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def spec_of(args: argparse.Namespace) -> Any:
    from piper.loading import load_model
    from piper.model_file import parse_model_args

    if args.gpus < 1:
        raise PiperError(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpus > MAX_GPUS:
        raise PiperError(f"--gpus {args.gpus} is more than {MAX_GPUS:,}, the largest "
                         "cluster piper-plan plans for")
    if getattr(args, "timeout", None) is not None and not args.timeout > 0:
        raise PiperError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not getattr(args, "expert_skew", 1.0) >= 1:
        raise PiperError(f"--expert-skew is the busiest rank's routed rows over the mean, "
                         f">= 1; got {args.expert_skew}")
    if args.seq_len is not None and args.seq_len < 1:
        raise PiperError(f"--seq-len must be >= 1, got {args.seq_len}")
    options = (("seq_len", args.seq_len),) if args.seq_len is not None else ()
    spec = load_model(args.model, parse_model_args(args.model_arg), options)
    if args.batch_size is not None and args.batch_size < 1:
        raise PiperError(f"--batch-size must be >= 1, got {args.batch_size}")
    for note in spec.notes:
        log(note)
    return spec


def experts_note(args: argparse.Namespace, graph: Any) -> str | None:
    """The router assumption a model with routed experts is priced under (None without
    experts): balanced, or the measured skew `--expert-skew` gave."""
    if not graph.experts:
        return None
    skew = args.expert_skew
    if skew == 1.0:
        return ("experts: priced with a balanced router (each EP rank gets the mean share of "
                "routed rows); --expert-skew MAX/MEAN prices a measured one")
    return (f"experts: priced with the busiest EP rank getting {skew:g}x the mean share of "
            "routed rows (--expert-skew)")


def batch_of(args: argparse.Namespace, spec: Any) -> int:
    return args.batch_size or spec.batch_size


def cluster_of(args: argparse.Namespace, announce: bool) -> tuple[Any, str]:
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


SHORTHAND = ("pp", "dp", "tp", "ep", "etp", "ep_over_tp", "cp", "schedule", "microbatches", "recompute",
             "comm_stream", "bucket_mb", "sp", "zero", "virtual_stages", "capacity_factor")


def apply_from(args: argparse.Namespace) -> None:
    """`--from FRAMEWORK CONFIG`: the config's layout as the shorthand flags (and its global
    batch, unless --batch-size is given); a line for what was read as the nearest choice."""
    from planner.report.frameworks.readback import READERS

    framework, source = args.from_
    if framework not in READERS:
        raise PiperError(f"--from {framework}: read back are {', '.join(sorted(READERS))}")
    given = [f for f in SHORTHAND if getattr(args, f, None)] + (
        ["strategy"] if args.strategy else [])
    if given:
        raise PiperError(f"--from and --{given[0].replace('_', '-')} are mutually exclusive")
    fields, notes = READERS[framework](source, args.gpus)
    for note in notes:
        log(f"{framework}: {note}")
    for k, v in fields.items():
        if k == "batch_size":
            args.batch_size = args.batch_size or v
        elif k != "unit_per_layer":
            setattr(args, k, v)
    args.unit_per_layer = fields.get("unit_per_layer", False)
    if args.virtual_stages == 1:
        args.virtual_stages = None


def program_of(args: argparse.Namespace, ev: Any) -> Any:
    from piper.program import Program
    from planner.search.strategy import shorthand_program

    if args.strategy:
        shorthand = [f for f in ("pp", "dp", "tp", "ep", "cp", "schedule", "microbatches",
                                 "recompute", "comm_stream", "bucket_mb", "sp",
                                 "capacity_factor")
                     if getattr(args, f, None)]
        if shorthand:
            raise PiperError(f"--strategy and --{shorthand[0].replace('_', '-')} are "
                             "mutually exclusive")
        return _within_node(Program.load(args.strategy), ev.cluster, args.strategy)
    graph = ev.captured.graph
    return _within_node(shorthand_program(args, args.gpus, graph.names, ev.region_costs(),
                                          graph.expert_regions, ev.costs.tokens_per_sample),
                        ev.cluster, None)


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


def tell_regions(ev: Any) -> None:
    """Regions chosen automatically are said once, so the user sees what was planned."""
    note = ev.captured.regions_note()
    if note:
        log(note)


def device_of(args: argparse.Namespace) -> str:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PiperError("--device cuda: no CUDA device is available here")
    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def planned_precision(args: argparse.Namespace, cluster: Any) -> str:
    """What search and simulate price: `--precision`, else bf16-mixed on a cluster with a
    bf16 rate (GPUs; what `run --device cuda` trains in) and fp32 on CPU."""
    return args.precision or ("bf16-mixed" if cluster.bf16_flops else "fp32")


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj))
