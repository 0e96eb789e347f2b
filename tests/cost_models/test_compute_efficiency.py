"""Compute time op by op: efficiency by matmul size and dtype, per-op and per-task overheads,
and optimizer steps priced per parameter tensor."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cost_models import ClusterSpec, ModelCosts, task_costs
from cost_models.analytical import BACKWARD_FLOPS_RATIO, UPDATE_BYTES_PER_PARAM
from cost_models.attention import ATTENTION_BACKWARD_RATIO
from piper.dag import Kind
from piper.errors import PiperError
from runtime.lowering.plan import Plan


def test_matmul_rate_is_half_of_peak_at_the_half_size_and_saturates(
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    c = ideal_cluster(flops=1e12, compute_efficiency=0.8, matmul_half_flops=1e6)
    assert c.matmul_rate(1e6) == pytest.approx(0.4e12)
    assert c.matmul_rate(1e12) == pytest.approx(0.8e12, rel=1e-5)
    assert c.matmul_rate(1e3) < c.matmul_rate(1e6) < c.matmul_rate(1e9)
    flat = ideal_cluster(flops=1e12, compute_efficiency=0.8)
    assert flat.matmul_rate(1e3) == flat.matmul_rate(1e12) == pytest.approx(0.8e12)


def test_a_matmul_is_bound_by_its_math_or_the_bytes_it_streams_and_slowed_near_both(
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    c = ideal_cluster(flops=1e12, compute_efficiency=0.5, elementwise_bandwidth=1e9)
    # wide operands: the math alone (0.5 TF/s); thin ones: the bytes alone (1 GB/s)
    assert c.matmul_seconds(1e12, 1e3) == pytest.approx(2.0, rel=1e-6)
    assert c.matmul_seconds(1e3, 1e9) == pytest.approx(1.0, rel=1e-6)
    # at the ridge point, neither bound is reached: sqrt(2) times either
    assert c.matmul_seconds(1e12, 2e9) == pytest.approx(2.0 * 2 ** 0.5)
    assert c.matmul_seconds(1e12, 2e9) > c.matmul_seconds(1e12, 1e9) > 2.0
    # a spec without a streaming rate (a profiled CPU) times the math alone
    cpu = ideal_cluster(flops=1e12, compute_efficiency=0.5)
    assert cpu.matmul_seconds(1e12, 1e12) == pytest.approx(2.0)


def test_a_fused_attention_runs_at_its_own_share_of_the_peak(
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    c = ideal_cluster(flops=1e12, bf16_flops=4e12, compute_efficiency=0.8,
                      attention_efficiency=0.4)
    for keys, causal, backward in ((512, False, False), (1 << 20, True, True)):
        assert c.attention_seconds(1e12, 0, keys, causal, backward) == pytest.approx(1 / 0.4)
    assert c.attention_seconds(4e12, 0, 512, True, False, True) == pytest.approx(1 / 0.4)
    assert c.matmul_seconds(1e12, 0) == pytest.approx(1 / 0.8)
    # without a figure of its own, attention runs as any matmul
    plain = ideal_cluster(flops=1e12, compute_efficiency=0.8)
    assert plain.attention_seconds(1e12, 0, 512, True, False) == pytest.approx(1 / 0.8)
    with pytest.raises(PiperError, match="attention_efficiency"):
        ideal_cluster(attention_efficiency=1.5)


def test_16_bit_matmuls_run_at_the_16_bit_peak(ideal_cluster: Callable[..., ClusterSpec]
                                               ) -> None:
    c = ideal_cluster(flops=67e12, bf16_flops=989e12, compute_efficiency=0.5)
    assert c.matmul_rate(1e12, low_precision=True) == pytest.approx(494.5e12)
    assert c.matmul_rate(1e12) == pytest.approx(33.5e12)
    assert ideal_cluster(flops=5.0).peak_flops(low_precision=True) == 5.0  # no bf16 figure


def test_chunk_time_is_matmuls_on_the_curve_plus_an_overhead_per_other_op(
        costs: ModelCosts, ideal_cluster: Callable[..., ClusterSpec]) -> None:
    c = ideal_cluster(flops=1e9, matmul_half_flops=2e5, op_overhead_s=1e-5,
                      backward_op_overhead_s=3e-5)
    groups = costs.ops[costs.regions.index("layer.0")]
    samples = 4 * costs.batch
    # each matmul at its size's rate (a causal attention: the share its kernel runs)
    each = [(g, g.count * g.flops * g.work * 4
             / (1e9 * g.flops * g.work * 4 / (g.flops * g.work * 4 + 2e5)))
            for g in groups if g.flops]
    mm = sum(t for _, t in each)
    others = sum(g.count for g in groups if not g.flops)
    assert mm > 0 and others > 0
    fwd, bwd = costs.chunk_seconds(["layer.0"], samples, c)
    assert fwd == pytest.approx(mm + others * 1e-5)
    # the fused attention's backward recomputes its scores: 2.5 forwards, the rest 2
    assert bwd == pytest.approx(sum(
        t * (ATTENTION_BACKWARD_RATIO if g.attention else BACKWARD_FLOPS_RATIO)
        for g, t in each) + others * 3e-5)


def test_small_matmuls_cost_more_per_flop(costs: ModelCosts,
                                          ideal_cluster: Callable[..., ClusterSpec]) -> None:
    c = ideal_cluster(flops=1e9, matmul_half_flops=1e6)
    one, _ = costs.chunk_seconds(["layer.0"], costs.batch, c)
    eight, _ = costs.chunk_seconds(["layer.0"], 8 * costs.batch, c)
    assert one < eight < 8 * one


def test_without_op_records_time_is_total_flops_over_effective_rate(
        costs: ModelCosts, ideal_cluster: Callable[..., ClusterSpec]) -> None:
    import dataclasses

    c = ideal_cluster(flops=1e9, compute_efficiency=0.5, op_overhead_s=1.0)
    bare = dataclasses.replace(costs, ops=())
    fwd, bwd = bare.chunk_seconds(["layer.0", "head"], 3, c)
    assert fwd == pytest.approx(bare.forward_flops_of(["layer.0", "head"], 3) / 0.5e9)
    assert bwd == pytest.approx(BACKWARD_FLOPS_RATIO * fwd)


def _task(plan: Plan, rank: int, kind: Kind):
    return next(t for t in plan.ranks[rank].tasks if t.kind is kind)


@pytest.mark.parametrize("zero", [0, 1])
def test_updates_cost_per_parameter_tensor_plus_bytes_over_bandwidth(
        make_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec], zero: int) -> None:
    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2)
    if zero:
        import dataclasses
        plan = dataclasses.replace(plan, zero=zero)
    c = ideal_cluster(memory_bandwidth=1e10, optimizer_tensor_overhead_s=5e-5,
                      task_overhead_s=1e-4)
    tc = task_costs(plan, costs, c, 2)
    regions = plan.stage_regions[0]
    tensors = 1 if zero else sum(costs.param_tensors[costs.regions.index(r)] for r in regions)
    shards = 2 if zero else 1
    expected = (tensors * 5e-5
                + UPDATE_BYTES_PER_PARAM * costs.params_of(regions) / shards / 1e10)
    assert tc.duration(0, _task(plan, 0, Kind.UPDATE)) == pytest.approx(expected + 1e-4)
    fwd = tc.duration(0, _task(plan, 0, Kind.FWD))
    assert fwd == pytest.approx(tc.forward_s[0] + 1e-4)


def test_recompute_repeats_the_forward_inside_the_backward(
        make_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    plan = make_plan("1f1b", pp=2, microbatches=4)
    c = ideal_cluster(flops=1e9)
    plain = task_costs(plan, costs, c, 2)
    again = task_costs(plan, costs, c, 2, recompute=True)
    for s in range(2):
        assert again.backward_s[s] == pytest.approx(plain.backward_s[s] + plain.forward_s[s])
