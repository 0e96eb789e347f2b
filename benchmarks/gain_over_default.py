"""Gain over what an expert runs: the search's pick against torchtitan's defaults and
Megatron's published recipe for the size, each at its best microbatch, in one simulator.

    python benchmarks/gain_over_default.py [--size 8b --size 70b --size 405b] [--trials N]

For each Llama 3 size on H100s (catalog `h100-80gb`, bf16-mixed, 8,192-token sequences):
- torchtitan's defaults (`torchtitan/models/llama3/train_configs`, docs/composability):
  FSDP (ZeRO-3 in one unit per layer); FSDP + TP 8 inside the node (with sequence
  parallelism, as torchtitan's TP plan does); and for the largest, + PP 8 (1F1B);
- Megatron's recipe for that size (Megatron-Bridge's DGX-H100 performance summary,
  `../shared/published/gpu_runs.md` section 6b: 8B tp1 pp1, 70B tp4 pp8 vp5, 405B tp8 pp8
  vp8 cp2 — context parallelism is not expressible, so its ranks join data parallelism),
  with sequence parallelism and the distributed optimizer (ZeRO-1);
each tried at microbatches of 1, 2, 4 and 8 sequences, with and without full activation
recompute, keeping the fastest that fits in memory. The search (`piper-plan search`, the
same cluster, batch and precision) runs as a user runs it; its pick is re-simulated here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cost_models import load_cluster
from piper.model_file import load_model_file
from piper.program import Program
from planner.report.frameworks.recipes import Recipe, best_setting
from planner.search.evaluate import Evaluation, Evaluator

LLAMA = str(ROOT / "examples" / "llama.py")
CLUSTER = "h100-80gb"
GiB = 2**30
CASES = {  # size: (examples/llama.py config, GPUs, global batch in sequences)
    "8b": ("llama3-8b", 64, 128),
    "70b": ("llama3-70b", 256, 256),
    "405b": ("405b", 1024, 512),
}
MEGATRON = {"8b": (1, 1, 1), "70b": (4, 8, 5), "405b": (8, 8, 8)}  # tp, pp, vp


def defaults(size: str) -> list[Recipe]:
    out = [Recipe("torchtitan FSDP", 1, 1, 3, units=True),
           Recipe("torchtitan FSDP + TP 8", 8, 1, 3, units=True)]
    if size == "405b":
        out.append(Recipe("torchtitan FSDP + TP 8 + PP 8", 8, 8, 3, units=True))
    tp, pp, v = MEGATRON[size]
    out.append(Recipe(f"Megatron recipe tp{tp} pp{pp}" + (f" vp{v}" if v > 1 else ""),
                      tp, pp, 1, "interleaved-1f1b" if v > 1 else "1f1b", v))
    return out


def search(config: str, gpus: int, gbs: int, trials: int) -> tuple[Program, float]:
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "planner.cli", "search", LLAMA, "--model-arg",
             f"size={config}", "--gpus", str(gpus), "--batch-size", str(gbs), "--cluster",
             CLUSTER, "--trials", str(trials), "--json", "--out", out],
            check=True, capture_output=True, text=True, cwd=ROOT)
        return Program.from_json(json.dumps(json.loads(p.stdout)["best"]["program"])), (
            time.perf_counter() - t)


def describe(e: Evaluation) -> str:
    s = e.program.summary()
    parts = [f"dp{s['dp']}", f"pp{s['pp']}" if s["pp"] > 1 else "",
             f"tp{s['tp']}" + ("+SP" if s.get("sp") else "") if s["tp"] > 1 else "",
             f"ZeRO-{s['zero']}" if s["zero"] else "",
             s["schedule"] + (f" v{s['virtual_stages']}" if s["virtual_stages"] > 1 else "")
             if s["pp"] > 1 else "",
             f"mb {e.microbatch_size}", "AC" if s["recompute"] else ""]
    return " ".join(p for p in parts if p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", action="append", choices=sorted(CASES))
    ap.add_argument("--trials", type=int, default=48)
    args = ap.parse_args()
    cluster = load_cluster(CLUSTER)
    for size in args.size or list(CASES):
        config, gpus, gbs = CASES[size]
        ev = Evaluator(load_model_file(LLAMA, (("size", config),)), gpus, gbs, cluster,
                       precision="bf16-mixed")
        rows = []
        unit = 4 * ev.costs.params_of(["layer.0"]) / 2**20  # one layer, fp32: FSDP's unit
        for r in defaults(size):
            found, tried = best_setting(r, ev, unit)
            rows.append((r.label, found[1] if found else None, "; ".join(tried)))
        program, took = search(config, gpus, gbs, args.trials)
        picked = ev.evaluate(program)
        rows.append((f"search's pick ({args.trials} trials, {took:.0f} s)", picked, ""))
        print(f"\nLlama 3 {size} on {gpus} H100 (h100-80gb), {gbs} x 8192 tokens per step")
        print(f"{'strategy':<44} {'best setting':<44} {'step':>8} {'MFU':>6} {'memory':>9}")
        for label, e, tried in rows:
            if e is None:
                print(f"{label:<44} {'nothing fits: ' + tried[:200]}")
                continue
            p = e.prediction
            print(f"{label:<44} {describe(e):<44} {p.step_time_s:7.2f}s {100 * p.mfu:5.1f}% "
                  f"{p.max_memory_bytes / GiB:6.1f} GiB")
        fitting = [e for _, e, _ in rows[:-1] if e is not None]
        if fitting:
            base = min(fitting, key=lambda e: e.prediction.step_time_s)
            print(f"gain of the search's pick over the best default: "
                  f"{base.prediction.step_time_s / picked.prediction.step_time_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
