"""Simulated tasks per second: the simulator and its dry-run engine, on large Plans.

    python benchmarks/simulator_speed.py --repeats 7

Plans: examples/gpt.py (size=1b, 20 regions) with pp=8, dp=4, 64 microbatches under 1f1b,
interleaved-1f1b (2 virtual stages), zb1p and dualpipev, priced for h100-80gb at
microbatch size 1. Two figures per plan, best of `--repeats`, each measured in this tree and,
in the same run, in the tree of `--baseline` (a git revision, exported with `git archive` to
a temporary folder and run there in a subprocess), so both meet the same machine and load:

- simulate: one uncached simulation end to end (pricing, engine, memory, figures);
- engine: `task_costs` + `runtime.lowering.dryrun.dry_run` with the pricing the simulator hands it.

Tasks/s = the Plan's task count / seconds, of wall time and of the process's CPU time (the
steadier figure when other work shares the machine). Only the standard library and the
project.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = "2af130c"
"""The last commit before the event-driven dry run and memoised pricing."""

CASES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb1p", 1), ("dualpipev", 2))
PP, DP, MICROBATCHES, MICROBATCH_SIZE = 8, 4, 64, 1


def best_of(repeats: int, run: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest of `repeats` runs. CPU time is this process's
    alone, so it is the steadier figure on a machine others are loading."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        run()
        best = min(best, (time.perf_counter() - w0, time.process_time() - c0))
    return best


def cut(names: tuple[str, ...], n: int) -> list[list[str]]:
    """`names` in n contiguous stages, sizes differing by at most one."""
    per, extra = divmod(len(names), n)
    out, i = [], 0
    for s in range(n):
        k = per + (s < extra)
        out.append(list(names[i:i + k]))
        i += k
    return out


def measure(repeats: int) -> list[dict]:
    """Run in the tree being measured (it is the working directory and on sys.path)."""
    sys.path.insert(0, os.getcwd())
    from cost_models import CATALOG, model_costs, simulator, task_costs
    from piper import capture, schedules, single_device_dag
    from piper.model_file import load_model_file
    from runtime.lowering import dryrun
    from runtime.lowering.scheduler import schedule

    if not Path(dryrun.__file__).resolve().is_relative_to(Path.cwd().resolve()):
        raise RuntimeError(f"measuring {dryrun.__file__}, not the tree in {Path.cwd()}")
    # the baseline priced every task afresh and cached whole simulations by Plan
    per_shape = getattr(simulator, "per_shape", lambda price: price)
    uncached = getattr(simulator, "_simulate", None)

    def simulate(plan: object) -> object:
        if uncached is not None:
            return uncached(plan, costs, cluster, MICROBATCH_SIZE, None)
        return simulator.simulate(plan, costs, cluster, MICROBATCH_SIZE)

    spec = load_model_file("examples/gpt.py", (("size", "1b"),))
    captured = capture(spec, 1)
    costs = model_costs(captured)
    dag0 = single_device_dag(captured.graph)
    cluster = CATALOG["h100-80gb"]
    rows = []
    for name, v in CASES:
        stages = cut(captured.graph.names, PP * (2 if name == "dualpipev" else v))
        prog = schedules.build(name, stages, microbatches=MICROBATCHES, dp=DP, pp=PP)
        plan = schedule(prog.apply(dag0), check=False)
        tasks = sum(len(ts) for rp in plan.ranks for _, ts in rp.streams)

        def engine(plan: object = plan) -> None:  # fresh pricing each run: no memo kept
            tc = task_costs(plan, costs, cluster, MICROBATCH_SIZE)
            dryrun.dry_run(plan, per_shape(tc.duration), per_shape(tc.transfer))
        row = {"schedule": name, "tasks": tasks}
        row["simulate_s"], row["simulate_cpu_s"] = best_of(repeats, lambda p=plan: simulate(p))
        row["engine_s"], row["engine_cpu_s"] = best_of(repeats, engine)
        rows.append(row)
    return rows


def run_worker(tree: Path, repeats: int) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--repeats",
           str(repeats)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def export(rev: str, into: Path) -> Path:
    archive = into / "baseline.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "archive", rev], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(into / "tree", filter="data")
    return into / "tree"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline", default=BASELINE, help="git revision to compare against "
                   "('' to skip)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(measure(args.repeats)))
        return
    ours = run_worker(ROOT, args.repeats)
    theirs: list[dict] = []
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            theirs = run_worker(export(args.baseline, Path(tmp)), args.repeats)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}, Python {platform.python_version()}; "
          f"pp={PP} dp={DP} m={MICROBATCHES}, best of {args.repeats}")
    base = {r["schedule"]: r for r in theirs}
    for what in ("simulate", "engine"):
        head = (f"{what + ' tasks/s':<24} {'tasks':>6} {'wall':>9} {'CPU':>9}"
                + (f" {'baseline wall':>14} {'baseline CPU':>13} {'speed-up (CPU)':>15}"
                   if theirs else ""))
        print(f"\n{head}\n{'-' * len(head)}")
        for r in ours:
            n = r["tasks"]
            line = (f"{r['schedule']:<24} {n:>6} {n / r[what + '_s']:>9,.0f} "
                    f"{n / r[what + '_cpu_s']:>9,.0f}")
            b = base.get(r["schedule"])
            if b:
                wall, cpu = (b["tasks"] / b[what + k] for k in ("_s", "_cpu_s"))
                line += (f" {wall:>14,.0f} {cpu:>13,.0f} "
                         f"{n / r[what + '_cpu_s'] / cpu:>14.1f}x")
            print(line)


if __name__ == "__main__":
    main()
