"""GPU cost-model mechanisms, each against the published figure it stands for: GEMM waves
over the SMs, a fixed cost per kernel, NCCL's bus bandwidth by message size, and compute
slowed by the collectives beside it (per fabric)."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models import CATALOG, ClusterSpec, ModelCosts
from cost_models.analytical import OpGroup
from cost_models.catalog import A100_NVLINK_BUSBW, H100_NVLINK_BUSBW, H100_RING_BUSBW
from cost_models.comm import ALL_GATHER, ALL_REDUCE, collective_time
from cost_models.kernels import Gemm, wave_efficiency

A100 = CATALOG["a100-80gb"]
H100 = CATALOG["h100-80gb"]
MB = 2**20


def test_a_gemm_of_two_waves_on_108_sms_runs_at_its_filled_share() -> None:
    # 2048 x 2048 outputs: 128 tiles of 256 x 128 in 2 waves (128 of 216 slots), or 256
    # of 128 x 128 in 3 (256 of 324): the better of the two
    assert wave_efficiency(Gemm(1, 2048, 2048, 4096), 108) == pytest.approx(256 / 324)
    # many waves: the loss vanishes; exactly one full wave: none
    assert wave_efficiency(Gemm(1, 65536, 8192, 4096), 108) > 0.97
    assert wave_efficiency(Gemm(1, 108 * 128, 128, 64), 108) == pytest.approx(1.0)
    assert wave_efficiency(Gemm(1, 2048, 2048, 4096), 0) == 1.0


def test_a_batched_gemm_scales_its_batches_and_a_linear_its_rows() -> None:
    assert Gemm(8, 100, 64, 32).scaled(2) == Gemm(16, 100, 64, 32)
    assert Gemm(1, 100, 64, 32).scaled(0.5) == Gemm(1, 50, 64, 32)
    dx, dw = Gemm(1, 4096, 1024, 512).gradients()
    assert (dx.m, dx.n, dx.k) == (4096, 512, 1024)  # input gradient: M x K, over N
    assert (dw.m, dw.n, dw.k) == (512, 1024, 4096)  # weight gradient: K x N, over M
    assert dx.flops == dw.flops == Gemm(1, 4096, 1024, 512).flops


def _one_gemm(m: int, n: int, k: int) -> ModelCosts:
    """A one-region model whose only op is an (m x k) @ (k x n) bf16 GEMM at batch 1."""
    g = OpGroup(2 * m * n * k, 1, True, 1.0, 2 * (m * k + k * n + m * n), False, (1, m, n, k))
    return ModelCosts(regions=("r",), forward_flops=(g.flops,), activation_bytes=(0,),
                      params=(n * k,), batch=1, tokens_per_sample=m, ops=((g,),))


def test_per_sample_time_falls_with_microbatch_size_while_waves_fill() -> None:
    costs = _one_gemm(2048, 2048, 2048)  # one sample: 79% of the tile slots full
    per_sample = [costs.chunk_seconds(["r"], mb, A100)[0] / mb for mb in (1, 2, 4, 8)]
    assert per_sample == sorted(per_sample, reverse=True)
    assert per_sample[0] / per_sample[-1] > 1.2
    no_waves = dataclasses.replace(A100, sms=0, kernel_overhead_s=0.0)
    flat = [costs.chunk_seconds(["r"], mb, no_waves)[0] / mb for mb in (4, 8)]
    assert flat[0] == pytest.approx(flat[1], rel=0.02)


def test_every_kernel_pays_the_fixed_cost_forward_and_twice_backward() -> None:
    costs = _one_gemm(4096, 4096, 4096)
    base = dataclasses.replace(A100, kernel_overhead_s=0.0)
    f0, b0 = costs.chunk_seconds(["r"], 1, base)
    f1, b1 = costs.chunk_seconds(["r"], 1, dataclasses.replace(base, kernel_overhead_s=1e-5))
    assert (f1 - f0, b1 - b0) == pytest.approx((1e-5, 2e-5))


def test_sustained_clock_slows_math_but_not_bytes() -> None:
    costs = _one_gemm(8192, 8192, 8192)
    slow = dataclasses.replace(A100, sustained_clock=0.5, kernel_overhead_s=0.0)
    fast = dataclasses.replace(A100, sustained_clock=1.0, kernel_overhead_s=0.0)
    ratio = costs.chunk_seconds(["r"], 1, slow)[0] / costs.chunk_seconds(["r"], 1, fast)[0]
    assert 1.9 < ratio <= 2.0


@pytest.mark.parametrize(("cluster", "points"), [(A100, A100_NVLINK_BUSBW),
                                                  (H100, H100_NVLINK_BUSBW)])
def test_an_eight_gpu_all_reduce_reproduces_the_measured_bus_bandwidth(
        cluster: ClusterSpec, points: tuple) -> None:
    for nbytes, busbw in points:
        seconds = collective_time(ALL_REDUCE, nbytes, range(8), cluster)
        assert 2 * 7 / 8 * nbytes / seconds == pytest.approx(busbw, rel=1e-9)
    # between points: log-log interpolation, increasing
    mid = [2 * 7 / 8 * n / collective_time(ALL_REDUCE, n, range(8), cluster)
           for n in (3 * MB, 48 * MB, 512 * MB)]
    assert mid == sorted(mid)


def test_small_collectives_sit_on_the_latency_floor() -> None:
    first = A100_NVLINK_BUSBW[0][0]
    t = collective_time(ALL_REDUCE, first, range(8), A100)
    assert collective_time(ALL_REDUCE, first // 16, range(8), A100) == pytest.approx(t)
    assert t == pytest.approx(43.8e-6)


def test_ring_collectives_stop_at_the_ring_ceiling_where_nvls_lifts_all_reduce() -> None:
    n = 16384 * MB
    ag = collective_time(ALL_GATHER, n, range(8), H100)
    assert 7 / 8 * n / ag == pytest.approx(H100_RING_BUSBW)
    ar8 = collective_time(ALL_REDUCE, n, range(8), H100)
    ar4 = collective_time(ALL_REDUCE, n, range(4), H100)
    assert 2 * 7 / 8 * n / ar8 == pytest.approx(482.3e9)
    assert 2 * 3 / 4 * n / ar4 == pytest.approx(H100_RING_BUSBW)


def test_the_measured_curve_is_slower_than_the_nominal_link_for_mid_sized_messages() -> None:
    nominal = dataclasses.replace(A100, intra_node_busbw=())
    for n in (MB, 16 * MB, 256 * MB):
        assert (collective_time(ALL_REDUCE, n, range(8), A100)
                > collective_time(ALL_REDUCE, n, range(8), nominal))


def test_catalog_gpus_carry_published_sms_curves_and_contention() -> None:
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h100-96gb-500w", "h200"):
        c = CATALOG[name]
        assert c.sms in (108, 132)
        assert c.intra_node_busbw and c.intra_node_ring_busbw
        assert (c.comm_compute_contention, c.inter_node_contention) == (0.15, 0.02)
        assert "nccl-tests" in c.source and "fitted" in c.source


def test_the_loss_streams_the_logits_in_fp32_on_the_output_region(costs: ModelCosts) -> None:
    from cost_models.analytical import with_precision

    head = costs.regions.index("head")
    loss = [g for g in costs.ops[head] if g.fp32]
    vocab_bytes = max(g.nbytes for g in loss)
    # the log-softmax reads and writes the fp32 logits (batch x tokens x vocabulary)
    logits = costs.batch * costs.tokens_per_sample * 4
    assert vocab_bytes % (2 * logits) == 0 and vocab_bytes // (2 * logits) > 8
    assert all(not g.flops for g in loss)
    assert all(not g.fp32 for r in range(len(costs.regions)) if r != head
               for g in costs.ops[r])
    # bf16-mixed halves every other op's bytes, not the loss's (autocast keeps it fp32)
    bf16 = with_precision(costs, "bf16-mixed")
    assert [g.nbytes for g in bf16.ops[head] if g.fp32] == [g.nbytes for g in loss]


def test_small_kernels_wait_for_the_host_to_issue_them() -> None:
    costs = _one_gemm(64, 64, 64)  # a 0.5 MFLOP GEMM: far shorter than its dispatch
    quiet = dataclasses.replace(A100, host_dispatch_s=0.0)
    assert costs.chunk_seconds(["r"], 1, quiet)[0] < 1e-5
    host = dataclasses.replace(A100, host_dispatch_s=1e-4)
    assert costs.chunk_seconds(["r"], 1, host) == pytest.approx((1e-4, 2e-4))
    big = _one_gemm(8192, 8192, 8192)  # the host runs ahead of a long kernel: no cost
    assert big.chunk_seconds(["r"], 1, host) == big.chunk_seconds(["r"], 1, quiet)
