"""What a driver does with its ranks, whatever started them: step, save, restore, finish.

A job holds one `runtime.cluster.worker.Worker` per rank and calls the same method on all of them,
in order (setup, step*, save/load, shutdown). How a call reaches a rank is the launcher's:
Ray actors (`runtime.cluster.launcher.Job`), or processes spawned here or by torchrun, reached
through torch's TCPStore (`runtime.cluster.process_job.ProcessJob`). Neither this module nor the
process launcher imports Ray.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from dataclasses import dataclass
from typing import Any, Self

from piper.errors import PiperError
from runtime.lowering.dryrun import Span
from runtime.lowering.plan import Plan

GRACE_S = 3.0  # after a first failure, how long the others get to fail too (root cause first)
DEADLINE_SLACK_S = 10.0  # the driver outwaits the process groups' timeout by this much
SETUP_MIN_S = 300.0  # starting worker processes and capturing a big model takes a while
CPU_WORKER_BYTES = 512 * 2**20  # a CPU worker process: torch, Ray, a small model


class RuntimeFailure(Exception):
    """A worker died or timed out (exit code 3); the message names the rank. `lost`: the
    nodes (IP addresses) the failure took out, if it was the loss of whole nodes; `hung`:
    it was a hang (a rank or a step that stopped moving on), not a crash."""

    def __init__(self, message: str, lost: tuple[str, ...] = (), hung: bool = False) -> None:
        super().__init__(message)
        self.lost = lost
        self.hung = hung


@dataclass(frozen=True)
class StepResult:
    step: int  # from 1: the k-th step trained
    loss: float
    time_s: float  # the slowest rank's
    grad_norm: float = float("nan")  # of the whole model's gradient, before clipping
    lr: float = float("nan")
    peak_memory_bytes: tuple[int, ...] = ()  # per rank, so far


@dataclass(frozen=True)
class RunResult:
    steps: tuple[StepResult, ...]
    peak_memory_bytes: tuple[int, ...]
    plan: Plan
    spans: tuple[Span, ...] = ()  # the last step's measured timeline
    model_state_bytes: tuple[int, ...] = ()  # per rank: peak params + grads + optimizer state
    nodes: tuple[str, ...] = ()  # per rank: the IP address of the node it ran on


class Driver:
    """The steps of a job over `call_all(method, what, *args)`, which calls a Worker method
    on every rank and returns their results in rank order (or raises `RuntimeFailure`)."""

    plan: Plan
    done: int
    nodes: tuple[str, ...] = ()

    def _start_steps(self) -> None:
        self.results: list[StepResult] = []
        self.peaks = [0] * self.plan.world_size
        self.outs: list = []

    def call_all(self, method: str, what: str, *args: Any) -> list:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self) -> StepResult:
        """One training step on every rank: the loss summed over the output stage's ranks,
        and the slowest rank's time. Steps count from 1 (step k is the k-th trained, as
        Megatron-LM and torchtitan number them, and a checkpoint after it is step-k)."""
        k = len(self.results) + self.done + 1
        self.outs = self.call_all("step", f"step {k}")
        loss = sum(o.loss_sum for o in self.outs if o.loss_sum is not None)
        lrs = [o.lr for o in self.outs if o.lr == o.lr]  # a rank without parameters: nan
        self.results.append(StepResult(
            k, loss, max(o.time_s for o in self.outs), self.outs[0].grad_norm,
            lrs[0] if lrs else float("nan"), tuple(o.peak_memory_bytes for o in self.outs)))
        self.peaks = [max(p, o.peak_memory_bytes) for p, o in zip(self.peaks, self.outs)]
        return self.results[-1]

    def evaluate(self, batches: int) -> float:
        """The loss on the first `batches` batches of the evaluation data, after the steps
        so far (every rank's forwards; no state changes)."""
        step = len(self.results) + self.done
        outs = self.call_all("evaluate", f"evaluation after step {step}", batches)
        return sum(o for o in outs if o is not None)

    def save(self, root: str, info: dict[str, Any]) -> str:
        """A checkpoint of the steps so far under `root` (`runtime.train.checkpoint`): every rank
        writes its part into a temporary folder, which becomes the latest checkpoint only
        once all have finished."""
        from runtime.train.checkpoint import commit, step_folder

        step = len(self.results) + self.done
        tmp = step_folder(root, step, tmp=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while saving
        self.call_all("save", f"saving step {step}", str(tmp))
        return str(commit(root, step, info))

    def restore(self, folder: str) -> None:
        """Every rank's state from a checkpoint (of any strategy)."""
        self.call_all("load", "loading the checkpoint", folder)

    def finish(self, orderly: bool = True) -> RunResult:
        """Shut the ranks down in order and report every step so far, with the last step's
        timeline. `orderly=False` (a run stopped by a signal, which may have reached the
        cluster's own processes too): no further call to the ranks; closing kills them."""
        if orderly:
            self.call_all("shutdown", "shutdown")
        spans = tuple(Span(r, stream, t, a, b) for r, o in enumerate(self.outs)
                      for stream, t, a, b in o.spans)
        return RunResult(tuple(self.results), tuple(self.peaks), self.plan, spans,
                         tuple(o.model_state_bytes for o in self.outs), self.nodes)


def check_machine(world: int, device: str, more: str) -> None:
    """Refuse `world` ranks this machine cannot host (its GPUs, or its memory for CPU
    worker processes) before anything starts; `more`: where a user finds more."""
    if device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if world > have:
            raise PiperError(f"--gpus {world} needs {world} GPUs; this machine has {have} "
                             f"({more})")
        return
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    most = max(2, ram // CPU_WORKER_BYTES)
    if world > most:
        raise PiperError(f"--gpus {world} on --device cpu starts {world} worker processes of "
                         f"about {CPU_WORKER_BYTES / 2**30:.1f} GiB each; this machine's "
                         f"{ram / 2**30:.0f} GiB holds at most {most} ({more})")


def describe_nodes(nodes: tuple[str, ...]) -> str:
    """'ranks 0-1 on 10.0.0.2, ranks 2-3 on 10.0.0.3' (runs of consecutive ranks)."""
    out: list[str] = []
    start = 0
    for r in range(1, len(nodes) + 1):
        if r == len(nodes) or nodes[r] != nodes[start]:
            ranks = f"rank {start}" if r - start == 1 else f"ranks {start}-{r - 1}"
            out.append(f"{ranks} on {nodes[start]}")
            start = r
    return ", ".join(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reason(err: BaseException) -> str:
    """`Type: message`, the message's last line cut to its first sentence (gloo appends
    advice and a source location to every error)."""
    lines = str(err).strip().splitlines()
    msg = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1].strip() if lines else "")
    msg = msg.split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {msg}" if msg else type(err).__name__


def ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
