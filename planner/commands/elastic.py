"""`run --elastic`: training that outlives the cluster changing under it.

When a node is lost (or a rank hangs), the run does not stop: it plans a strategy for the
devices the cluster has left (the search, bounded by `--replan-budget`; the best trial of
an earlier re-plan for that device count when one exists), starts workers there, loads the
newest checkpoint into the new layout (checkpoints reshard) and goes on from its step at the
same global batch, so gradient accumulation grows and the losses stay those of one device.
When nodes join, it plans upward (up to the devices first asked for) at the next checkpoint.
Each change is a line on stderr, a record in `metrics.jsonl` and a TensorBoard text event.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from piper.errors import PiperError
from piper.program import Program

GONE_S = 90.0
"""How long Ray gets to mark a lost node dead (its health checks: about 30 s by default)
before the devices left are counted."""
REPLAN_TRIALS = 64
"""Trials a re-plan may use; `--replan-budget` bounds its time."""


@dataclass(frozen=True)
class Change:
    """One re-plan: why, from which step, and the strategies before and after."""

    why: str  # "node 10.0.0.2 lost", "rank 1 hung", "1 node joined"
    step: int  # training goes on after this (checkpointed) step
    lost_steps: int  # steps trained since that checkpoint, trained again
    old_gpus: int
    new_gpus: int
    old: dict[str, Any]  # strategy summaries
    new: dict[str, Any]
    old_s: float | None  # predicted step times (s)
    new_s: float | None

    def line(self) -> str:
        from planner.report.tables import summary_line

        def pred(s: float | None) -> str:
            return f" (predicted {s * 1e3:,.1f} ms/step)" if s else ""

        return (f"elastic: {self.why} after step {self.step + self.lost_steps}: from the "
                f"checkpoint of step {self.step} ({self.lost_steps} step"
                f"{'' if self.lost_steps == 1 else 's'} lost) on "
                f"{self.new_gpus} devices, was {self.old_gpus}: {summary_line(self.new)}"
                f"{pred(self.new_s)}; before: {summary_line(self.old)}{pred(self.old_s)}")

    def record(self) -> dict[str, Any]:
        return {"event": "replan", **asdict(self)}


def check_elastic(args: argparse.Namespace) -> None:
    """What `--elastic` needs, refused as bad input before anything starts."""
    if not args.elastic:
        if args.replan_budget is not None:
            raise PiperError("--replan-budget bounds --elastic's re-planning: add --elastic")
        return
    if args.launcher != "ray":
        raise PiperError(f"--elastic re-plans over a Ray cluster's nodes; --launcher "
                         f"{args.launcher} leaves node loss to its launcher")
    if not args.checkpoint_dir or not args.checkpoint_every:
        raise PiperError("--elastic goes on from the newest checkpoint: it needs "
                         "--checkpoint-dir and --checkpoint-every")
    if getattr(args, "capacity_factor", None):
        raise PiperError("--elastic re-plans by searching, which does not choose an expert "
                         "capacity factor: drop --capacity-factor or --elastic")
    if args.replan_budget is not None and not args.replan_budget > 0:
        raise PiperError(f"--replan-budget must be > 0, got {args.replan_budget:g}")


def alive_nodes() -> dict[str, dict[str, float]]:
    """Alive nodes of the joined Ray cluster: IP address -> resources."""
    import ray

    return {n["NodeManagerAddress"]: n.get("Resources", {}) for n in ray.nodes()
            if n.get("Alive")}


def wait_gone(nodes: tuple[str, ...], timeout: float = GONE_S) -> None:
    """Until Ray no longer counts `nodes` alive (bounded: a node it still counts after
    `timeout` is counted as it says)."""
    end = time.monotonic() + timeout
    while set(nodes) & set(alive_nodes()) and time.monotonic() < end:
        time.sleep(1.0)


def devices_left(device: str, per_node: int | None) -> int:
    """Devices the cluster has now: each alive node's GPUs (CPU ranks: `per_node` per node
    with a CPU, else its CPUs)."""
    key = "GPU" if device == "cuda" else "CPU"
    total = 0
    for res in alive_nodes().values():
        have = int(res.get(key, 0))
        if have >= 1:
            total += min(have, per_node) if per_node else have
    return total


def replan(ev: Any, *, budget: float, seed: int, store: Path
           ) -> tuple[Program, float] | None:
    """The best strategy for the evaluator's devices and global batch, by a search bounded
    by `budget` seconds (the study of `store` keeps each device count's trials, so a count
    seen before reuses them), with its predicted step time; None if nothing fits."""
    from planner.search.loop import run_search
    from planner.search.space import search_space

    space, _ = search_space(ev, ev.cluster.gpus_per_node)
    if not space.points():
        return None
    result = run_search(ev, space, trials=REPLAN_TRIALS, timeout=budget, sampler="tpe",
                        storage=f"sqlite:///{store.resolve()}", study_name=f"gpus-{ev.gpus}",
                        seed=seed, progress=False)
    if result.best is None:
        return None
    return result.best.program, result.best.predicted["step_time_s"]


def planning_cluster(device: str, per_node: int | None) -> Any:
    """The catalog cluster an elastic run plans for: this machine's CPUs, or the default
    GPU cluster, with `--gpus-per-node`."""
    from cost_models.catalog import CATALOG
    from planner.commands.common import DEFAULT_CLUSTER, with_gpus_per_node

    return with_gpus_per_node(CATALOG["cpu" if device == "cpu" else DEFAULT_CLUSTER],
                              per_node)


def predicted_step(spec: Any, program: Program, gpus: int, batch: int, device: str,
                   per_node: int | None, precision: str) -> float | None:
    """The predicted step time of the strategy an elastic run starts with, priced as its
    re-plans are (None where it cannot be simulated)."""
    from planner.search.evaluate import Evaluator

    try:
        ev = Evaluator(spec, gpus, batch, planning_cluster(device, per_node),
                       precision=precision)
        return ev.evaluate(program).prediction.step_time_s
    except (PiperError, ValueError):
        return None


def fewer(gpus: int) -> list[int]:
    """Device counts to try, most first: `gpus`, then each smaller one down to 1."""
    return list(range(gpus, 0, -1))


class Grown(Exception):
    """More devices joined than the run has: plan upward from the checkpoint just saved."""

    def __init__(self, why: str, devices: int) -> None:
        super().__init__(why)
        self.why = why
        self.devices = devices


def grown(args: argparse.Namespace, device: str, gpus: int) -> None:
    """`Grown` if the cluster now has more devices than the run's `gpus`, and the run
    has fewer than it first asked for."""
    if gpus >= args.gpus:
        return
    have = min(args.gpus, devices_left(device, args.gpus_per_node))
    if have > gpus:
        raise Grown(f"{have - gpus} devices joined", have)


class Replanned(NamedTuple):
    gpus: int
    program: Program
    plan: Any
    done: int  # the checkpoint's step
    folder: Path
    change: Change


def replanned(args: argparse.Namespace, spec: Any, batch: int, device: str, precision: str,
              failure: Exception, gpus: int, summary: dict[str, Any], nodes: tuple[str, ...],
              last_step: int, predicted_s: float | None) -> Replanned:
    """After `failure` (a lost node, a hang) or `Grown`, the strategy for the devices the
    run has now, and the newest checkpoint to go on from. A failure `--elastic` cannot get
    past is re-raised as it came (exit 3)."""
    from planner.commands.common import log
    from planner.search.evaluate import Evaluator
    from runtime.lowering.lower import lower
    from runtime.train import checkpoint

    lost: tuple[str, ...] = getattr(failure, "lost", ())
    if isinstance(failure, Grown):
        why, have = failure.why, failure.devices
    elif lost:
        log(f"elastic: {failure}")
        wait_gone(lost)
        why = f"node{'s' if len(lost) > 1 else ''} {', '.join(lost)} lost"
        # the job's own ranks on the nodes left (their devices are known to work)
        have = (sum(1 for n in nodes if n not in lost) if nodes
                else min(gpus, devices_left(device, args.gpus_per_node)))
    else:  # a hang: the same devices, fresh workers
        log(f"elastic: {failure}")
        why, have = "a hang", gpus
    folder = checkpoint.latest(args.checkpoint_dir)
    if folder is None:
        raise failure if not isinstance(failure, Grown) else PiperError(str(failure))
    done = int(checkpoint.info(folder)["step"])
    cluster = planning_cluster(device, args.gpus_per_node)
    budget = args.replan_budget or 60.0
    store = Path(args.checkpoint_dir) / "replan.db"
    base = Evaluator(spec, have, batch, cluster, precision=precision)  # one capture
    for n in fewer(have):
        found = replan(base.on(cluster, n, batch), budget=budget, seed=args.seed, store=store)
        if found is not None:
            break
    else:
        raise failure
    program, new_s = found
    change = Change(why, done, max(0, last_step - done), gpus, n, summary, program.summary(),
                    predicted_s, new_s)
    log(change.line())
    return Replanned(n, program, lower(spec, program, n, batch), done, folder, change)


LLAMA3_FAILURES = (419, 54 * 86400.0, 16384)
"""Meta's Llama 3 405B training: 419 unexpected interruptions in 54 days on 16,384 GPUs
(The Llama 3 Herd of Models, 2024, section 3.3.4): a device-seconds rate of failure."""


def checkpoint_advice(save_s: float, step_s: float, devices: int, every: int) -> str:
    """Young/Daly's checkpoint interval sqrt(2 C M) for a checkpoint costing `save_s` (C)
    and a mean time between failures M of `devices` devices at Meta's rate, in steps of
    `step_s`, against the run's `every`."""
    failures, seconds, gpus = LLAMA3_FAILURES
    mtbf = seconds * gpus / (failures * devices)
    interval = (2 * save_s * mtbf) ** 0.5
    steps = max(1, round(interval / step_s))
    return (f"elastic: a checkpoint takes {save_s:.2f} s and a step {step_s:.3f} s; at Meta's "
            f"Llama 3 failure rate {devices} devices fail every {mtbf / 3600:,.0f} h on "
            f"average, so Young/Daly's interval sqrt(2 x checkpoint x MTBF) is "
            f"{interval:,.0f} s: --checkpoint-every {steps} (now {every})")
