"""Data-parallel step time with the gradient all-reduce in buckets against one per stage.

    python benchmarks/buckets.py --ranks 2 4 --buckets 1 4 --repeats 3 --steps 5

Same model (examples/gpt.py, size=mini), batch, microbatches and seed; pure data
parallelism (pp=1, ZeRO-0), so the stage's all-reduce follows its last backward. Without
buckets it starts after that backward; with `Replicate(bucket_mb=X)` each bucket starts
inside it once its gradients are final (`runtime.execute.buckets`). Runs alternate (none, X, Y,
none, ...) so machine noise hits all alike; each run's first step is dropped; the median of
the rest is reported with the ratio bucketed / one all-reduce. Also prints what the
simulator predicts for the same two Plans on the catalog's `cpu` entry.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cost_models import CATALOG
from piper import schedules
from piper.model_file import load_model_file
from planner.search.evaluate import Evaluator
from runtime.cluster.launcher import run
from runtime.lowering.lower import lower

GPT = str(ROOT / "examples" / "gpt.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--buckets", type=float, nargs="+", default=[1.0, 4.0], help="MiB")
    ap.add_argument("--size", default="mini")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    spec = load_model_file(GPT, (("size", a.size),))
    print("| ranks | bucket MiB | median step (s) | one all-reduce (s) | ratio |")
    print("|---|---|---|---|---|")
    for world in a.ranks:
        ev = Evaluator(spec, world, a.batch, CATALOG["cpu"])
        stages = [list(ev.captured.graph.names)]
        base = schedules.build("1f1b", stages, microbatches=a.microbatches, dp=world)
        progs = {None: base, **{b: schedules.with_buckets(base, b) for b in a.buckets}}
        times: dict[float | None, list[float]] = {b: [] for b in progs}
        for _ in range(a.repeats):
            for b, prog in progs.items():
                plan = lower(spec, prog, world, a.batch)
                res = run(spec, plan, batch_size=a.batch, steps=a.steps, seed=0)
                times[b] += [s.time_s for s in res.steps[1:]]
        one = statistics.median(times[None])
        for b in a.buckets:
            m = statistics.median(times[b])
            pred = ev.evaluate(progs[b]).prediction.step_time_s
            pred0 = ev.evaluate(base).prediction.step_time_s
            print(f"| {world} | {b:g} | {m:.4f} | {one:.4f} | {m / one:.3f} "
                  f"(simulated {pred / pred0:.3f}) |", flush=True)


if __name__ == "__main__":
    main()
