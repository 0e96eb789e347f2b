"""A fused attention runs at its kernel's measured rate for its key length and mask
(`ClusterSpec.attention_curve`, `cost_models.attention`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest

import piper
from cost_models import CATALOG, ClusterSpec, load_cluster, model_costs, to_toml
from cost_models.attention import ATTENTION_BACKWARD_RATIO, CAUSAL_WORK, attention_seconds
from cost_models.catalog import H100_FLASH_CURVE
from piper.errors import PiperError
from piper.model_file import load_model_file
from piper.sharding import ModelSharding
from tests.conftest import ROOT

CURVE = ((1000.0, 0.2, 0.1, 0.15), (4000.0, 0.4, 0.3, 0.2))


@pytest.fixture
def curved(ideal_cluster: Callable[..., ClusterSpec]) -> ClusterSpec:
    return ideal_cluster(flops=1.0, bf16_flops=2.0, attention_curve=CURVE,
                         attention_efficiency=0.9, sustained_clock=0.5)


def test_the_rate_follows_the_curve_by_keys_and_mask(curved: ClusterSpec) -> None:
    # at a point: forward, causal forward, backward; a causal backward at the backward
    # rate times the causal forward's share of the plain one; the sustained clock on top
    rate = {(False, False): 0.2, (True, False): 0.1, (False, True): 0.15,
            (True, True): 0.15 * 0.1 / 0.2}
    for (causal, backward), share in rate.items():
        assert curved.attention_seconds(1.0, 0, 1000, causal, backward) == pytest.approx(
            1 / (share * 0.5))
    # the 16-bit peak for 16-bit math; flat past both ends (the curve, not the flat figure)
    assert curved.attention_seconds(2.0, 0, 10, False, False, True) == pytest.approx(1 / 0.1)
    assert curved.attention_seconds(1.0, 0, 1e9, False, False) == pytest.approx(1 / 0.2)
    # linear in log(keys): halfway in log between 1000 and 4000 keys is 2000
    assert curved.attention_seconds(1.0, 0, 2000, False, False) == pytest.approx(1 / 0.15)
    # the bytes it moves combine with its math as a matmul's do
    bw = dataclasses.replace(curved, elementwise_bandwidth=1.0)
    assert bw.attention_seconds(1.0, 10.0, 1000, False, False) == pytest.approx(
        math.hypot(10.0, 10.0))


def test_a_bad_curve_is_refused_and_a_good_one_round_trips_through_toml(
        curved: ClusterSpec, ideal_cluster: Callable[..., ClusterSpec], tmp_path: Path) -> None:
    for bad in (((1000.0, 0.2, 0.1),), ((1000.0, 0.2, 0.1, 1.5),),
                ((4000.0, 0.2, 0.1, 0.1), (1000.0, 0.2, 0.1, 0.1))):
        with pytest.raises(PiperError, match="attention_curve"):
            ideal_cluster(attention_curve=bad)
    path = tmp_path / "curved.toml"
    path.write_text(to_toml(curved))
    assert load_cluster(str(path)).attention_curve == CURVE


def test_the_h100_curve_is_the_published_flash_attention_2_one() -> None:
    h100 = CATALOG["h100-80gb"]
    assert h100.attention_curve == H100_FLASH_CURVE
    # FlashAttention-3 paper: FA2 forward at 16K keys 370 TFLOP/s, causal 335, backward 322
    assert [round(x * 989) for x in H100_FLASH_CURVE[-1][1:]] == [370, 335, 322]
    # shorter keys, lower rate; a causal mask lower still, most at short lengths
    short, long = (h100.attention_seconds(1e12, 0, k, True, False) for k in (512, 16384))
    assert short / long == pytest.approx(335 / 191)
    plain = h100.attention_seconds(1e12, 0, 512, False, False)
    assert plain / long == pytest.approx(335 / 309)


def test_a_ring_step_runs_short_kernels_and_only_the_diagonal_is_masked(
        curved: ClusterSpec) -> None:
    fwd, back = attention_seconds(curved, 8.0, CAUSAL_WORK, (4000, 4), 0, False)
    # 4 steps: the diagonal one causal at 4000 keys, the other 3 half blocks unmasked at
    # 2000 and 4000 keys, 4 FLOPs run in all
    assert fwd == pytest.approx(1 / (0.3 * 0.5) + 1.5 / (0.3 * 0.5) + 1.5 / (0.4 * 0.5))
    assert back == pytest.approx(ATTENTION_BACKWARD_RATIO * (
        1 / (0.15 * 0.5) + 1.5 / (0.175 * 0.5) + 1.5 / (0.2 * 0.5)))
    # one kernel over the whole sequence (all-gather form, or no context parallelism)
    one = attention_seconds(curved, 8.0, CAUSAL_WORK, (16000, 1), 0, False)
    assert one[0] == pytest.approx(4 / (0.3 * 0.5))
    # no extent known: the longest length's rate
    assert attention_seconds(curved, 8.0, 1.0, (), 0, False)[0] == pytest.approx(8 / 0.2)


def test_captured_attention_records_its_keys_and_ring_steps() -> None:
    spec = load_model_file(ROOT / "examples" / "llama.py", (("size", "tiny"), ("seq", 64)))
    whole = model_costs(piper.capture(spec, 1))
    ring = model_costs(piper.capture(spec, 1, ModelSharding(cp=4)))
    gather = model_costs(piper.capture(spec, 1, ModelSharding(cp=4, cp_mode="all_gather")))
    for costs, extent in ((whole, (64, 1)), (ring, (16, 4)), (gather, (64, 1))):
        layer = costs.ops[costs.regions.index("layer.0")]
        assert [g.shape for g in layer if g.attention] == [extent]
