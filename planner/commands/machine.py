"""`piper-plan profile` (measure this machine into a cluster file) and `piper-plan clusters`
(the catalog)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from piper.errors import PiperError
from planner.commands.common import (
    EXIT_OK,
    EXIT_RUNTIME,
    batch_of,
    device_of,
    emit,
    log,
    spec_of,
)


def profile(args: argparse.Namespace) -> int:
    from planner.machine.profile import check_request, profile
    from runtime.cluster.jobs import RuntimeFailure

    spec = spec_of(args)
    device = device_of(args)
    check_request(args.out, args.gpus)
    if not args.json:
        log(f"profiling {args.gpus} {device} ranks (chunks, matmuls, optimizer, collectives)")
    try:
        res = profile(spec, gpus=args.gpus, device=device, batch=batch_of(args, spec),
                      out=args.out, launcher=args.launcher)
    except RuntimeFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    fit = dict(res.report.errors)
    log(f"wrote {res.path} in {res.seconds:.1f} s; fit errors (mean abs %): "
        f"{res.report.line()}")
    if args.json:
        from dataclasses import asdict

        emit({"cluster_file": str(res.path), "cluster": asdict(res.cluster),
               "fit_error_percent": fit, "profile_time_s": res.seconds})
    return EXIT_OK


def clusters(args: argparse.Namespace) -> int:
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
