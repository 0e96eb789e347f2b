"""The Piper paper's ZeRO × pipeline and DualPipeV experiments, in our simulator.

    python benchmarks/paper_table.py [--cluster a100-80gb] [--max-mb 64]

Setup (after the paper's artifact, `artifact/e2e_eval.py` in uw-syfi/piper: Qwen3 "1B",
pp=8, dp=2, 1F1B, 2·pp = 16 microbatches per step, microbatch sizes swept): our Qwen3-like
1B (`examples/llama.py size=qwen3-1b dtype=bfloat16`: 16 layers, d 2048, 16 query / 8
key-value heads with q/k RMSNorm, SwiGLU 6144, 151,936-token vocabulary tied to the
embedding; 1.12B parameters; sequence 1024), planned on meta tensors and simulated on the
cluster spec. Nothing here runs on a GPU: every figure is the simulator's.

1. Largest microbatch size that fits, per ZeRO stage and per system *behaviour*, each the
   largest size whose simulated per-rank peak stays within the device memory:
   - ours (piper-plan): ZeRO-1 shards the optimizer state; ZeRO-2 reduce-scatters each
     microbatch's gradient as its backward ends, so gradients stay sharded between
     microbatches; ZeRO-3 also gathers a stage's parameters before each chunk and frees them
     after it.
   - Megatron-LM (distributed optimizer) and DeepSpeed with pipelining: ZeRO-1 only, the
     same model state as ours at ZeRO-1 (DeepSpeed asserts ZeRO-2/3 cannot run with its
     pipeline engine; Megatron has no ZeRO-2/3).
   - TorchTitan (FSDP2 + torch.distributed.pipelining): gradients stay unsharded across
     microbatches (they are reduce-scattered once, after the last). Its "ZeRO-1/2"
     (`reshard_after_forward=never`) is therefore ZeRO-1's model state; its ZeRO-3
     (`always`) is ours at ZeRO-3 with the sharded gradient replaced by a whole one that
     lives all step — ours, in turn, holds one whole stage gradient from a backward to its
     reduce-scatter, so at the peak (inside a backward) the two differ by the gradient shard.
2. Throughput of DualPipeV against 1F1B at the same setup (ZeRO-1, the largest microbatch
   size both fit): tokens/s from the simulated step.

Results go to stdout as JSON lines and a markdown table to stderr (pasted in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cost_models.cluster import load_cluster
from cost_models.memory import stage_params
from piper.model_file import load_model_file
from planner.search.evaluate import Evaluation, Evaluator
from planner.search.strategy import shorthand_program

MODEL = ("examples/llama.py", (("size", "qwen3-1b"), ("dtype", "bfloat16")))
PP, DP, MICROBATCHES = 8, 2, 16
ZEROS = (1, 2, 3)

PAPER = {
    "source": "arXiv 2606.11169 (Piper), abstract; the paper's tables were not available "
              "here, only its abstract and summaries of it",
    "zero": "ZeRO under pipelining at parity with existing systems where they can run it; "
            "ZeRO-2/3 composed with PP (which DeepSpeed and TorchTitan cannot do as "
            "designed) allows larger microbatches (a secondary summary reports 3-8x larger "
            "batches)",
    "dualpipev": "joint scheduling of compute and communication (DualPipe-style overlap) "
                 "gains throughput (a secondary summary reports 6-30%)",
}


def evaluate(ev: Evaluator, schedule: str, zero: int, mb: int) -> Evaluation:
    ev = copy.copy(ev)  # shares the capture; only the global batch differs
    ev.batch_size = mb * MICROBATCHES * DP
    args = argparse.Namespace(pp=PP, dp=DP, tp=None, ep=None, zero=zero, schedule=schedule,
                              virtual_stages=None, microbatches=MICROBATCHES,
                              comm_stream=False, recompute=False)
    return ev.evaluate(shorthand_program(args, PP * DP, ev.graph.names, ev.region_costs()))


def peak(ev: Evaluator, e: Evaluation, behaviour: str) -> int:
    """Most bytes on any rank under `behaviour`'s model state (see the module docstring)."""
    peaks = list(e.prediction.peak_memory_bytes)
    if behaviour == "torchtitan" and e.plan.zero == 3:
        params = stage_params(e.plan, ev.costs)
        for i, rp in enumerate(e.plan.ranks):
            shard = sum(params[s] for s in rp.stages) * ev.costs.element_size / e.plan.dp
            peaks[i] -= round(shard)
    return max(peaks)


def largest_fit(ev: Evaluator, schedule: str, zero: int, behaviour: str, max_mb: int
                ) -> tuple[int, Evaluation | None]:
    """Largest microbatch size in 1..max_mb whose peak fits (peaks grow with the size)."""
    cap = ev.cluster.memory_bytes
    lo, best = 0, None
    hi = max_mb + 1
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not (or is past the range)
        mid = (lo + hi) // 2
        e = evaluate(ev, schedule, zero, mid)
        if peak(ev, e, behaviour) <= cap:
            lo, best = mid, e
        else:
            hi = mid
    return lo, best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="a100-80gb")
    ap.add_argument("--max-mb", type=int, default=64)
    a = ap.parse_args()
    t0 = time.perf_counter()
    spec = load_model_file(ROOT / MODEL[0], MODEL[1])
    ev = Evaluator(spec, PP * DP, MICROBATCHES * DP, load_cluster(a.cluster))
    n_params = sum(ev.costs.params)
    rows: list[dict[str, Any]] = []
    for system, zeros, behaviour in (("piper-plan (ours)", ZEROS, "ours"),
                                     ("Megatron-LM / DeepSpeed", (1,), "ours"),
                                     ("TorchTitan", ZEROS, "torchtitan")):
        for zero in ZEROS:
            if zero not in zeros:
                rows.append({"system": system, "zero": zero, "max_microbatch": None,
                             "note": "not supported with pipeline parallelism"})
                continue
            # TorchTitan's ZeRO-2 keeps gradients whole across microbatches: ZeRO-1's state
            run_zero = 1 if behaviour == "torchtitan" and zero == 2 else zero
            mb, e = largest_fit(ev, "1f1b", run_zero, behaviour, a.max_mb)
            rows.append({"system": system, "zero": zero, "max_microbatch": mb,
                         "peak_gib": round(peak(ev, e, behaviour) / 2**30, 1) if e else None,
                         "tokens_per_s": round(e.prediction.tokens_per_s) if e else None})
    for r in rows:
        print(json.dumps({"table": "zero", **r}), flush=True)
    # DualPipeV against 1F1B at ZeRO-1, the largest microbatch both fit
    mb_1f1b, _ = largest_fit(ev, "1f1b", 1, "ours", a.max_mb)
    mb_dpv, _ = largest_fit(ev, "dualpipev", 1, "ours", a.max_mb)
    mb = min(mb_1f1b, mb_dpv)
    sched = {s: evaluate(ev, s, 1, mb).prediction for s in ("1f1b", "dualpipev")}
    ratio = sched["dualpipev"].tokens_per_s / sched["1f1b"].tokens_per_s
    pair = {"table": "schedule", "microbatch": mb, "max_mb_1f1b": mb_1f1b,
            "max_mb_dualpipev": mb_dpv,
            **{f"{s}_tokens_per_s": round(p.tokens_per_s) for s, p in sched.items()},
            **{f"{s}_bubble": round(p.bubble_fraction, 3) for s, p in sched.items()},
            "dualpipev_over_1f1b": round(ratio, 3)}
    print(json.dumps(pair), flush=True)
    log = sys.stderr
    print(f"model {n_params / 1e9:.2f}B parameters, cluster {a.cluster}, pp={PP} dp={DP}, "
          f"{MICROBATCHES} microbatches ({time.perf_counter() - t0:.0f} s)\n", file=log)
    print("| system | ZeRO | largest microbatch that fits | peak (GiB) | tokens/s |", file=log)
    print("|---|---|---|---|---|", file=log)
    for r in rows:
        print(f"| {r['system']} | {r['zero']} | {r['max_microbatch'] or r.get('note')} | "
              f"{r.get('peak_gib') or '-'} | {r.get('tokens_per_s') or '-'} |", file=log)
    print(f"\nDualPipeV / 1F1B tokens/s at microbatch {mb}: {ratio:.3f} (bubble "
          f"{pair['1f1b_bubble']:.1%} -> {pair['dualpipev_bubble']:.1%})", file=log)
    print(f"\npaper: {json.dumps(PAPER, indent=1)}", file=log)


if __name__ == "__main__":
    main()
