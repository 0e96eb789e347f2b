"""The cost models price the precision a strategy trains in (`run --precision`): bf16-mixed
matmuls at the bf16 rate, bf16 activations and messages, fp32 master state; ZeRO-3 gathers
bf16 copies; bf16 holds everything in bf16."""

from __future__ import annotations

import argparse

import pytest

from cost_models import CATALOG
from cost_models.analytical import with_precision
from cost_models.memory import bytes_per_param
from cost_models.task_costs import gathered_element_size
from piper.model_file import load_model_file, parse_model_args
from planner.search.evaluate import Evaluator
from planner.search.strategy import shorthand_program
from tests.conftest import GPT


@pytest.fixture(scope="module")
def spec():
    return load_model_file(GPT, parse_model_args(["size=small"]))


def _predict(spec, precision: str, zero: int):
    ev = Evaluator(spec, 8, 32, CATALOG["h100-80gb"], precision=precision)
    ns = argparse.Namespace(pp=2, dp=4, tp=None, ep=None, zero=zero, schedule="1f1b",
                            microbatches=4, virtual_stages=None, recompute=False,
                            comm_stream=False, bucket_mb=None)
    g = ev.graph
    prog = shorthand_program(ns, 8, g.names, ev.region_costs(), g.expert_regions)
    return ev, ev.evaluate(prog).prediction


def test_bf16_mixed_halves_activations_and_keeps_fp32_master_state(spec):
    ev = Evaluator(spec, 8, 32, CATALOG["h100-80gb"])
    fp32 = ev.costs
    mixed = with_precision(fp32, "bf16-mixed")
    assert mixed.activation_bytes == tuple(b // 2 for b in fp32.activation_bytes)
    assert all(g.low_precision for groups in mixed.ops for g in groups if g.flops)
    assert bytes_per_param(mixed) == bytes_per_param(fp32) == 16
    assert gathered_element_size(mixed, 3) == gathered_element_size(mixed, 1) == 2
    assert gathered_element_size(mixed, 0) == 4
    pure = with_precision(fp32, "bf16")
    assert bytes_per_param(pure) == 2 + 2 + 4
    assert with_precision(fp32, "fp32") is fp32


def test_bf16_mixed_is_faster_and_smaller_on_a_gpu_cluster(spec):
    _, fp32 = _predict(spec, "fp32", 3)
    _, mixed = _predict(spec, "bf16-mixed", 3)
    assert mixed.step_time_s < fp32.step_time_s / 3, "bf16 tensor cores vs fp32 CUDA cores"
    assert max(mixed.peak_memory_bytes) < max(fp32.peak_memory_bytes)
    # MFU is against the bf16 peak: it stays a fraction, not 15x the fp32 one
    assert 0 < mixed.mfu < 1


def test_bf16_mixed_at_zero0_holds_one_cast_of_the_matmul_weights(spec):
    """ZeRO-0's fp32 parameters are cast to bf16 once a step for the matmuls that read them
    (`ChunkMath.step_casts`): the weights part grows by 2 bytes per such element; ZeRO-1/2
    keep bf16 weights and no cast (`state_split`)."""
    import torch

    from cost_models.memory import cast_bytes, state_split

    ev = Evaluator(spec, 8, 32, CATALOG["h100-80gb"])
    mixed = with_precision(ev.costs, "bf16-mixed")
    linears = [m for m in spec.build().modules() if isinstance(m, torch.nn.Linear)]
    matmul = sum(p.numel() for m in linears for p in m.parameters())  # biases too
    assert sum(mixed.cast_params) == matmul
    regions = mixed.regions
    assert cast_bytes(mixed, regions, 0) == 2 * matmul
    assert cast_bytes(mixed, regions, 1) == cast_bytes(ev.costs, regions, 0) == 0
    assert state_split(mixed, 1, 4) == (2, 4, 12 / 4)
    assert state_split(mixed, 0, 4) == state_split(ev.costs, 0, 4) == (4, 4, 8)
