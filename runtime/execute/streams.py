"""Logical streams on a device: what lets communication overlap computation.

Each logical stream of a rank runs in its own host thread (`RankExecutor.step`); host
events order the *issue* of dependent tasks. On CPU that is the whole story: ops run
synchronously in their thread, so gloo collectives on the comm thread overlap math on the
compute thread. On CUDA each logical stream also gets its own `torch.cuda.Stream` (compute
keeps the device's current stream), an event is recorded after every task, and a task that
depends on another stream makes its stream wait on that event — on the device, without
blocking the host. A tensor made on one stream and consumed on another is marked with
`record_stream` so the caching allocator does not hand its memory out early.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


class DeviceStreams:
    def __init__(self, device: torch.device, names: Iterable[str], compute: str) -> None:
        self.cuda = device.type == "cuda"
        self.streams: dict[str, Any] = {}
        self.events: dict[str, Any] = {}
        if self.cuda:
            self.streams = {n: torch.cuda.current_stream(device) if n == compute
                            else torch.cuda.Stream(device) for n in names}

    def start_step(self) -> None:
        self.events = {}

    @contextlib.contextmanager
    def on(self, name: str) -> Iterator[None]:
        """Issue work to logical stream `name` inside this block."""
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.streams[name]):
            yield

    def finished(self, task: str) -> None:
        """Mark `task`'s work, just issued on the current stream, for waits elsewhere."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.events[task] = ev

    def wait_for(self, tasks: Iterable[str]) -> None:
        """Make the current stream wait for `tasks` of other streams (already issued)."""
        if self.cuda:
            for t in tasks:
                torch.cuda.current_stream().wait_event(self.events[t])

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors from another stream used here: keep their memory until this use ends."""
        if self.cuda:
            stream = torch.cuda.current_stream()
            for t in tensors:
                t.record_stream(stream)
