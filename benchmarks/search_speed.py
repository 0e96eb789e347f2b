"""Search speed and quality: how long `piper-plan search` takes, and how good what it finds is.

    python benchmarks/search_speed.py speed             # the two timed commands + a profile
    python benchmarks/search_speed.py quality --seeds 5  # default search against exhaustive
    python benchmarks/search_speed.py quality --full-space  # ... with recompute, comm
                                                            # stream, all-reduce buckets

speed: runs the CLI as a subprocess (the whole command: interpreter start, imports, capture,
search, outputs), wall and CPU seconds of the child:
- Llama-7B (`examples/llama.py size=7b`) on `--gpus 16 --cluster h100-80gb`, default trials;
- Llama-70B (`size=70b`) on `--gpus 1024`, default trials;
- Llama-3.1-8B from its Hugging Face config.json (no model file) on `--gpus 16`;
then the same searches in this process with each phase timed (capture, per-degree sharded
captures, memory bound, apply, schedule, simulate, everything else).

quality: on spaces small enough to walk, `--sampler grid` (every valid point) against the
default search (TPE) given 10% of the grid's trials, over several seeds: the ratio of the best
predicted step times. Both use the same evaluator, whose cache makes repeated points free, so
this measures the sampler, not the machine. Also the gain of the best found strategy over a
Megatron-style default in the same simulator: tensor parallelism across the node (the largest
TP degree the model allows within a node), 1F1B, ZeRO-1 (distributed optimizer), microbatch
size 1, and the smallest pipeline depth that fits in memory, data parallelism for the rest.

Results go to stdout as JSON lines (one per measurement), a summary table to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPEED_CASES = (
    ("llama-7b x16", ["examples/llama.py", "--model-arg", "size=7b", "--gpus", "16",
                      "--cluster", "h100-80gb"]),
    ("llama-70b x1024", ["examples/llama.py", "--model-arg", "size=70b", "--gpus", "1024"]),
    # the real Llama-3.1-8B config.json, no model file (written to a temporary folder)
    ("llama-3.1-8b config.json x16", ["{hf8b}", "--gpus", "16", "--cluster", "h100-80gb"]),
)
QUALITY_CASES = (
    ("gpt-1b x16", "examples/gpt.py", (("size", "1b"),), 16, None),
    ("llama-7b x16", "examples/llama.py", (("size", "7b"),), 16, None),
    ("moe-1b x16", "examples/moe.py", (("size", "1b"),), 16, None),
)
BUDGET = 0.10
"""The default search's trials, as a share of the grid's."""


def emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- speed ---------------------------------------------------------------------------------
def speed(extra: list[str]) -> None:
    from tests.hf_models import write_llama_31_8b

    hf = tempfile.TemporaryDirectory()
    hf8b = str(write_llama_31_8b(Path(hf.name) / "Llama-3.1-8B"))
    cases = [(name, [a.format(hf8b=hf8b) for a in args]) for name, args in SPEED_CASES]
    for name, args in cases:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "planner.cli", "search", *args, *extra, "--out", out,
                   "--json"]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        res = json.loads(r.stdout) if r.stdout.strip() else {}
        best = res.get("best") or {}
        row = {"case": name, "command": "piper-plan search " + " ".join(args + extra),
               "rc": r.returncode, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
               "trials": res.get("trials"), "feasible_trials": res.get("feasible_trials"),
               "best": best.get("summary"),
               "step_time_s": (best.get("predicted") or {}).get("step_time_s"),
               "load_avg": os.getloadavg()[0]}
        emit(row)
        log(f"{name}: rc {r.returncode}, {wall:.1f} s wall, {cpu:.1f} s CPU; "
            f"best {row['best']} {row['step_time_s']}")
        if r.returncode not in (0, 1):
            log(r.stderr[-2000:])
    for name, args in cases:
        profile(name, args + extra)
    hf.cleanup()


class Phases:
    """Seconds (CPU of this process) spent inside named functions, by wrapping them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.process_time() - t0
                self.calls[name] = self.calls.get(name, 0) + 1
        setattr(owner, attr, timed)


def profile(name: str, args: list[str]) -> None:
    """The search in this process with each phase timed (CPU seconds)."""
    from planner.cli import main
    from planner.search import evaluate, repeats

    ph = Phases()
    ph.wrap(repeats, "capture", "trace (torch.export on meta)")
    ph.wrap(repeats, "model_costs", "cost model (FLOPs, saved bytes)")
    ph.wrap(evaluate.Evaluator, "peak_memory_bound", "memory bound (before simulating)")
    ph.wrap(evaluate, "apply_for", "apply Program")
    ph.wrap(evaluate, "schedule", "schedule (DAG -> Plan)")
    ph.wrap(evaluate, "simulate", "simulate")
    with tempfile.TemporaryDirectory() as out:
        c0, w0 = time.process_time(), time.perf_counter()
        with _quiet():
            rc = main(["search", *args, "--out", out, "--json"])
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    row = {"case": name, "profile": True, "rc": rc, "cpu_s": round(cpu, 2),
           "wall_s": round(wall, 2),
           "phases_cpu_s": {k: round(v, 2) for k, v in ph.seconds.items()},
           "calls": ph.calls}
    emit(row)
    log(f"{name} in-process: {cpu:.1f} s CPU ({wall:.1f} s wall): " + ", ".join(
        f"{k} {v:.1f} s x{ph.calls[k]}" for k, v in ph.seconds.items()))


@contextmanager
def _quiet() -> Iterator[None]:
    """The search's one JSON line and logs are not this benchmark's output."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


# ---- quality -------------------------------------------------------------------------------
def quality(seeds: int, only: str | None, full: bool = False) -> None:
    from cost_models import CATALOG
    from piper.model_file import load_model_file
    from planner.search.cache import EvaluationCache
    from planner.search.evaluate import Evaluator
    from planner.search.loop import run_search
    from planner.search.space import BUCKETS_MB
    from search_spaces.pipeline import model_space

    cluster = CATALOG["h100-80gb"]
    for name, path, margs, gpus, batch in QUALITY_CASES:
        if only and only not in name:
            continue
        spec = load_model_file(str(ROOT / path), margs)
        batch = batch or spec.batch_size
        ev = Evaluator(spec, gpus, batch, cluster, cache=EvaluationCache(size=1 << 16))
        space = model_space(ev.graph, ev.region_costs(), gpus, batch, cluster.gpus_per_node)
        if full:  # the space `piper-plan search` walks: recompute, comm stream, buckets
            space = dataclasses.replace(space, recomputes=(False, True),
                                        comm_streams=(False, True), buckets=BUCKETS_MB)
        n = len(space.points())
        with tempfile.TemporaryDirectory() as tmp:
            def search(sampler: str, trials: int, seed: int, ev: Any = ev,
                       space: Any = space) -> Any:
                with _quiet():
                    return run_search(ev, space, trials=trials, timeout=None, sampler=sampler,
                                      storage=f"sqlite:///{tmp}/{sampler}-{seed}.db",
                                      study_name="q", seed=seed, progress=False)
            t0 = time.process_time()
            grid = search("grid", n, 0)
            grid_cpu = time.process_time() - t0
            if grid.best is None:
                log(f"{name}: no point fits in memory; nothing to compare")
                continue
            gbest = grid.best.predicted["step_time_s"]
            budget = max(1, round(BUDGET * n))
            runs = []
            for seed in range(seeds):
                t0 = time.process_time()
                r = search("tpe", budget, seed)
                found = r.best.predicted["step_time_s"] if r.best else float("inf")
                runs.append({"seed": seed, "best_step_time_s": found, "ratio": found / gbest,
                             "cpu_s": round(time.process_time() - t0, 2),
                             "best": r.best.summary if r.best else None})
            default = megatron_default(ev, space, grid)
        within = sum(x["ratio"] <= 1.01 for x in runs)
        row = {"case": name, "points": n, "grid_trials": n, "grid_cpu_s": round(grid_cpu, 1),
               "grid_best": grid.best.summary, "grid_best_step_time_s": gbest,
               "tpe_trials": budget, "runs": runs, "within_1pct": f"{within}/{seeds}",
               "megatron_default": default,
               "gain_over_default": (default["step_time_s"] / gbest) if default else None}
        emit(row)
        log(f"{name}: {n} points; grid best {gbest * 1e3:.1f} ms; tpe with {budget} trials: "
            f"ratios {[round(x['ratio'], 4) for x in runs]} ({within}/{seeds} within 1%); "
            f"Megatron-style default {default and round(default['step_time_s'] * 1e3, 1)} ms "
            f"-> gain {row['gain_over_default'] and round(row['gain_over_default'], 3)}x")


def megatron_default(ev: Any, space: Any, grid: Any) -> dict[str, Any] | None:
    """TP across the node, 1F1B, ZeRO-1, microbatch size 1, the shallowest pipeline that
    fits; None if no such point fits."""
    points = [p for p in space.points() if p["schedule"] == "1f1b"]
    if not points:
        return None
    tp = max(p.get("tp", 1) for p in points)
    by_pp: dict[int, dict[str, Any]] = {}
    for p in points:
        dp = space.gpus // (p["pp"] * p.get("tp", 1))
        per_replica = space.batch_size // dp
        if p.get("tp", 1) == tp and p["microbatches"] == per_replica and \
                p["zero"] == (1 if dp > 1 else 0):
            by_pp[p["pp"]] = p
    for pp in sorted(by_pp):
        ev_ = ev.evaluate(space.program(**by_pp[pp]))
        if max(ev_.prediction.peak_memory_bytes) <= ev.cluster.memory_bytes:
            return {"point": by_pp[pp], "step_time_s": ev_.prediction.step_time_s}
    return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("extra", nargs="*", help="more flags for every search")
    q = sub.add_parser("quality")
    q.add_argument("--seeds", type=int, default=5)
    q.add_argument("--only", help="run only cases whose name contains this")
    q.add_argument("--full-space", action="store_true",
                   help="with recompute and the comm stream as choices, as the search has")
    a = p.parse_args(argv)
    run: Callable[[], None] = (lambda: speed(a.extra)) if a.what == "speed" else (
        lambda: quality(a.seeds, a.only, a.full_space))
    run()


if __name__ == "__main__":
    main()
