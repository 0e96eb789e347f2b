"""Fixtures of the runtime tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from runtime.cluster.jobs import free_port


@pytest.fixture
def group():
    """A one-process gloo group in this process: enough to see when collectives start."""
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
