"""Memory: ZeRO's model-state formulas (Rajbhandari et al. 2020) and activation bytes measured
with autograd's saved-tensor hooks on meta tensors, with and without recompute."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import piper
from cost_models import ModelCosts, model_costs
from cost_models.memory import activation_bytes, static_bytes, zero_bytes_per_param
from piper import schedules
from piper.model_file import load_model_file
from piper.sharding import ModelSharding
from runtime.lowering.plan import Plan
from runtime.lowering.scheduler import schedule
from tests.conftest import ROOT

SKIP_MLP = str(ROOT / "tests" / "models" / "skip_mlp.py")


@pytest.mark.parametrize("replicas", [1, 2, 8, 64])
def test_zero_model_state_per_parameter_follows_the_paper(replicas: int) -> None:
    # the paper's mixed-precision accounting: fp16 params and grads (2 + 2 bytes) and K = 12
    # bytes of fp32 optimizer state -> (2+2+K), 2+2+K/N, 2+(2+K)/N, (2+2+K)/N; here the
    # optimizer state is AdamW's two fp32 moments (8 bytes) and the master copy is the model.
    n = replicas
    assert zero_bytes_per_param(4, 0, n) == 16
    assert zero_bytes_per_param(4, 1, n) == pytest.approx(4 + 4 + 8 / n)
    assert zero_bytes_per_param(4, 2, n) == pytest.approx(4 + (4 + 8) / n)
    assert zero_bytes_per_param(4, 3, n) == pytest.approx(16 / n)
    assert zero_bytes_per_param(2, 3, n) == pytest.approx((2 + 2 + 8) / n)


def test_zero_3_static_bytes_are_16_psi_over_n_per_rank(costs: ModelCosts,
                                                        captured: piper.Captured) -> None:
    dag0 = piper.single_device_dag(captured.graph)
    stages = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]
    plan = schedule(schedules.one_f_one_b(stages, microbatches=4, dp=2, zero=3).apply(dag0))
    for rp, got in zip(plan.ranks, static_bytes(plan, costs), strict=True):
        psi = sum(costs.params_of(plan.stage_regions[s]) for s in rp.stages)
        assert got == round(16 * psi / 2)


def test_saved_bytes_match_a_hand_count_of_what_autograd_keeps() -> None:
    b = 4
    c = model_costs(piper.capture(load_model_file(SKIP_MLP), b))
    f32 = 4
    # embed: Linear(8,16) keeps its input x, tanh keeps its output
    # layer: Linear(16,16) keeps its input, tanh its output; head: Linear keeps h + h0, and
    # until backward the output stage holds the logits and what cross-entropy keeps: the
    # log-softmax, the int64 targets and a total-weight scalar
    tail = b * 5 * f32 + b * 5 * f32 + b * 8 + f32
    assert dict(zip(c.regions, c.activation_bytes, strict=True)) == {
        "embed": b * (8 + 16) * f32, "layer.0": b * 32 * f32, "layer.1": b * 32 * f32,
        "head": b * 16 * f32 + tail}
    # recompute keeps only the region's inputs: x; h0; h; and both h and the skipped h0 (and
    # the loss, which runs outside the stage)
    assert dict(zip(c.regions, c.recompute_bytes, strict=True)) == {
        "embed": b * 8 * f32, "layer.0": b * 16 * f32, "layer.1": b * 16 * f32,
        "head": b * 32 * f32 + tail}


def test_saved_bytes_on_meta_equal_eager_autograd_on_real_tensors(costs: ModelCosts) -> None:
    spec = load_model_file(str(ROOT / "examples" / "gpt.py"), (("size", "tiny"),))
    torch.manual_seed(0)
    block = spec.build().blocks[0]
    x = torch.randn(costs.batch, 16, 32, requires_grad=True)
    params = {p.untyped_storage()._cdata for p in block.parameters()}
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in params:
            packed[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    assert costs.activation_bytes[costs.regions.index("layer.0")] == sum(packed.values())


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True), (4, True)])
def test_a_layer_keeps_what_korthikanti_counts(tp: int, sp: bool) -> None:
    """Korthikanti et al. 2022 (2205.05198), eq. 1-4 with flash attention (no s² terms):
    bytes per layer at 16 bits are s·b·h·(10 + 24/t) with tensor parallelism, 34·s·b·h/t
    with sequence parallelism too (each linear keeps its input's slice, `runtime.execute.regather`),
    less the two 1-byte dropout masks this GPT does not have (s·b·h, or s·b·h/t with SP);
    full recompute keeps the layer's input, 2·s·b·h (/t with SP)."""
    spec = load_model_file(str(ROOT / "examples" / "gpt.py"), (("size", "mini"),))
    b, s, h = 2, 64, 256
    sharding = ModelSharding(tp=tp, tp_plan=spec.tp_plan, sp=sp) if tp > 1 else None
    c = model_costs(piper.capture(spec, b, sharding))
    layer = c.regions.index("layer.1")
    half = 2 / 4  # captured in fp32, counted at 16 bits
    formula = 32 / tp if sp else 8 + 24 / tp
    assert c.activation_bytes[layer] * half / (s * b * h) == pytest.approx(formula, rel=0.01)
    kept = 2 / tp if sp else 2
    assert c.recompute_bytes[layer] * half / (s * b * h) == pytest.approx(kept, rel=0.01)


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)])
def test_a_llama_layer_keeps_what_korthikanti_counts(tp: int, sp: bool) -> None:
    """Korthikanti et al.'s accounting for a Llama layer (RMSNorm, GQA, SwiGLU, flash
    attention, no dropout) with fused kernels, in 16-bit s·b·h: each norm keeps its input (2),
    each projection its input (2), attention q, k, v and its output (2 + 4·kv/heads + 2), the
    gated MLP its gate, up and their product (6·ffn/h). Under TP the norms' inputs and the
    projections' inputs stay whole (8) and the rest is split; SP splits all of it."""
    spec = load_model_file(str(ROOT / "examples" / "llama.py"),
                           (("size", "tiny"), ("dim", 256), ("heads", 8), ("kv_heads", 2),
                            ("ffn", 704), ("seq", 64)))
    b, s, h = 2, 64, 256
    sharding = ModelSharding(tp=tp, tp_plan=spec.tp_plan, sp=sp) if tp > 1 else None
    c = model_costs(piper.capture(spec, b, sharding))
    split = 4 + 4 * 2 / 8 + 6 * 704 / h
    formula = (8 + split) / tp if sp else 8 + split / tp
    got = c.activation_bytes[c.regions.index("layer.1")] * 2 / 4 / (s * b * h)
    assert got == pytest.approx(formula, rel=0.03)


def test_recompute_keeps_far_less_per_microbatch(make_plan: Callable[..., Plan],
                                                 costs: ModelCosts) -> None:
    plan = make_plan("1f1b", pp=2, microbatches=4)
    full = activation_bytes(plan, costs, 4)
    kept = activation_bytes(plan, costs, 4, recompute=True)
    # the output stage keeps the logits and the loss's log-softmax either way
    out = plan.output_stage
    assert all(0 < k < f / 5 for s, (k, f) in enumerate(zip(kept, full, strict=True))
               if s != out)
    assert 0 < kept[out] < full[out]


def test_zero_units_hold_two_units_of_a_microbatch_gradient(make_plan: Callable[..., Plan],
                                                            costs: ModelCosts) -> None:
    from cost_models.memory import StageMemory
    from runtime.execute.buckets import early_reduce_scatters

    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2, zero=3, bucket_mb=0.01)
    early = early_reduce_scatters(plan)
    assert early == frozenset({0, 1})
    whole = StageMemory.of(plan.stage_regions, costs, 4, 3, ())
    units = StageMemory.of(plan.stage_regions, costs, 4, 3, (), plan.bucket_bytes, early)
    for s, regions in enumerate(plan.stage_regions):
        full = costs.element_size * costs.params_of(regions)
        unit = max(plan.bucket_bytes, costs.element_size * costs.largest_param_of(regions))
        assert whole.grad_buf[s] == full
        assert units.grad_buf[s] == min(full, 2 * unit) < full
    # split backward (zb1p): W makes the gradients after autograd, so they wait whole
    zb = make_plan("zb1p", pp=2, microbatches=4, dp=2, zero=3, bucket_mb=0.01)
    assert early_reduce_scatters(zb) == frozenset()


@pytest.mark.parametrize(("zero", "recompute"), [(0, False), (1, False), (2, True),
                                                 (3, False)])
def test_the_peak_breaks_down_into_state_activations_and_buffers(
        make_plan: Callable[..., Plan], costs: ModelCosts, ideal_cluster, zero: int,
        recompute: bool) -> None:
    import dataclasses

    from cost_models import simulate
    from cost_models.memory import memory_parts

    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2, zero=zero)
    if recompute:
        plan = dataclasses.replace(plan, recompute=frozenset({0, 1}))
    pred = simulate(plan, costs, ideal_cluster(), 2)
    parts = memory_parts(plan, costs, 2, pred.spans)
    assert tuple(p.total for p in parts) == pred.peak_memory_bytes
    stage0 = costs.params_of(plan.stage_regions[0])
    e, n = costs.element_size, plan.dp
    first = parts[0]
    assert first.gradients == round(e * stage0 / (n if zero >= 2 else 1))
    assert first.optimizer == round(costs.optimizer_bytes * stage0 / (n if zero else 1))
    assert abs(first.weights - e * stage0 / (n if zero == 3 else 1)) <= 2
    assert first.activations > 0
    assert (first.temporaries > 0) == (zero == 3 or recompute)
    assert first.line().startswith("weights ") and first.line().endswith(" KiB)")
