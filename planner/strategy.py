"""Shorthand flags (--pp --dp --schedule --microbatches) to a Program, with degree checks."""

from __future__ import annotations

import argparse

from piper import schedules
from piper.directives import Stream
from piper.errors import PiperError
from piper.program import Program
from search_spaces.partition import balanced_stages

UNSUPPORTED = {"tp": 1, "ep": 1, "recompute": False}


def degrees(args: argparse.Namespace, gpus: int) -> tuple[int, int]:
    """(pp, dp) from the flags; every mismatch names all degrees."""
    for flag, default in UNSUPPORTED.items():
        value = getattr(args, flag, default)
        if value not in (None, default):
            raise PiperError(f"--{flag.replace('_', '-')} {value} is not supported yet "
                             f"(this build supports pipeline and data parallelism)")
    pp, dp = args.pp, args.dp
    for name, v in (("--pp", pp), ("--dp", dp), ("--microbatches", args.microbatches)):
        if v is not None and v < 1:
            raise PiperError(f"{name} must be >= 1, got {v}")
    if pp is None and dp is None:
        pp, dp = 1, gpus
    elif pp is None:
        pp = gpus // dp if gpus % dp == 0 else -1
    elif dp is None:
        dp = gpus // pp if gpus % pp == 0 else -1
    if pp < 1 or dp < 1 or pp * dp != gpus:
        raise PiperError(f"pp={args.pp} x dp={args.dp} x tp=1 x ep=1 does not make "
                         f"--gpus {gpus}")
    return pp, dp


def shorthand_program(args: argparse.Namespace, gpus: int, regions: tuple[str, ...],
                      region_costs: tuple[float, ...]) -> Program:
    pp, dp = degrees(args, gpus)
    schedule = args.schedule or "1f1b"
    v = args.virtual_stages or (2 if schedule == "dualpipev" else 1)
    if v < 1:
        raise PiperError(f"--virtual-stages must be >= 1, got {v}")
    if schedule == "dualpipev" and v != 2:
        raise PiperError(f"dualpipev runs 2 stages per device (a V), not --virtual-stages {v}")
    if v > 1 and schedule not in ("interleaved-1f1b", "dualpipev"):
        raise PiperError(f"--virtual-stages {v} needs --schedule interleaved-1f1b, "
                         f"not {schedule}")
    if pp * v > len(regions):
        raise PiperError(f"--pp {pp} x --virtual-stages {v} needs at least {pp * v} regions; "
                         f"the model has {len(regions)}: {', '.join(regions)}")
    m = args.microbatches or (2 * pp if schedule == "dualpipev" else pp)
    stages = [[regions[i] for i in r] for r in balanced_stages(region_costs, pp * v)]
    try:
        prog = schedules.build(schedule, stages, microbatches=m, dp=dp, pp=pp,
                               zero=args.zero or 0)
    except ValueError as e:
        raise PiperError(str(e)) from None
    if getattr(args, "comm_stream", False):
        # one group's collectives share a stream: ZeRO-3's gathers stay with compute
        kinds = {1: "AR RS AG", 2: "AR RS AG", 3: "AR"}.get(args.zero or 0, "AR RS")
        prog = Program([*prog.directives, Stream(kinds, stream="comm")], name=prog.name)
    return prog


def add_shorthand_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shorthand strategy (instead of --strategy)")
    g.add_argument("--pp", type=int, help="pipeline ranks")
    g.add_argument("--dp", type=int, help="data-parallel replicas")
    g.add_argument("--tp", type=int, help="tensor parallel degree (not supported yet)")
    g.add_argument("--ep", type=int, help="expert parallel degree (not supported yet)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                   help="ZeRO stage of the data-parallel replicas (default 0)")
    g.add_argument("--schedule", choices=sorted(schedules.SCHEDULES), help="default 1f1b")
    g.add_argument("--virtual-stages", type=int,
                   help="stages per pipeline rank (interleaved-1f1b)")
    g.add_argument("--microbatches", type=int, help="microbatches per replica (default pp)")
    g.add_argument("--comm-stream", action="store_true", default=False,
                   help="run gradient collectives on their own stream, overlapping backward")
    g.add_argument("--recompute", action="store_true", default=False,
                   help="activation recompute (not supported yet)")
