"""What each rank is doing right now, kept where the driver can read it after the rank died.

A worker that dies (killed, segfault, out of memory) can no longer be asked what it was doing,
so each rank overwrites a small file in place: its pid, the step, and the task each of its
logical streams is running. One `pwrite` per task costs microseconds and survives the process.
The driver reads the file only when something went wrong. Ranks on other machines write on
their own disk; for those the driver says it does not know (`read_progress` returns None).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SLOT = 64  # bytes per line; a line is overwritten in place, never grown
HEADER = 0  # line 0: pid and phase; lines 1.. : one per logical stream


def progress_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}"


class ProgressFile:
    """Worker side: `phase("step 3")`, then `task("compute", "F1.2")` before each task."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pid = os.getpid()
        self.slots: dict[str, int] = {}
        self.phase("started")

    def phase(self, what: str) -> None:
        """A new phase ("setup", "step 3", "after step 3"): the streams' tasks are cleared."""
        for slot in self.slots.values():
            self._write(slot, "")
        self._write(HEADER, f"pid {self.pid} {what}")

    def task(self, stream: str, name: str) -> None:
        slot = self.slots.setdefault(stream, len(self.slots) + 1)  # atomic under the GIL
        self._write(slot, f"{stream} {name}")

    def close(self) -> None:
        os.close(self.fd)

    def _write(self, slot: int, line: str) -> None:
        data = line.encode()[:SLOT - 1].ljust(SLOT - 1) + b"\n"
        os.pwrite(self.fd, data, slot * SLOT)


@dataclass(frozen=True)
class Progress:
    """Driver side: the last thing a rank reported."""

    pid: int
    phase: str  # "setup", "step 3", "after step 3", ...
    tasks: dict[str, str] = field(default_factory=dict)  # stream -> task it last started

    def describe(self) -> str:
        if self.phase.startswith("after"):
            return self.phase
        if not self.tasks:
            return f"during {self.phase}"
        running = ", ".join(f"{t} ({s} stream)" if len(self.tasks) > 1 else t
                            for s, t in self.tasks.items())
        return f"during {self.phase} while running task {running}"


def read_progress(folder: str | Path, rank: int) -> Progress | None:
    """The rank's last report, or None if there is none here (another machine, or too early)."""
    try:
        lines = progress_path(folder, rank).read_text().splitlines()
    except OSError:
        return None
    if not lines or not lines[0].startswith("pid "):
        return None
    _, pid, *phase = lines[0].split()
    tasks = {}
    for line in lines[1:]:
        parts = line.split()
        if len(parts) == 2:
            tasks[parts[0]] = parts[1]
    return Progress(int(pid), " ".join(phase), tasks)
