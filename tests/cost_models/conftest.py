"""Shared fixtures: the tiny GPT captured once per session, and Plans built from it."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

import piper
from cost_models import ClusterSpec, ModelCosts, model_costs
from piper import schedules
from piper.model_file import load_model_file
from runtime.lowering.plan import Plan
from runtime.lowering.scheduler import schedule

TINY = (("size", "tiny"),)
MICROBATCH = 2

STAGES = {
    2: [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]],
    4: [["embed", "layer.0"], ["layer.1"], ["layer.2"], ["layer.3", "head"]],
}


@pytest.fixture(scope="session")
def captured() -> piper.Captured:
    return piper.capture(load_model_file("examples/gpt.py", TINY), MICROBATCH)


@pytest.fixture(scope="session")
def costs(captured: piper.Captured) -> ModelCosts:
    return model_costs(captured)


@pytest.fixture(scope="session")
def make_plan(captured: piper.Captured) -> Callable[..., Plan]:
    """`make_plan("1f1b", pp=4, microbatches=8, dp=1)`: the scheduled Plan of the tiny GPT
    (optionally with ZeRO, buckets and gradient collectives on a comm stream)."""
    dag0 = piper.single_device_dag(captured.graph)

    def build(name: str, *, pp: int, microbatches: int, dp: int = 1,
              bucket_mb: float | None = None, comm_stream: bool = False, zero: int = 0
              ) -> Plan:
        prog = schedules.build(name, STAGES[pp], microbatches=microbatches, dp=dp, zero=zero)
        prog = schedules.with_buckets(prog, bucket_mb) if bucket_mb else prog
        prog = schedules.with_comm_stream(prog, zero) if comm_stream else prog
        return schedule(prog.apply(dag0))
    return build


@pytest.fixture(scope="session")
def ideal_cluster() -> Callable[..., ClusterSpec]:
    """1 FLOP/s at full efficiency and free, instant links: durations equal FLOP counts."""
    figures: dict = {
        "name": "ideal", "device": "test", "gpus_per_node": 8, "memory_bytes": 2**40,
        "flops": 1.0, "compute_efficiency": 1.0, "intra_node_bandwidth": math.inf,
        "intra_node_latency": 0.0, "inter_node_bandwidth": math.inf, "inter_node_latency": 0.0}

    def build(**changes: object) -> ClusterSpec:
        return ClusterSpec(**(figures | changes))
    return build
