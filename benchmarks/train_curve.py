"""A real training run with a found-style strategy against single-device training, and what
checkpoints cost.

    python benchmarks/train_curve.py [--steps 200] [--out benchmarks/out]

`examples/gpt.py size=mini` (7.4M parameters) on a token file generated deterministically
(`runtime.train.data.write_synthetic_tokens`: 2M tokens, 4 MB), global batch 32 x 64 tokens,
AdamW lr 1e-3 with 20 warmup steps and cosine decay, global gradient clipping at 1.0.
The strategy: pp=2 x dp=2, ZeRO-2, 1F1B, 4 microbatches, on four CPU worker processes
(gloo). The peer: the same training in one process, plain PyTorch (`runtime.train.reference`).
Writes `train_curve.png` (both loss curves overlaid) and prints the largest relative loss
difference, then the checkpoint cost: time to save one checkpoint (DCP, every rank its own
blocks) against one training step of the same run, and its bytes against the model's
parameter bytes (parameters + AdamW's two moments = 3x).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cost_models import CATALOG
    from piper.model_file import load_model_file, parse_model_args
    from planner.search.evaluate import Evaluator
    from planner.search.strategy import shorthand_program
    from runtime.cluster.launcher import Job
    from runtime.lowering.lower import lower
    from runtime.train.data import write_synthetic_tokens
    from runtime.train.reference import max_rel_diff, reference_run
    from runtime.train.training import TrainConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="train-curve-"))
    tokens = write_synthetic_tokens(str(work / "tokens.bin"), 2_000_000, vocab=2048)
    spec = load_model_file(str(ROOT / "examples" / "gpt.py"), parse_model_args(["size=mini"]))
    batch, gpus = 32, 4
    train = TrainConfig(lr=1e-3, warmup=20, lr_schedule="cosine", decay_steps=args.steps,
                        clip_grad=1.0, data=tokens)
    ev = Evaluator(spec, gpus, batch, CATALOG["cpu"])
    ns = argparse.Namespace(pp=2, dp=2, tp=None, ep=None, zero=2, schedule="1f1b",
                            microbatches=4, virtual_stages=None, recompute=False,
                            comm_stream=False, bucket_mb=None)
    graph = ev.captured.graph
    program = shorthand_program(ns, gpus, graph.names, ev.region_costs(), graph.expert_regions)
    plan = lower(spec, program, gpus, batch)
    params = sum(p.numel() for p in spec.build().parameters())

    t0 = time.perf_counter()
    with Job(spec, plan, batch_size=batch, seed=0, train=train) as job:
        ours = [job.step() for _ in range(args.steps)]
        ours_s = time.perf_counter() - t0
        saves = []
        for _ in range(3):
            t = time.perf_counter()
            folder = Path(job.save(str(work / "ckpt"), {"model": [spec.path, []]}))
            saves.append(time.perf_counter() - t)
        job.finish()
    ckpt_bytes = sum(f.stat().st_size for f in folder.iterdir())
    t0 = time.perf_counter()
    ref = reference_run(spec, batch_size=batch, steps=args.steps, seed=0, train=train)
    ref_s = time.perf_counter() - t0

    a, b = [s.loss for s in ours], [r.loss for r in ref]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(b) + 1), b, label="single device (plain PyTorch)", lw=3, alpha=0.5)
    ax.plot(range(1, len(a) + 1), a, label="pp2 x dp2 ZeRO-2 1F1B, 4 CPU ranks", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"gpt.py size=mini ({params / 1e6:.1f}M params), synthetic tokens")
    ax.legend()
    fig.tight_layout()
    png = out / "train_curve.png"
    fig.savefig(png, dpi=120)
    step_s = sorted(s.time_s for s in ours)[len(ours) // 2]
    print(f"steps: {args.steps}; loss {b[0]:.3f} -> {b[-1]:.3f} (single device), "
          f"{a[0]:.3f} -> {a[-1]:.3f} (pp2 x dp2)")
    print(f"max relative loss difference: {max_rel_diff(a, b):.2e}")
    print(f"wall: ours {ours_s:.1f} s (with worker start), single device {ref_s:.1f} s")
    print(f"checkpoint: save {min(saves) * 1e3:.0f} ms (best of 3) = "
          f"{min(saves) / step_s:.1f}x a median step ({step_s * 1e3:.0f} ms); "
          f"{ckpt_bytes / 2**20:.1f} MiB = {ckpt_bytes / (4 * params):.2f}x the fp32 "
          f"parameter bytes ({4 * params / 2**20:.1f} MiB)")
    print(f"figure: {png}")


if __name__ == "__main__":
    main()
