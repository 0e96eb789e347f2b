"""One stage's forward and backward: our exported stage graph against torch's eager modules.

    python benchmarks/chunk_vs_eager.py --ranks 2 --repeats 30

The stages of benchmarks/vs_torch_pipelining.py (same model, cut, microbatch), each run in
this one process on one thread, ours and eager alternated; the median time of each after 3
warm-up repeats, and their ratio. It tells whether a pipeline step can differ at all
between the two systems for reasons other than scheduling: if the chunks cost the same,
only the order and the time between chunks can.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vs_torch_pipelining import GPT, MODEL_ARGS, RegionStage

from cost_models import CATALOG
from piper.capture import capture
from piper.model_file import load_model_file
from planner.search.evaluate import Evaluator
from runtime.execute.stage_module import build_stage
from search_spaces.partition import balanced_stages

Chunk = Callable[[torch.Tensor], None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="stages (1f1b cut, one per rank)")
    ap.add_argument("--microbatch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = load_model_file(GPT, MODEL_ARGS)
    ev = Evaluator(spec, 1, 16, CATALOG["cpu"])
    names = ev.captured.graph.names
    stages = [[names[i] for i in r] for r in balanced_stages(ev.region_costs(), args.ranks)]
    captured = capture(spec, args.microbatch)
    torch.manual_seed(0)
    model = spec.build()
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers())
    (x,), y = spec.batch(args.microbatch)
    last = len(stages) - 1

    def eager(s: int) -> Chunk:
        m = RegionStage(model, stages[s])

        def run(h: torch.Tensor) -> None:
            inp = x if s == 0 else h.detach().requires_grad_(True)
            out = m(inp)
            if s == last:
                spec.loss_fn(out, y).backward()
            else:
                out.backward(torch.ones_like(out))
        return run

    def ours(s: int) -> Chunk:
        sm = build_stage(captured, {names.index(r) for r in stages[s]}, torch.device("cpu"))
        weights = [params[k] for kind, k in sm.inputs if kind == "param"]  # type: ignore

        def run(h: torch.Tensor) -> None:
            leaves = []
            fixed = {"param": params, "buffer": buffers}
            inputs = []
            for kind, key in sm.inputs:
                if kind in fixed:
                    inputs.append(fixed[kind][key])  # type: ignore[index]
                elif kind == "input":
                    inputs.append(x)
                else:
                    leaves.append(h.detach().requires_grad_(True))
                    inputs.append(leaves[-1])
            outs = sm.module(*inputs)
            if s == last:
                roots, seeds = [spec.loss_fn(outs[0], y)], None
            else:
                roots, seeds = list(outs), [torch.ones_like(o) for o in outs]
            torch.autograd.backward(roots, seeds, inputs=leaves + weights)
        return run

    def incoming(s: int) -> torch.Tensor:
        """A random activation shaped like the one stage `s` receives (unused by stage 0)."""
        sm = build_stage(captured, {names.index(r) for r in stages[s]}, torch.device("cpu"))
        acts = [k for kind, k in sm.inputs if kind == "act"]
        return torch.randn(captured.graph.value(acts[0]).shape) if acts else torch.empty(0)

    chunks = {(s, who): f(s) for s in range(len(stages)) for who, f in
              (("ours", ours), ("eager", eager))}
    hs = [incoming(s) for s in range(len(stages))]
    times: dict[tuple[int, str], list[float]] = {k: [] for k in chunks}
    for _ in range(args.repeats):
        for k, f in chunks.items():
            t = time.perf_counter()
            f(hs[k[0]])
            times[k].append(time.perf_counter() - t)
    print("| stage | regions | ours (ms) | eager (ms) | ours/eager |")
    print("|---|---|---|---|---|")
    for s in range(len(stages)):
        a, b = (statistics.median(times[(s, w)][3:]) * 1e3 for w in ("ours", "eager"))
        print(f"| {s} | {', '.join(stages[s])} | {a:.2f} | {b:.2f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
