"""The prepared check for the day a GPU is lent: what the cost model assumes, measured.

    bash benchmarks/gpu_check.sh                         # on the GPU machine, <= 8 minutes
    python benchmarks/gpu_check.py --device cpu --size tiny --steps 3   # the same path, here

Runs as it finds the machine: the torch it has (>= 2.9), the project from this source tree
(PYTHONPATH), no Ray, no Optuna, nothing installed (`gpu_check.sh` names what is missing).

1. CUDA paths the runtime relies on: bf16 matmuls against fp32, a side stream ordered by an
   event, `torch.cuda.max_memory_allocated`, a one-rank NCCL group's all-reduce.
2. Each mechanism against the catalog entry's prediction for the device: bf16 GEMMs over a
   grid of (M, N, K) with thin and wave-quantized shapes (`cost_models.kernels`), memory-
   bound kernels by size, the fixed cost of a small kernel, copy bandwidth, a causal fused
   attention forward + backward; and the saturating matmul curve the profiled cluster files
   use.
3. One cluster file per precision (OUT/cluster_bf16.toml, OUT/cluster_fp32.toml): the
   catalog's links (one GPU has no peer to time them with) with the measured compute,
   memory and per-op figures.
4. Single-device training steps of a ~124M-parameter GPT (GPT-2 small shapes), bf16-mixed,
   at microbatch sizes 1, 2, 4, 8, with and without recompute, trained for real (`piper-plan
   run --launcher local --json`) and simulated on the catalog entry and on the profiled file
   (`simulate --json`): step time and peak memory, measured vs predicted. Two-rank strategies
   are attempted and reported as refused where the machine has one GPU (NCCL ranks each
   own a device).

Writes OUT/gpu_check.json and prints one table; never a test dependency.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch
from scipy.optimize import curve_fit

from cost_models.attention import ATTENTION_BACKWARD_RATIO, CAUSAL_WORK, attention_seconds
from cost_models.cluster import load_cluster, to_toml

GPT = str(ROOT / "examples" / "gpt.py")
SIZES = {  # --model-arg pairs
    "gpt124m": ["size=1b", "dim=768", "layers=12", "heads=12", "seq=1024", "vocab=50304"],
    "tiny": ["size=tiny"],
}
STRATEGIES = [  # (label, precision, extra flags, gpus): microbatch size = 8 / microbatches
    *((f"bf16-mixed mbs{8 // m}{' recompute' if rc else ''}", "bf16-mixed",
       ["--microbatches", str(m), *(["--recompute"] if rc else [])], 1)
      for rc in (False, True) for m in (8, 4, 2, 1)),
    ("bf16-mixed pp2 1f1b mbs2", "bf16-mixed", ["--pp", "2", "--microbatches", "4"], 2),
    ("bf16-mixed dp2 zero3 mbs4", "bf16-mixed", ["--dp", "2", "--zero", "3"], 2),
]
QUICK = ("bf16-mixed mbs8 recompute", "bf16-mixed pp2 1f1b mbs2")  # one rank, two ranks


def cuda_paths(device: str) -> dict:
    """Each CUDA path the runtime uses, run once here; on CPU, the same calls where they
    exist (so the script itself is exercised without a GPU)."""
    out: dict = {"device": device}
    dev = torch.device(device)
    a = torch.randn(512, 512, device=dev)
    b = torch.randn(512, 512, device=dev)
    low = (a.bfloat16() @ b.bfloat16()).float()
    out["bf16_matmul_rel_error"] = float((low - a @ b).norm() / (a @ b).norm())
    if device != "cuda":
        return out
    out["name"] = torch.cuda.get_device_name()
    out["memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    side = torch.cuda.Stream()
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        c = a @ b
        done.record(side)
    torch.cuda.current_stream().wait_event(done)
    out["stream_event_ok"] = bool(torch.allclose(c, a @ b))
    torch.cuda.reset_peak_memory_stats()
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
    out["max_memory_allocated_ok"] = torch.cuda.max_memory_allocated() >= big.numel()
    del big
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    out["nccl_all_reduce_ok"] = bool(torch.equal(t, torch.ones(4, device=dev)))
    dist.destroy_process_group()
    return out


def _timed(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def matmul_curve(device: str, dtype: torch.dtype, quick: bool) -> dict:
    """Matmul rate by FLOPs in `dtype`, fitted to top x f / (f + half) (the cost model's
    saturating curve: a fixed cost per matmul plus its FLOPs at the top rate)."""
    dev = torch.device(device)
    shapes = [(256, 256, 256), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
              (8192, 8192, 8192), (4096, 768, 3072), (8192, 4096, 1024), (2048, 12288, 3072)]
    if quick:
        shapes = shapes[:3]
    points = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        s = _timed(lambda a=a, b=b: a @ b, device, 3 if quick else 20)
        points.append((2.0 * m * k * n, 2.0 * m * k * n / s))
    f = [p[0] for p in points]
    r = [p[1] for p in points]
    (top, half), _ = curve_fit(lambda x, t, h: t * x / (x + h), f, r, p0=(max(r), min(f)),
                               bounds=([0, 0], [10 * max(r), 1e15]))
    return {"points": points, "rate_max": float(top), "half_flops": float(half)}


def attention_rate(device: str, dtype: torch.dtype, quick: bool) -> float:
    """FLOP/s a causal fused attention (SDPA) runs forward + backward, counted as the cost
    model times it: half the s x s blocks, a backward of 2.5 forwards."""
    b, h, s, d = (1, 2, 128, 32) if quick else (4, 16, 4096, 128)
    q, k, v = (torch.randn(b, h, s, d, device=torch.device(device), dtype=dtype,
                           requires_grad=True) for _ in range(3))

    def step() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum(
            ).backward()
    seconds = _timed(step, device, 3 if quick else 20)
    forward = 4.0 * b * h * s * s * d * CAUSAL_WORK  # QK^T and PV, the blocks it runs
    return forward * (1 + ATTENTION_BACKWARD_RATIO) / seconds


def memory_and_overheads(device: str, quick: bool) -> dict:
    """Copy bandwidth (what memory-bound ops stream at) and the fixed cost of one small op
    forward and forward + backward (launch and dispatch)."""
    dev = torch.device(device)
    x = torch.empty(2**24 if quick else 256 * 2**20, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    copy_s = _timed(lambda: y.copy_(x), device, 3 if quick else 10)
    tiny = torch.ones(8, device=dev, requires_grad=True)
    fwd = _timed(lambda: tiny * 2, device, 50 if quick else 500)
    both = _timed(lambda: (tiny * 2).sum().backward(), device, 50 if quick else 500)
    return {"copy_bandwidth": 2 * x.numel() / copy_s, "op_s": fwd,
            "backward_op_s": max(0.0, both - 2 * fwd)}


def gemm_grid(device: str, base, quick: bool) -> list[dict]:
    """bf16 (CPU: fp32) GEMMs by shape against `cost_models.kernels.gemm_seconds` on the
    catalog entry: square, thin K, thin N, a transformer layer's, and a tile count one past
    a full wave of the SMs (the last wave nearly empty) beside one exactly full."""
    from cost_models.kernels import Gemm, gemm_seconds

    low = device == "cuda"
    dtype = torch.bfloat16 if low else torch.float32
    sms = base.sms or 132
    shapes = [(4096, 4096, 4096), (8192, 8192, 8192), (2048, 2048, 2048), (8192, 8192, 128),
              (8192, 64, 8192), (8192, 2304, 768), (8192, 768, 3072), (8192, 3072, 768),
              (256 * sms, 128, 8192), (256 * (sms + 1), 128, 8192)]
    if quick:
        shapes = [(256, 256, 256), (512, 64, 512), (512, 512, 32)]
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        took = _timed(lambda a=a, b=b: a @ b, device, 3 if quick else 20)
        nbytes = a.element_size() * (m * k + k * n + m * n)
        predicted = gemm_seconds(base, Gemm(1, m, n, k), nbytes, low)
        rows.append({"m": m, "n": n, "k": k, "measured_s": took, "predicted_s": predicted,
                     "tflops": 2 * m * n * k / took / 1e12, "error": predicted / took - 1})
    return rows


def memory_bound(device: str, base, quick: bool) -> list[dict]:
    """An elementwise add (two reads, one write) by size, against the catalog's price of a
    memory-bound kernel: its bytes at `elementwise_bandwidth` plus `kernel_overhead_s`."""
    sizes = [2**12, 2**16, 2**20, 2**24] if quick else [2**16, 2**20, 2**22, 2**24, 2**26,
                                                        2**28]
    rows = []
    for n in sizes:  # elements, bf16 (CPU: fp32)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        x = torch.randn(n, device=device, dtype=dtype)
        y, z = torch.randn_like(x), torch.empty_like(x)
        took = _timed(lambda x=x, y=y, z=z: torch.add(x, y, out=z), device, 5 if quick else 50)
        nbytes = 3 * n * x.element_size()
        bw = base.elementwise_bandwidth
        predicted = (nbytes / bw if bw else 0.0) + base.kernel_overhead_s
        rows.append({"bytes": nbytes, "measured_s": took, "predicted_s": predicted,
                     "gb_per_s": nbytes / took / 1e9,
                     "error": predicted / took - 1 if predicted else None})
    return rows


def catalog_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return "h200" if "h200" in name else "a100-80gb" if "a100" in name else "h100-80gb"


def piper(*args: str, timeout: int = 300) -> tuple[int, dict | None, str]:
    """One `piper-plan` command: (exit code, its --json object or None, stderr tail)."""
    cmd = [sys.executable, "-m", "planner.cli", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}  # the source tree
    try:
        p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                           cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return 124, None, f"timed out after {timeout} s"
    try:
        obj = json.loads(p.stdout) if p.stdout.strip() else None
    except json.JSONDecodeError:
        obj = None
    return p.returncode, obj, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", choices=sorted(SIZES), default="gpt124m")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "gpu_check")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here (use --device cpu to exercise the script)",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    quick = args.size == "tiny"
    start = time.perf_counter()
    report: dict = {"paths": cuda_paths(args.device)}
    print("CUDA paths:", json.dumps(report["paths"]))
    low = matmul_curve(args.device, torch.bfloat16 if args.device == "cuda"
                       else torch.float32, quick)
    full = matmul_curve(args.device, torch.float32, quick)
    mem = memory_and_overheads(args.device, quick)
    attention = attention_rate(args.device, torch.bfloat16 if args.device == "cuda"
                               else torch.float32, quick)
    base = load_cluster(catalog_name(args.device))
    grid = gemm_grid(args.device, base, quick)
    streams = memory_bound(args.device, base, quick)
    report |= {"matmul_bf16": low, "matmul_fp32": full, "memory": mem,
               "attention_bf16_rate": attention, "gemm_grid": grid, "memory_bound": streams,
               "catalog": base.name}
    print(f"\nGEMMs against the catalog ({base.name}: waves over {base.sms} SMs)")
    print(f"{'M':>7} {'N':>6} {'K':>6} {'TFLOP/s':>8} {'measured':>10} {'predicted':>10} "
          f"{'error':>7}")
    for g in grid:
        print(f"{g['m']:>7} {g['n']:>6} {g['k']:>6} {g['tflops']:>8.1f} "
              f"{g['measured_s'] * 1e6:>8.1f}us {g['predicted_s'] * 1e6:>8.1f}us "
              f"{100 * g['error']:>+6.1f}%")
    print(f"\nmemory-bound add against the catalog ({(base.elementwise_bandwidth or 0) / 1e9:.0f}"
          f" GB/s + {base.kernel_overhead_s * 1e6:.1f} us a kernel)")
    for r in streams:
        err = f"{100 * r['error']:>+6.1f}%" if r["error"] is not None else "     -"
        print(f"{r['bytes'] / 2**20:>10.2f} MiB {r['gb_per_s']:>8.0f} GB/s "
              f"{r['measured_s'] * 1e6:>9.1f}us {r['predicted_s'] * 1e6:>9.1f}us {err}")
    for name, curve, peak in (("bf16", low, base.peak_flops(True)),
                              ("fp32", full, base.peak_flops(False))):
        print(f"{name} matmul: up to {curve['rate_max'] / 1e12:.3g} TFLOP/s = "
              f"{curve['rate_max'] / peak:.2f} of the catalog's {peak / 1e12:.3g} TF "
              f"(the catalog has {base.compute_efficiency:.3f}); half rate at "
              f"{curve['half_flops']:.3g} FLOPs")
    low_peak = base.peak_flops(args.device == "cuda")
    # the catalog's rate for the same kernel (4096 keys, causal), at full clock
    unthrottled = dataclasses.replace(base, sustained_clock=1.0)
    catalog = 1e12 * CAUSAL_WORK * (1 + ATTENTION_BACKWARD_RATIO) / sum(attention_seconds(
        unthrottled, 1e12, CAUSAL_WORK, (4096, 1), 0, True))
    print(f"causal attention forward + backward: {attention / 1e12:.3g} TFLOP/s = "
          f"{attention / low_peak:.2f} of the peak (the catalog: {catalog / low_peak:.2f} at "
          "4096 keys)")
    print(f"copy {mem['copy_bandwidth'] / 1e9:.0f} GB/s (catalog elementwise: "
          f"{(base.elementwise_bandwidth or 0) / 1e9:.0f}); one small op {mem['op_s'] * 1e6:.1f} "
          f"us forward, {mem['backward_op_s'] * 1e6:.1f} us backward")
    # one cluster file per precision: the catalog's links (one GPU: no peers to time them
    # with) and this device's measured compute, memory and per-op figures
    # the measured figures replace the catalog's published mechanisms they cover: the
    # matmul size curve the SM waves, the per-op costs the launch and dispatch figures, the
    # measured rates the fitted sustained clock
    measured = dict(elementwise_bandwidth=mem["copy_bandwidth"],  # noqa: C408
                    op_overhead_s=mem["op_s"], backward_op_overhead_s=mem["backward_op_s"],
                    sms=0, kernel_overhead_s=0.0, host_dispatch_s=0.0, sustained_clock=1.0,
                    attention_curve=(),
                    source=f"benchmarks/gpu_check.py on {report['paths'].get('name', args.device)}"
                           ": measured compute, copy bandwidth and op overheads; links "
                           f"from the catalog's {base.name}")
    model = [a for kv in SIZES[args.size] for a in ("--model-arg", kv)]
    common = [GPT, *model, "--batch-size", str(args.batch_size)]
    clusters = {}
    for name, curve, peak in (("bf16", low, base.peak_flops(True)),
                              ("fp32", full, base.peak_flops(False))):
        spec = dataclasses.replace(
            base, name=f"measured-{name}", **measured,
            compute_efficiency=min(1.0, curve["rate_max"] / peak),
            # the attention was timed in bf16 (fp32 runs keep the matmul figure)
            attention_efficiency=min(1.0, attention / peak) if name == "bf16" else None,
            matmul_half_flops=curve["half_flops"])
        clusters[name] = args.out / f"cluster_{name}.toml"
        clusters[name].write_text(to_toml(spec))
    rows = []
    # the tiny size exercises the path (a test runs it): one strategy of each kind
    chosen = [s for s in STRATEGIES if not quick or s[0] in QUICK]
    strategies = [(label, gpus, [*common, "--gpus", str(gpus), "--precision", precision,
                                 *flags], clusters["fp32" if precision == "fp32" else "bf16"])
                  for label, precision, flags, gpus in chosen]
    # simulations are CPU work: all at once, beside the runs one at a time
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        simulated = [(pool.submit(piper, "simulate", *strat, "--cluster", str(which), "--json"),
                      pool.submit(piper, "simulate", *strat, "--cluster", base.name, "--json"))
                     for _, _, strat, which in strategies]
        runs = [piper("run", *strat, "--device", args.device, "--launcher", "local",
                      "--steps", str(args.steps), "--seed", "0", "--json", timeout=240)
                for _, _, strat, _ in strategies]
        simulated = [(a.result(), b.result()) for a, b in simulated]
    for (label, gpus, _, _), (rc_r, run, err_r), ((rc_s, sim, err_s), (rc_c, cat, _)) in zip(
            strategies, runs, simulated, strict=True):
        row = {"strategy": label, "gpus": gpus}
        if rc_r == 0 and run and rc_s == 0 and sim:
            times = [s["time_s"] for s in run["steps"][1:]] or [run["steps"][0]["time_s"]]
            took = statistics.median(times)
            predicted = sim["predicted"]["step_time_s"]
            row |= {"measured_s": took, "predicted_s": predicted,
                    "error": predicted / took - 1,
                    "measured_peak": max(run["peak_memory_bytes"]),
                    "predicted_peak": max(sim["predicted"]["peak_memory_bytes"])}
            if rc_c == 0 and cat:
                row |= {"catalog_s": cat["predicted"]["step_time_s"],
                        "catalog_error": cat["predicted"]["step_time_s"] / took - 1}
        else:
            row["not_run"] = err_r or err_s or f"exit {rc_r}/{rc_s}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    report["strategies"] = rows
    report["seconds"] = time.perf_counter() - start
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"\n| strategy | measured | profiled file | error | catalog ({base.name}) | error "
          "| peak measured | peak predicted |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "not_run" in r:
            print(f"| {r['strategy']} | not run: {r['not_run'][:90]} |")
            continue
        cat = (f"{r['catalog_s'] * 1e3:.1f} ms | {100 * r['catalog_error']:+.1f}%"
               if "catalog_s" in r else "- | -")
        print(f"| {r['strategy']} | {r['measured_s'] * 1e3:.1f} ms | "
              f"{r['predicted_s'] * 1e3:.1f} ms | {100 * r['error']:+.1f}% | {cat} | "
              f"{r['measured_peak'] / 2**20:.0f} MiB | {r['predicted_peak'] / 2**20:.0f} MiB |")
    done = [r for r in rows if "error" in r]
    if done:
        print(f"MAPE {100 * statistics.fmean(abs(r['error']) for r in done):.1f}% over "
              f"{len(done)} strategies; {report['seconds']:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
