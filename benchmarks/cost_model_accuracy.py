"""How well does `simulate` with a profiled cluster predict real `run` step times? (issue 4)

    python benchmarks/cost_model_accuracy.py --gpus 4 --rounds 2 --steps 6 [--size mini]

Profiles this machine (`piper-plan profile`'s library path: real Ray actors, gloo), then for
each strategy of the tiny GPT (pp / dp / ZeRO / schedule / microbatch variations) compares
the simulator's predicted step time and peak memory with the median of measured step times
on `--gpus` CPU ranks. Runs go round-robin over the strategies, `--rounds` times, so drifting
machine load hits every strategy alike; each run's first step (warm-up) is dropped.
Reports MAPE, Kendall's tau of the two rankings, and whether the predicted best is the
measured best. `--cluster FILE` reuses an existing profile instead of measuring one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scipy import stats

from cost_models import load_cluster, model_costs, to_toml
from cost_models.calibrate import calibrate
from piper import schedules
from piper.capture import capture
from piper.model_file import load_model_file
from planner.machine.profiling import measure
from planner.search.evaluate import Evaluator
from runtime.cluster.join import connect
from runtime.cluster.launcher import RuntimeFailure, run
from runtime.lowering.lower import lower
from search_spaces.partition import balanced_stages

MODEL = str(ROOT / "examples" / "gpt.py")
BATCH = 32


@dataclass(frozen=True)
class Strategy:
    schedule: str
    pp: int
    dp: int
    microbatches: int
    zero: int = 0
    virtual: int = 1

    @property
    def label(self) -> str:
        v = f" v{self.virtual}" if self.virtual > 1 else ""
        return (f"{self.schedule} pp{self.pp}{v} dp{self.dp} zero{self.zero} "
                f"m{self.microbatches}")


STRATEGIES = (
    Strategy("1f1b", 1, 4, 1),
    Strategy("1f1b", 1, 4, 2),
    Strategy("1f1b", 1, 4, 2, zero=1),
    Strategy("1f1b", 1, 4, 2, zero=2),
    Strategy("1f1b", 1, 4, 2, zero=3),
    Strategy("1f1b", 2, 2, 4),
    Strategy("gpipe", 2, 2, 4),
    Strategy("1f1b", 2, 2, 8, zero=1),
    Strategy("1f1b", 2, 2, 4, zero=3),
    Strategy("interleaved-1f1b", 2, 2, 4, virtual=2),
    Strategy("gpipe", 4, 1, 8),
    Strategy("1f1b", 4, 1, 8),
    Strategy("1f1b", 4, 1, 4),
    Strategy("zb1p", 4, 1, 8),
    Strategy("dualpipev", 2, 2, 4, virtual=2),
)


def program(s: Strategy, ev: Evaluator) -> object:
    names = ev.captured.graph.names
    stages = [[names[i] for i in r]
              for r in balanced_stages(ev.region_costs(), s.pp * s.virtual)]
    return schedules.build(s.schedule, stages, microbatches=s.microbatches, dp=s.dp, pp=s.pp,
                           zero=s.zero)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--size", default="tiny", help="examples/gpt.py size (tiny: steps of "
                   "tens of ms, mostly runtime overhead; mini: hundreds of ms, mostly compute)")
    p.add_argument("--batch", type=int, default=BATCH, help="global batch")
    p.add_argument("--cluster", help="a profiled cluster TOML to reuse (default: profile now)")
    p.add_argument("--out", default="cost_model_accuracy", help="folder for cluster + json")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = load_model_file(MODEL, (("size", a.size),))
    connect()
    if a.cluster:
        cluster = load_cluster(a.cluster)
    else:
        t0 = time.perf_counter()
        cluster, report = calibrate(measure(spec, gpus=a.gpus, device="cpu"),
                                    model_costs(capture(spec, 1)), name="local-cpu")
        (out / "cluster.toml").write_text(to_toml(cluster))
        print(f"profiled in {time.perf_counter() - t0:.1f} s; fit errors: {report.line()}",
              flush=True)
    ev = Evaluator(spec, a.gpus, a.batch, cluster)
    rows = []
    for s in STRATEGIES:
        prog = program(s, ev)
        pred = ev.evaluate(prog).prediction
        rows.append({"strategy": s.label, "program": prog, "predicted_s": pred.step_time_s,
                     "predicted_peak": list(pred.peak_memory_bytes), "times": [],
                     "measured_peak": []})
    for k in range(a.rounds):
        for row in rows:
            if row.get("failed"):
                continue
            plan = lower(spec, row["program"], a.gpus, a.batch)
            try:
                res = run(spec, plan, batch_size=a.batch, steps=a.steps, seed=0)
            except RuntimeFailure as e:  # reported, and left out of the figures
                row["failed"] = str(e).split(";")[0]
                print(f"round {k}: {row['strategy']:<36} FAILED: {row['failed']}", flush=True)
                continue
            row["times"] += [st.time_s for st in res.steps[1:]]
            row["measured_peak"] = list(res.peak_memory_bytes)
            print(f"round {k}: {row['strategy']:<36} "
                  f"{statistics.median(row['times']) * 1e3:7.1f} ms measured, "
                  f"{row['predicted_s'] * 1e3:7.1f} ms predicted", flush=True)
    report_rows(rows, out)


def report_rows(rows: list[dict], out: Path) -> None:
    for r in rows:
        if r.get("failed"):
            print(f"left out (the run failed): {r['strategy']}: {r['failed']}")
    rows = [r for r in rows if not r.get("failed")]
    measured = [statistics.median(r["times"]) for r in rows]
    predicted = [r["predicted_s"] for r in rows]
    errors = [(p - m) / m for p, m in zip(predicted, measured, strict=True)]
    tau = stats.kendalltau(predicted, measured).statistic
    best_p = min(range(len(rows)), key=predicted.__getitem__)
    best_m = min(range(len(rows)), key=measured.__getitem__)
    print("\n| strategy | measured median (ms) | predicted (ms) | error | measured peak / "
          "predicted peak, max over ranks (KiB) |")
    print("|---|---|---|---|---|")
    for r, m, e in zip(rows, measured, errors, strict=True):
        print(f"| {r['strategy']} | {m * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | "
              f"{e * 100:+.0f}% | {max(r['measured_peak']) / 1024:.0f} / "
              f"{max(r['predicted_peak']) / 1024:.0f} |")
    mape = 100 * statistics.mean(abs(e) for e in errors)
    print(f"\nMAPE {mape:.1f}%  Kendall tau {tau:.3f}  predicted best "
          f"{rows[best_p]['strategy']!r} {'==' if best_p == best_m else '!='} measured best "
          f"{rows[best_m]['strategy']!r}")
    (out / "results.json").write_text(json.dumps({
        "mape_percent": mape, "kendall_tau": tau, "best_matches": best_p == best_m,
        "rows": [{k: v for k, v in r.items() if k != "program"} | {"measured_s": m}
                 for r, m in zip(rows, measured, strict=True)]}, indent=1))


if __name__ == "__main__":
    main()
