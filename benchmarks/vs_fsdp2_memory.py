"""Peak memory per rank of our PP x ZeRO-3 against torch FSDP2 (`fully_shard`) + pipelining.

    python benchmarks/vs_fsdp2_memory.py

Four CPU gloo ranks, pp=2 x dp=2 (ranks 0,1 hold stage 0, ranks 2,3 stage 1), the same model
(examples/gpt.py, size=mini), seed, global batch, stage boundaries, microbatches and 1F1B
schedule, AdamW. Ours: `RankExecutor` (as a Ray worker builds it) running the Plan of
`schedules.build("1f1b", ..., zero=3)`, as one flat buffer per stage (`ours`) and in units of
at most `--unit-mb` MiB whose reduce-scatters start inside the backward (`ours-units`,
`Replicate(bucket_mb=...)`). Theirs: each stage module wrapped by `fully_shard`
over its 2-rank DP sub-mesh of `init_device_mesh("cpu", (2, 2), ("pp", "dp"))`, driven by
`PipelineStage` + `Schedule1F1B` — once with one FSDP group per stage (our granularity: one
flat buffer per stage) and once per block plus the stage root (torchtitan's layout).

One ruler for both: `tensor_ledger.TensorLedger`, a dispatch mode entered before the model
is built, counting the live bytes of every tensor storage in the process. Peaks are per
step (after a warm-up step), split at the peak moment into sharded model state (parameter
shards, gradient shards, optimizer state), gathered parameters, unsharded gradients, and
everything else (activations, received tensors, buffers). Our own ledger's figures (what
`piper-plan run --json` reports) are printed alongside.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from tensor_ledger import TensorLedger
from vs_torch_pipelining import GPT, MODEL_ARGS, RegionStage

from cost_models import CATALOG
from piper import schedules
from piper.capture import capture
from piper.model_file import load_model_file
from planner.search.evaluate import Evaluator
from runtime.lowering.lower import lower
from runtime.lowering.plan import Plan
from search_spaces.partition import balanced_stages

PP, DP = 2, 2
WORLD = PP * DP
CATEGORIES = ("sharded state", "gathered params", "unsharded grads")
MiB = 2**20


def _tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


# ---- ours ---------------------------------------------------------------------------------
def _ours(rank: int, plan: Plan, batch: int, ledger: TensorLedger
          ) -> tuple[Callable[[], dict[str, Any]], Callable[[], None]]:
    from runtime.cluster.worker import process_groups
    from runtime.execute.executor import RankExecutor

    groups = process_groups(plan)  # the process groups a Ray worker makes, tp = 1
    spec = load_model_file(GPT, MODEL_ARGS)
    captured = capture(spec, batch // (plan.dp * plan.microbatches))  # meta: outside the ruler
    with ledger:
        ex = RankExecutor(plan, rank, spec, captured, batch, 0, torch.device("cpu"), groups)

    def classify() -> dict[str, list[torch.Tensor | None]]:
        out: dict[str, list[torch.Tensor | None]] = {c: [] for c in CATEGORIES}
        for sh in ex.sharded.values():
            for u in sh.units:
                out["sharded state"] += [u.shard, u.grad_shard]
                out["gathered params"].append(u.flat)
                out["unsharded grads"] += [*u.pending.values(), u.full_grad]
            out["unsharded grads"] += [g for *_, g in sh._inflight]
        for ps in ex.params.values():  # unsharded parameters (none here: every stage is)
            out["sharded state"] += [*ps, *(p.grad for p in ps)]
        for opt in ex.optim.values():
            out["sharded state"] += _tensors(opt)
        return out

    ex._run_task = _checked(ex._run_task, ledger)  # type: ignore[method-assign]
    ledger.classify = classify
    own: dict[str, Any] = {}

    def step() -> None:
        o = ex.step()
        own.update(loss=o.loss_sum, own_peak=o.peak_memory_bytes,
                   own_state=o.model_state_bytes)

    return (lambda: dict(own)), step


# ---- theirs -------------------------------------------------------------------------------
def _theirs(rank: int, stages: list[list[str]], batch: int, microbatches: int, wrap: str,
            ledger: TensorLedger) -> tuple[Callable[[], dict[str, Any]], Callable[[], None]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    p, r = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    spec = load_model_file(GPT, MODEL_ARGS)
    with ledger:
        torch.manual_seed(0)
        model = spec.build()
        torch.manual_seed(0)
        (x,), y = spec.batch(batch)
        mod = RegionStage(model, stages[p])
        del model  # the other stage's parameters go, as ours drops them
        if wrap == "block":
            for block in mod.blocks.values():
                fully_shard(block, mesh=mesh["dp"])
        fully_shard(mod, mesh=mesh["dp"])
        stage = PipelineStage(mod, p, PP, torch.device("cpu"), group=mesh["pp"].get_group())
        opt = spec.make_optimizer(mod.parameters())
        sched = Schedule1F1B(stage, microbatches, loss_fn=spec.loss_fn)
        per = batch // DP
        x, y = x[r * per:(r + 1) * per].clone(), y[r * per:(r + 1) * per].clone()
    fsdp_params = [fp for m in mod.modules() if isinstance(m, FSDPModule)
                   for g in fully_shard.state(m)._fsdp_param_groups for fp in g.fsdp_params]

    def classify() -> dict[str, list[torch.Tensor | None]]:
        out: dict[str, list[torch.Tensor | None]] = {c: [] for c in CATEGORIES}
        for fp in fsdp_params:
            out["sharded state"] += [fp._sharded_param_data, fp.sharded_param.grad]
            unsharded = getattr(fp, "_unsharded_param", None)
            out["gathered params"] += [*fp.all_gather_outputs, unsharded]
            out["unsharded grads"] += [fp.unsharded_accumulated_grad,
                                       None if unsharded is None else unsharded.grad]
        out["sharded state"] += _tensors(opt)
        return out

    for name in ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad"):
        setattr(stage, name, _checked(getattr(stage, name), ledger))
    ledger.classify = classify
    own: dict[str, Any] = {}

    def step() -> None:
        losses: list[torch.Tensor] = []
        if p == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # torch's losses are per-microbatch means; ours are scaled by 1/(dp * microbatches)
        own["loss"] = (float(sum(t.detach() for t in losses)) / (DP * microbatches)
                       if losses else None)

    return (lambda: dict(own)), step


def _checked(f: Callable[..., Any], ledger: TensorLedger) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        out = f(*a, **k)
        ledger.checkpoint()
        return out
    return run


# ---- one rank -----------------------------------------------------------------------------
def _rank(rank: int, system: str, port: int, plan: Plan, stages: list[list[str]], batch: int,
          microbatches: int, steps: int, out: Any) -> None:
    torch.set_num_threads(1)  # four ranks on this machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    ledger = TensorLedger()
    if system.startswith("ours"):
        report, step = _ours(rank, plan, batch, ledger)
    else:
        report, step = _theirs(rank, stages, batch, microbatches, system.split("-")[1], ledger)
    rows = []
    with ledger:
        for k in range(steps):
            dist.barrier()
            ledger.reset_peak()
            step()
            ledger.checkpoint()
            rows.append({"step": k, "peak": ledger.peak, "split": ledger.peak_split,
                         "top_other": ledger.peak_top_other, "resident": ledger.total,
                         **report()})
    out[(system, rank)] = rows
    dist.destroy_process_group()


def measure(system: str, plan: Plan, stages: list[list[str]], batch: int, microbatches: int,
            steps: int) -> dict[int, list[dict[str, Any]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_rank, args=(system, port, plan, stages, batch, microbatches, steps, out),
                 nprocs=WORLD)
        return {r: out[(system, r)] for r in range(WORLD)}


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="the first is warm-up, not reported")
    ap.add_argument("--systems", nargs="+",
                    default=["ours", "ours-units", "torch-stage", "torch-block"])
    ap.add_argument("--unit-mb", type=float, default=1.0,
                    help="ZeRO unit cap of ours-units (MiB)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spec = load_model_file(GPT, MODEL_ARGS)
    ev = Evaluator(spec, 1, args.batch, CATALOG["cpu"])
    names = ev.captured.graph.names
    stages = [[names[i] for i in r] for r in balanced_stages(ev.region_costs(), PP)]
    prog = schedules.build("1f1b", stages, microbatches=args.microbatches, dp=DP, pp=PP,
                           zero=3)
    plans = {"ours": lower(spec, prog, WORLD, args.batch),
             "ours-units": lower(spec, schedules.with_buckets(prog, args.unit_mb), WORLD,
                                 args.batch)}
    model = spec.build()
    psi = [sum(p.numel() for n, p in model.named_parameters() if _region(n) in st)
           for st in stages]
    print(f"stages: {stages}; parameters per stage: {psi}", file=sys.stderr)
    res = {s: measure(s, plans.get(s, plans["ours"]), stages, args.batch, args.microbatches,
                      args.steps) for s in args.systems}
    report(res, psi, args)


def _region(param: str) -> str:
    """`blocks.3.fc.weight` -> `layer.3`; the embeddings -> `embed`; the rest -> `head`."""
    if param.startswith("blocks."):
        return "layer." + param.split(".")[1]
    return "embed" if param.startswith(("tok.", "pos.")) else "head"


def _worst(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured step (warm-up dropped) with the highest peak."""
    return max(rows[1:] or rows, key=lambda r: r["peak"])


def _state(w: dict[str, Any]) -> int:
    return sum(w["split"][c] for c in CATEGORIES)


def report(res: dict[str, dict[int, list[dict[str, Any]]]], psi: list[int],
           args: argparse.Namespace) -> None:
    losses = {s: [round(sum(rows[k]["loss"] for rows in by_rank.values()
                            if rows[k].get("loss") is not None), 6) for k in range(args.steps)]
              for s, by_rank in res.items()}
    print(f"losses per step: {losses}", file=sys.stderr)
    print("| system | rank | stage: Ψ, 16Ψ/N_d | peak total | params+grads+opt at peak "
          "(sharded state + gathered params + unsharded grads) | other at peak (largest "
          "three) | resident after step | our ledger: peak, model state |")
    print("|---|---|---|---|---|---|---|---|")
    for system, by_rank in res.items():
        for rank, rows in by_rank.items():
            w = _worst(rows)
            sp = w["split"]
            stage = rank // DP
            own = (f"{_mib(w['own_peak'])}, {_mib(w['own_state'])}"
                   if "own_peak" in w else "—")
            print(f"| {system} | {rank} | {stage}: {psi[stage] / 1e6:.2f}M, "
                  f"{_mib(16 * psi[stage] / DP)} | **{_mib(w['peak'])}** | {_mib(_state(w))} ("
                  + " + ".join(_mib(sp[c]) for c in CATEGORIES)
                  + f") | {_mib(sp['other'])} ("
                  + ", ".join(_mib(n) for n in w["top_other"])
                  + f") | {_mib(w['resident'])} | {own} |")
    print("\n| ours / torch | rank 0 | rank 1 | rank 2 | rank 3 | max over ranks |")
    print("|---|---|---|---|---|---|")
    for a in (s for s in res if s.startswith("ours")):
        for b in (s for s in res if s.startswith("torch")):
            for what, f in (("peak total", lambda w: w["peak"]), ("params+grads+opt", _state)):
                xa = [f(_worst(res[a][r])) for r in range(WORLD)]
                xb = [f(_worst(res[b][r])) for r in range(WORLD)]
                cells = " | ".join(f"{x / y:.3f}" for x, y in zip(xa, xb))
                print(f"| {what}, {a} / {b} | {cells} | {max(xa) / max(xb):.3f} |")


if __name__ == "__main__":
    main()
