"""`run`'s step loop: each step trained, said on stderr, logged, evaluated and checkpointed,
kept across the jobs of an elastic run (`planner.commands.elastic`)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from planner.commands.common import log
from planner.commands.elastic import checkpoint_advice, grown
from runtime.train.training import TrainConfig


@dataclass
class StepLoop:
    args: argparse.Namespace
    train: TrainConfig
    device: str
    info: dict[str, Any]  # what each checkpoint records of the run
    stop: Any  # `StopSignals`
    metrics: Any  # `MetricsLog` or None
    tokens: int  # per step
    flops: float  # per step
    peak: float | None  # the device's FLOP/s
    gpus: int
    predicted: dict[str, Any] | None  # the strategy's predicted step, said beside the first
    progress: Any  # (row, steps, predicted) -> the step's line
    trained: list[Any] = field(default_factory=list)  # the run's steps
    evals: dict[int, float] = field(default_factory=dict)  # step: eval loss after it
    advised: bool = False  # an elastic run's checkpoint interval, said once

    def run(self, job: Any, done: int) -> None:
        """Steps `done + 1` up to --steps (or a stop signal) on `job`; raises `Grown` at a
        checkpoint of an elastic run when more devices joined."""
        args = self.args
        for k in range(done, args.steps):
            s = job.step()
            self.trained.append(s)
            row = {"step": s.step, "loss": s.loss, "grad_norm": s.grad_norm, "lr": s.lr,
                   "time_s": s.time_s, "tokens_per_s": self.tokens / s.time_s,
                   "mfu": (self.flops / s.time_s / (self.peak * self.gpus) if self.peak
                           else None),
                   "peak_memory_bytes": list(s.peak_memory_bytes)}
            if self.train.evaluates_after(s.step, args.steps):
                row["eval_loss"] = self.evals[s.step] = job.evaluate(self.train.eval_steps)
            print(self.progress(row, args.steps, self.predicted), file=sys.stderr, flush=True)
            self.predicted = None  # said once, beside the first step
            if self.metrics:
                self.metrics.write(row)
            last = k + 1 == args.steps or self.stop.signum is not None
            if args.checkpoint_dir and ((args.checkpoint_every and (k + 1) %
                                         args.checkpoint_every == 0) or last):
                self._save(job, s, last)
            if self.stop.signum is not None:
                log(self.stop.said(s.step, args.checkpoint_dir))
                return

    def _save(self, job: Any, s: Any, last: bool) -> None:
        t0 = time.perf_counter()
        path = job.save(self.args.checkpoint_dir, self.info)
        log(f"checkpoint: {path}")
        if not self.args.elastic:
            return
        if not self.advised:
            self.advised = True
            log(checkpoint_advice(time.perf_counter() - t0, s.time_s, self.gpus,
                                  self.args.checkpoint_every))
        if not last:
            grown(self.args, self.device, self.gpus)  # more nodes: plan upward

    def back_to(self, done: int, gpus: int) -> None:
        """Going on from the checkpoint of step `done` on `gpus` devices: the steps after
        it are trained again."""
        self.gpus = gpus
        self.trained = [s for s in self.trained if s.step <= done]
        self.evals = {k: v for k, v in self.evals.items() if k <= done}
