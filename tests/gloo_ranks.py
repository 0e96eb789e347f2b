"""Run a test's worker on `n` spawned processes that form a gloo group (on 127.0.0.1) and
collect what each rank reports."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Callable[..., None], n: int, *args: Any) -> dict[int, Any]:
    """`worker(rank, n, port, *args, out)` on `n` processes; returns `out` (rank -> what the
    rank put there). Every rank must report."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(worker, args=(n, free_port(), *args, out), nprocs=n,
                           start_method="spawn", join=True)
        got = dict(out)
    assert sorted(got) == list(range(n)), f"ranks reporting: {sorted(got)}"
    return got
