"""What each rank is doing right now, kept where the driver can read it after the rank died.

A worker that dies (killed, out of memory, its node lost) can no longer be asked what it was
doing, so each rank keeps its pid, node, phase and the task each logical stream is running
in memory (one assignment per task), and a thread of its own sends what changed to the job's
`ProgressBoard`, an actor on the driver's node, at most `PUSH_S` later; unchanged, it still
sends every `HEARTBEAT_S`. Everything travels through Ray, so ranks on other hosts report as
local ones do. The driver reads the board only when something went wrong.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

PUSH_S = 0.1  # a report is at most this old
HEARTBEAT_S = 1.0  # an idle rank still reports this often
SILENT_S = 5.0  # a rank not heard from for this long is gone (its process, or its node)
BOARD_PREFIX = "piper-progress-"  # a job's board is a named actor: tools can find it


@dataclass(frozen=True)
class Progress:
    """Driver side: the last thing a rank reported."""

    pid: int
    phase: str  # "setup", "step 3", "after step 3", ...
    tasks: dict[str, str] = field(default_factory=dict)  # stream -> task it last started
    node: str = ""  # the node's IP address
    age_s: float = 0.0  # since the board heard from the rank
    still_s: float = 0.0  # since its phase or a stream's task last changed

    def describe(self) -> str:
        if self.phase.startswith("after"):
            return self.phase
        if not self.tasks:
            return f"during {self.phase}"
        running = ", ".join(f"{t} ({s} stream)" if len(self.tasks) > 1 else t
                            for s, t in self.tasks.items())
        return f"during {self.phase} while running task {running}"

    @property
    def silent(self) -> bool:
        return self.age_s > SILENT_S


class ProgressBoard:
    """The job's reports, one per rank (a Ray actor; `board`)."""

    def __init__(self) -> None:
        self.reports: dict[int, tuple[int, str, dict[str, str], str, float, float]] = {}

    def report(self, rank: int, pid: int, phase: str, tasks: dict[str, str], node: str) -> None:
        now = time.monotonic()
        before = self.reports.get(rank)
        same = before is not None and (before[1], before[2]) == (phase, tasks)
        self.reports[rank] = (pid, phase, tasks, node, now, before[5] if same else now)

    def read(self) -> dict[int, Progress]:
        now = time.monotonic()
        return {r: Progress(pid, phase, tasks, node, now - t, now - changed)
                for r, (pid, phase, tasks, node, t, changed) in self.reports.items()}


def board(name: str | None = None) -> Any:
    """A board on the driver's node (a node lost takes its own ranks, not their reports)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    opts: dict[str, Any] = {"name": name} if name else {}
    if here:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(here, soft=True)
    return ray.remote(num_cpus=0)(ProgressBoard).options(**opts).remote()


def read(board: Any, timeout_s: float = 5.0) -> dict[int, Progress]:
    """The board's reports, or none if it cannot be read in time."""
    import ray

    try:
        return ray.get(board.read.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a report is a nicety of an error message
        return {}


class Reporter:
    """Worker side: `phase("step 3")`, then `task("compute", "F1.2")` before each task.
    Without a board (no Ray: `runtime.cluster.process_job`) it keeps them for `now` alone."""

    def __init__(self, board: Any, rank: int, node: str) -> None:
        self.board, self.rank, self.node = board, rank, node
        self.pid = os.getpid()
        self.tasks: dict[str, str] = {}
        self.what = "started"
        self.version = 0
        self.closed = threading.Event()
        if board is not None:
            threading.Thread(target=self._push, daemon=True, name="piper-progress").start()

    def phase(self, what: str) -> None:
        """A new phase ("setup", "step 3", "after step 3"): the streams' tasks are cleared."""
        self.tasks = {}
        self.what = what
        self.version += 1

    def task(self, stream: str, name: str) -> None:
        self.tasks[stream] = name  # atomic under the GIL, from any stream's thread
        self.version += 1

    def now(self) -> Progress:
        return Progress(self.pid, self.what, self.tasks.copy(), self.node)

    def close(self) -> None:
        self.closed.set()

    def _push(self) -> None:
        sent, last = -1, 0.0
        while not self.closed.wait(PUSH_S):
            now = time.monotonic()
            if self.version != sent or now - last >= HEARTBEAT_S:
                sent, last = self.version, now
                try:
                    self.board.report.remote(self.rank, self.pid, self.what,
                                             self.tasks.copy(), self.node)
                except Exception:  # noqa: BLE001 - Ray going down under a closing worker
                    return
