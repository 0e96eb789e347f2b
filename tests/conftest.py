"""Shared fixtures: one Ray instance per test session, tiny models, the repo's paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
TINY = ("--model-arg", "size=tiny")


@pytest.fixture(scope="session")
def ray_session():
    """Workers are Ray actors with num_cpus=0, so two CPUs host any number of ranks."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
    yield ray
    ray.shutdown()
