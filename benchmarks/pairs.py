"""DualPipeV step time with overlapped forward/backward pairs against the same order run
one task after another.

    python benchmarks/pairs.py --repeats 3 --steps 5

Two models, same everything else: a dense GPT (examples/gpt.py, size=mini) on 2 CPU ranks
(pp=2), and the MoE GPT (examples/moe.py) on 4 (pp=2 x dp=2, experts split ep=2, so every
experts chunk does an all-to-all dispatch and combine). "pairs" is `schedules.dualpipev`
(`F0.3+I3.1` words in its steady state); "flat" is that Program with each pair written as
two consecutive tasks. Runs alternate (pairs, flat, pairs, ...); each run's first step is
dropped; medians of the rest, with the ratio pairs/flat. The runtime's hand-over rule
(`piper.lanes`) also prints how many paired backwards the pair thread took over.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cost_models import CATALOG
from piper import Order, Program, schedules
from piper.model_file import load_model_file
from planner.search.evaluate import Evaluator
from runtime.cluster.launcher import run
from runtime.lowering.lower import lower
from runtime.lowering.plan import PAIR_STREAM
from search_spaces.partition import balanced_stages

CASES = {  # name: (model file, model args, ranks, dp, ep)
    "dense": (str(ROOT / "examples" / "gpt.py"), (("size", "mini"),), 2, 1, 1),
    "moe": (str(ROOT / "examples" / "moe.py"), (("size", "tiny"),), 4, 2, 2),
}


def flat(prog: Program) -> Program:
    """`prog` with every overlapped pair run as two tasks, forward first."""
    return Program([dataclasses.replace(d, tasks=" ".join(d.names)) if isinstance(d, Order)
                    else d for d in prog.directives], name=prog.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print("| model | ranks | pairs median step (s) | flat median step (s) | pairs/flat | "
          "backwards taken over by the pair thread |")
    print("|---|---|---|---|---|---|")
    for case in args.cases:
        path, model_args, world, dp, ep = CASES[case]
        spec = load_model_file(path, model_args)
        ev = Evaluator(spec, 1, args.batch, CATALOG["cpu"])
        names = ev.captured.graph.names
        pp = world // dp
        stages = [[names[i] for i in r] for r in balanced_stages(ev.region_costs(), 2 * pp)]
        prog = schedules.build("dualpipev", stages, microbatches=args.microbatches, dp=dp,
                               pp=pp)
        prog = schedules.shard(prog, ep=ep, expert_regions=tuple(
            n for n in names if n.startswith("experts")))
        plans = {"pairs": lower(spec, prog, world, args.batch),
                 "flat": lower(spec, flat(prog), world, args.batch)}
        times: dict[str, list[float]] = {k: [] for k in plans}
        taken = paired = 0
        for _ in range(args.repeats):
            for k, plan in plans.items():
                res = run(spec, plan, batch_size=args.batch, steps=args.steps, seed=0)
                times[k] += [s.time_s for s in res.steps][1:]
                if k == "pairs":
                    paired += sum(1 for rp in plan.ranks for t in rp.stream(PAIR_STREAM)
                                  if t.kind.is_chunk)
                    taken += sum(1 for s in res.spans if s.stream == PAIR_STREAM
                                 and s.task.kind.is_chunk)
        a, b = statistics.median(times["pairs"]), statistics.median(times["flat"])
        print(f"| {case} ({path.rsplit('/', 1)[-1]}) | {world} | {a:.4f} | {b:.4f} | "
              f"{a / b:.3f} | {taken} of {paired} |", flush=True)


if __name__ == "__main__":
    main()
