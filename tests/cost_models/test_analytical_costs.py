"""FLOPs and bytes per region from the captured graph, and the task durations built on them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

import piper
from cost_models import CATALOG, ClusterSpec, ModelCosts, model_costs, task_costs
from cost_models.analytical import BACKWARD_FLOPS_RATIO, UPDATE_BYTES_PER_PARAM, _causal_attention
from cost_models.attention import ATTENTION_BACKWARD_RATIO, CAUSAL_WORK
from cost_models.comm import p2p_time, ring_all_reduce_time
from piper.dag import Kind
from piper.model_file import load_model_file
from runtime.lowering.plan import Plan, Task

SEQ, DIM = 16, 32  # examples/gpt.py CONFIGS["tiny"]


def test_layers_and_head_cost_flops_and_the_embedding_none(costs: ModelCosts) -> None:
    flops = dict(zip(costs.regions, costs.forward_flops, strict=True))
    assert flops["embed"] == 0  # a lookup, no multiply-adds
    assert all(flops[r] > 0 for r in ("layer.0", "layer.3", "head"))


def test_layer_forward_flops_match_the_dense_transformer_formula(costs: ModelCosts) -> None:
    b, t, d = costs.batch, SEQ, DIM
    linears = 2 * b * t * 12 * d * d  # qkv 3d^2 + proj d^2 + mlp 8d^2, biases excluded
    attention = 2 * (2 * b * t * t * d)  # q @ k^T and att @ v
    layer = costs.forward_flops[costs.regions.index("layer.1")]
    assert layer == pytest.approx(linears + attention, rel=0.01)


def test_a_causal_fused_attention_is_timed_at_half_its_counted_flops(costs: ModelCosts
                                                                     ) -> None:
    b, t, d = costs.batch, SEQ, DIM
    i = costs.regions.index("layer.1")
    attention = [g for g in costs.ops[i] if g.work != 1.0]
    assert [(g.flops, g.work) for g in attention] == [(2 * (2 * b * t * t * d), CAUSAL_WORK)]
    flat = dataclasses.replace(CATALOG["h100-80gb"], matmul_half_flops=0.0, op_overhead_s=0.0,
                               elementwise_bandwidth=None, attention_efficiency=None,
                               attention_curve=(), host_dispatch_s=0.0)
    whole = dataclasses.replace(costs, ops=tuple(
        tuple(dataclasses.replace(g, work=1.0) for g in groups) for groups in costs.ops))
    half, full = (c.chunk_seconds(["layer.1"], b, flat)[0] for c in (costs, whole))
    rate = flat.matmul_rate(1.0)
    assert full - half == pytest.approx(attention[0].flops * (1 - CAUSAL_WORK) / rate)


def test_ops_without_matmul_math_move_their_inputs_and_outputs(costs: ModelCosts) -> None:
    b, t, d = costs.batch, SEQ, DIM
    moved = sorted(g.nbytes for g in costs.ops[costs.regions.index("layer.1")]
                   if not g.flops and g.nbytes)
    act = b * t * d * 4  # one fp32 activation of the residual stream
    def near(n: int) -> bool:  # plus a norm's weights and statistics, a few hundred bytes
        return any(n <= m <= n + 1024 for m in moved)

    assert near(act * 2)  # a layer norm: reads x, writes y
    assert act * 3 in moved  # a residual add: reads two, writes one
    assert act * 8 in moved  # gelu on the 4d-wide MLP: reads and writes 4 x act
    embed = [g.nbytes for g in costs.ops[costs.regions.index("embed")] if g.nbytes]
    assert max(embed) <= 3 * act, "a lookup reads the rows it picks, not the whole table"


def test_only_causal_attention_is_marked(tmp_path) -> None:
    class Attend(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            f = torch.nn.functional.scaled_dot_product_attention
            return f(q, q, q, is_causal=True), f(q, q, q)

    ep = torch.export.export(Attend(), (torch.randn(1, 2, 8, 4),))
    nodes = [n for n in ep.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert [_causal_attention(n) for n in nodes] == [True, False]


def test_flops_and_saved_bytes_scale_linearly_with_batch(costs: ModelCosts) -> None:
    double = model_costs(piper.capture(
        load_model_file("examples/gpt.py", (("size", "tiny"),)), 2 * costs.batch))
    assert double.forward_flops == tuple(2 * f for f in costs.forward_flops)
    layer = costs.regions.index("layer.0")
    # the causal mask does not grow with batch, so bytes are linear only to within it
    assert double.activation_bytes[layer] == pytest.approx(2 * costs.activation_bytes[layer],
                                                           rel=0.01)


def test_params_tokens_and_dtype_come_from_the_capture(captured: piper.Captured,
                                                       costs: ModelCosts) -> None:
    assert costs.regions == captured.graph.names
    assert costs.params == tuple(r.param_numel for r in captured.graph.regions)
    assert costs.batch == captured.graph.batch
    assert costs.tokens_per_sample == SEQ
    assert costs.element_size == 4


def test_saved_bytes_of_a_layer_cover_its_output(captured: piper.Captured,
                                                 costs: ModelCosts) -> None:
    out = max(v.nbytes for v in captured.graph.values if v.region == 1)
    assert costs.activation_bytes[1] > out


def _task(plan: Plan, rank: int, kind: Kind) -> Task:
    return next(t for t in plan.ranks[rank].tasks if t.kind is kind)


def test_compute_durations_are_flops_over_effective_rate(
        make_plan: Callable[..., Plan], costs: ModelCosts) -> None:
    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2)
    # the roofline alone: no SM waves, kernel costs or measured NCCL curves
    c = dataclasses.replace(CATALOG["a100-80gb"], sms=0, kernel_overhead_s=0.0,
                            host_dispatch_s=0.0, sustained_clock=1.0, intra_node_busbw=())
    tc = task_costs(plan, costs, c, microbatch_size=4)
    flops = costs.forward_flops_of(plan.stage_regions[1], 4)
    assert flops == 2 * costs.forward_flops_of(plan.stage_regions[1], costs.batch)
    fwd = tc.duration(2, _task(plan, 2, Kind.FWD))
    groups = [g for r in plan.stage_regions[1] for g in costs.ops[costs.regions.index(r)]]
    # what the kernels run: a causal attention's counted FLOPs at its share
    timed = sum(g.flops * g.work * g.count for g in groups) * 4 / costs.batch
    assert timed < flops
    # each matmul at the rate its math reaches, slowed by the bytes its operands stream;
    # the ops without matmul math stream their bytes at the elementwise bandwidth
    # (a fused attention at the catalog's flash-attention share of the peak)
    bw, scale = c.elementwise_bandwidth, 4 / costs.batch
    rate = {False: c.flops * c.compute_efficiency, True: c.flops * c.attention_efficiency}
    mm = [g.count * math.hypot(g.flops * g.work * scale / rate[g.attention],
                               g.nbytes * scale / bw)
          for g in groups if g.flops]
    assert all(g.nbytes > 0 for g in groups if g.flops)
    moved = sum(g.nbytes * g.count for g in groups if not g.flops) * scale
    assert moved > 0
    assert fwd == pytest.approx(sum(mm) + moved / bw)
    # a fused attention's backward recomputes its scores: 2.5 forwards, the rest 2
    back = sum(t * (ATTENTION_BACKWARD_RATIO if g.attention else BACKWARD_FLOPS_RATIO)
               for t, g in zip(mm, [g for g in groups if g.flops], strict=True))
    assert any(g.attention for g in groups)
    assert tc.duration(2, _task(plan, 2, Kind.BWD)) == pytest.approx(
        back + BACKWARD_FLOPS_RATIO * moved / bw)
    params = costs.params_of(plan.stage_regions[1])
    assert tc.duration(2, _task(plan, 2, Kind.UPDATE)) == pytest.approx(
        UPDATE_BYTES_PER_PARAM * params / c.memory_bandwidth)
    ar = _task(plan, 2, Kind.ALL_REDUCE)
    assert tc.duration(2, ar) == pytest.approx(ring_all_reduce_time(
        4 * params, 2, latency=c.intra_node_latency, bandwidth=c.intra_node_bandwidth))
    assert tc.duration(0, _task(plan, 0, Kind.SEND)) == 0.0


@pytest.mark.parametrize(("gpus_per_node", "inter"), [(8, False), (2, True)])
def test_transfer_uses_the_inter_node_link_only_across_nodes(
        make_plan: Callable[..., Plan], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec], gpus_per_node: int, inter: bool) -> None:
    c = ideal_cluster(gpus_per_node=gpus_per_node, intra_node_bandwidth=1e9,
                      intra_node_latency=1e-6, inter_node_bandwidth=1e8, inter_node_latency=1e-5)
    plan = make_plan("1f1b", pp=2, microbatches=4, dp=2)  # ranks 0,1 -> stage 0; 2,3 -> stage 1
    send = _task(plan, 0, Kind.SEND)
    assert send.peer == 2
    nbytes = 3 * sum(plan.model.value(v).nbytes for v in send.values) / plan.model.batch
    lat, bw = (1e-5, 1e8) if inter else (1e-6, 1e9)
    tc = task_costs(plan, costs, c, microbatch_size=3)
    assert tc.transfer(0, send) == pytest.approx(p2p_time(nbytes, latency=lat, bandwidth=bw))


def test_pricing_a_long_sequence_allocates_nothing_of_its_size(tmp_path) -> None:
    """Hugging Face's Llama builds a sequence x sequence causal mask; capture traces it on
    fake tensors, and the cost models must replay it on meta too (at 131,072 tokens a real
    one is 16 GiB of bools, 64 GiB in fp32). Peak host memory, in a fresh process."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.hf_models import LLAMA_31_8B

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_31_8B, "num_hidden_layers": 2}))
    code = f"""
import resource, sys
sys.path.insert(0, {str(ROOT)!r})
import piper
from cost_models import model_costs
from piper.hf import load_hf_model
spec = load_hf_model({str(tmp_path / "config.json")!r}, seq_len=131072)
costs = model_costs(piper.capture(spec, 1))
assert sum(costs.forward_flops) > 0 and max(costs.activation_bytes) > 2 ** 30
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    peak_kib = int(out.stdout.split()[-1])
    assert peak_kib < 2 * 2 ** 20, f"{peak_kib / 2**20:.1f} GiB of host memory"
