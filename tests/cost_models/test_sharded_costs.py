"""Tensor/expert parallelism in the cost model: local math from a sharded capture, plus the
collectives inside chunks priced by the alpha-beta formulas."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import piper
from cost_models import comm, load_cluster
from cost_models.sharded import (
    all_to_all_time,
    in_graph_comm,
    overlapped,
    with_expert_skew,
    with_in_graph_comm,
)
from cost_models.task_costs import task_costs
from piper import schedules
from piper.model_file import load_model_file
from piper.sharding import ModelSharding
from planner.search.evaluate import Evaluator
from runtime.lowering.scheduler import schedule
from tests.conftest import GPT, ROOT

TINY = (("size", "tiny"),)


def test_megatron_layers_have_one_g_and_one_f_per_column_row_pair() -> None:
    spec = load_model_file(GPT, TINY)
    cap = piper.capture(spec, 1, ModelSharding(tp=2, tp_plan=spec.tp_plan))
    traffic = in_graph_comm(cap)
    act = 16 * 32 * 4  # one sample: seq 16 x dim 32 fp32
    layers = [cap.graph.names.index(f"layer.{i}") for i in range(4)]
    assert all(traffic.forward_all_reduce[r] == (act, act) for r in layers)
    assert all(traffic.backward_all_reduce[r] == (act, act) for r in layers)
    # the vocabulary-parallel embedding leaves through one g; the output layer enters
    # through f, and its logits stay sliced for the vocabulary-parallel cross-entropy
    embed, head = cap.graph.names.index("embed"), cap.graph.names.index("head")
    assert traffic.forward_all_reduce[embed] == (act,)
    assert traffic.backward_all_reduce[head] == (act,)
    assert sum(map(len, traffic.forward_all_gather)) == 0
    # a loss that is not plain cross-entropy reads every logit: gathered (seq 16 x vocab
    # 128 fp32)
    cap = piper.capture(dataclasses.replace(spec, loss_fn=_z_loss), 1,
                        ModelSharding(tp=2, tp_plan=spec.tp_plan))
    traffic = in_graph_comm(cap)
    assert traffic.forward_all_gather[head] == (16 * 128 * 4,)
    assert sum(map(len, traffic.forward_all_gather)) == 1


def _z_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus PaLM's z-loss: reads every logit's log-partition."""
    flat = logits.reshape(-1, logits.shape[-1])
    return (F.cross_entropy(flat, targets.reshape(-1))
            + 1e-4 * flat.logsumexp(-1).pow(2).mean())


def test_the_gathered_logits_are_priced_as_an_all_gather() -> None:
    spec = dataclasses.replace(load_model_file(GPT, TINY), loss_fn=_z_loss)
    cluster = load_cluster("h100-80gb")
    sharding = ModelSharding(tp=2, tp_plan=spec.tp_plan)
    cap = piper.capture(spec, 1, sharding)
    dag0 = piper.single_device_dag(piper.capture(spec, 1).graph)
    prog = schedules.shard(schedules.build("1f1b", [list(dag0.model.names)], microbatches=1),
                           tp=2)
    plan = schedule(prog.apply(dag0))
    costs = Evaluator(spec, 2, 4, cluster).sharded_costs(plan.sharding)[0]
    base = task_costs(plan, costs, cluster, 4)
    traffic = in_graph_comm(cap)
    without = dataclasses.replace(traffic, forward_all_gather=())
    got = with_in_graph_comm(base, plan, traffic, cluster, 4)
    no_gather = with_in_graph_comm(base, plan, without, cluster, 4)
    gather = comm.collective_time(comm.ALL_GATHER, 4 * 16 * 128 * 4, (0, 1), cluster)
    assert got.forward_s[0] - no_gather.forward_s[0] == pytest.approx(gather)
    assert got.backward_s[0] == no_gather.backward_s[0], "backward keeps a slice: no traffic"
    # overlapped with the GEMMs (Megatron's --tp-comm-overlap): only what the chunk's math
    # does not cover shows, plus NVLink's contention over what it does
    hidden = with_in_graph_comm(base, plan, traffic, cluster, 4, tp_overlap=True)
    for got_s, base_s, hid_s in ((got.forward_s[0], base.forward_s[0], hidden.forward_s[0]),
                                 (got.backward_s[0], base.backward_s[0],
                                  hidden.backward_s[0])):
        tp = got_s - base_s
        assert hid_s - base_s == pytest.approx(overlapped(tp, base_s, 0.15))
        assert base_s <= hid_s <= got_s


def test_overlapped_collectives_show_what_the_math_does_not_cover() -> None:
    assert overlapped(1.0, 3.0, 0.15) == pytest.approx(0.15)
    assert overlapped(3.0, 1.0, 0.15) == pytest.approx(2.15)
    assert overlapped(0.0, 1.0, 0.15) == 0.0


@pytest.fixture(scope="module")
def moe_ep2():
    """The MoE example under ep2 x dp2 on H100s: (plan, its slice's costs, its in-graph
    traffic, the cluster)."""
    spec = load_model_file(str(ROOT / "examples" / "moe.py"), TINY)
    cluster = load_cluster("h100-80gb")
    cap = piper.capture(spec, 1, ModelSharding(ep=2, experts=("moe.0.experts",
                                                               "moe.1.experts")))
    dag0 = piper.single_device_dag(piper.capture(spec, 1).graph)
    prog = schedules.shard(schedules.build("1f1b", [list(dag0.model.names)], microbatches=1,
                                           dp=2), ep=2, expert_regions=("experts.0",
                                                                        "experts.1"))
    plan = schedule(prog.apply(dag0))
    costs = Evaluator(spec, 2, 16, cluster).sharded_costs(plan.sharding)[0]
    return plan, costs, in_graph_comm(cap), cluster


def test_chunk_times_grow_by_exactly_the_in_graph_collectives(moe_ep2) -> None:
    plan, costs, traffic, cluster = moe_ep2
    base = task_costs(plan, costs, cluster, 4)
    got = with_in_graph_comm(base, plan, traffic, cluster, 4)
    # per MoE layer: the row counts (2 local experts x 2 ranks, int64), then the routed
    # rows there and back: 4 x 16 tokens x top-2 rows of 32 fp32, not E x T of them
    per = all_to_all_time(4 * 16 * 2 * 32 * 4, (0, 1), cluster)
    counts = all_to_all_time(4 * 8 * 2 * 2, (0, 1), cluster)  # priced at 4 samples too
    assert got.forward_s[0] - base.forward_s[0] == pytest.approx(2 * (2 * per + counts))
    assert got.backward_s[0] - base.backward_s[0] == pytest.approx(2 * (2 * per + counts))
    # NVLink at the measured bus bandwidth for its size (here the small-message floor)
    assert per == pytest.approx(0.5 * 16384 / cluster.busbw(16384, ring=True))
    # a skewed router (the busiest rank gets 1.5x the mean routed rows): that rank's
    # expert GEMMs take 1.5x as long, and every all-to-all waits for its rows
    skewed = with_expert_skew(base, plan, costs, 1.5)
    share = [sum(costs.routed_flops[costs.regions.index(r)] for r in regions)
             / sum(costs.forward_flops[costs.regions.index(r)] for r in regions)
             for regions in plan.stage_regions]
    assert 0 < share[0] < 1
    assert skewed.forward_s[0] == pytest.approx(base.forward_s[0] * (1 + 0.5 * share[0]))
    assert skewed.backward_s[0] == pytest.approx(base.backward_s[0] * (1 + 0.5 * share[0]))
    waits = with_in_graph_comm(base, plan, traffic, cluster, 4, expert_skew=1.5)
    assert waits.forward_s[0] - base.forward_s[0] == pytest.approx(3 * (2 * per + counts))
    assert with_expert_skew(base, plan, costs, 1.0) is base


def test_tensor_parallel_halves_the_math_and_adds_all_reduces() -> None:
    spec = load_model_file(GPT, (("size", "small"),))
    ev = Evaluator(spec, 8, 32, load_cluster("h100-80gb"))
    stages = [list(ev.captured.graph.names)]
    dp8 = ev.evaluate(schedules.build("1f1b", stages, microbatches=1, dp=8))
    tp2 = ev.evaluate(schedules.shard(schedules.build("1f1b", stages, microbatches=1, dp=4),
                                      tp=2))
    assert tp2.plan.world_size == 8 and tp2.plan.pp * tp2.plan.dp == 4
    full, half = ev.costs, ev.sharded_costs(tp2.plan.sharding)[0]
    layer = full.regions.index("layer.0")
    assert half.forward_flops[layer] < 0.6 * full.forward_flops[layer]
    assert half.params[layer] < 0.6 * full.params[layer]
    # per rank: half the layer math, twice the samples (dp 4 not 8), plus the all-reduces
    assert tp2.prediction.step_time_s != dp8.prediction.step_time_s
    assert max(tp2.prediction.peak_memory_bytes) < max(dp8.prediction.peak_memory_bytes)


def test_sequence_parallel_scatters_and_gathers_and_shrinks_what_crosses_stages() -> None:
    spec = load_model_file(str(ROOT / "examples" / "llama.py"), TINY)
    plain = in_graph_comm(piper.capture(spec, 1, ModelSharding(tp=2, tp_plan=spec.tp_plan)))
    cap = piper.capture(spec, 1, ModelSharding(tp=2, tp_plan=spec.tp_plan, sp=True))
    sp = in_graph_comm(cap)
    layer = cap.graph.names.index("layer.1")
    act = 16 * 32 * 4  # one sample: seq 16 x dim 32 fp32, whole
    # the column-parallel layers gather the sequence where f was, once per input they share
    # (wq, wk, wv; w1, w3: Megatron's fused QKV and FC1) and each row-parallel one
    # reduce-scatters where g was (wo, w2): the same whole tensors
    assert sp.sequence_gather[layer] == plain.backward_all_reduce[layer] == (act,) * 2
    assert sp.sequence_scatter[layer] == plain.forward_all_reduce[layer] == (act,) * 2
    # those linears keep their input's slice and gather it again in backward, once a share
    assert sp.sequence_regather[layer] == (act,) * 2 and not plain.sequence_regather[layer]
    # what is left of the all-reduces: the norms' gradients, a few dozen bytes each
    assert sum(sp.backward_all_reduce[layer]) < act
    # a layer keeps less for backward: its norms and residual adds hold half the tokens
    ev = Evaluator(spec, 4, 8, load_cluster("h100-80gb"))
    whole = ev.sharded_costs(ModelSharding(tp=2, tp_plan=spec.tp_plan))[0]
    split = ev.sharded_costs(ModelSharding(tp=2, tp_plan=spec.tp_plan, sp=True))[0]
    assert split.activation_bytes[layer] < whole.activation_bytes[layer]
    stages = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]
    runs = [ev.evaluate(schedules.shard(schedules.build("1f1b", stages, microbatches=2),
                                        tp=2, sp=on)) for on in (False, True)]
    sends = [next(s for s in r.prediction.spans if s.task.kind is piper.Kind.SEND
                  ).task for r in runs]
    assert sends[0].values == sends[1].values
    assert all(r.plan.sharding.sp is on for r, on in zip(runs, (False, True), strict=True))
    # and the simulator prices each message at what a rank sends: half the sequence
    share = ev._slice(runs[1].plan.sharding)[2]
    assert set(share.values()) == {0.5}


def test_hugging_face_sequence_parallelism_gathers_at_blocks_and_splits_once(tmp_path) -> None:
    """Unmodified Hugging Face attention under tp2 + SP: one gather into each attention and
    MLP block and one reduce-scatter out (Megatron's count), the sequence split at the first
    layer (gathered back in its backward) and gathered whole before the final norm."""
    from piper.hf import load_hf_model
    from tests.hf_models import write_config

    spec = load_hf_model(write_config(tmp_path / "llama", "llama"))
    cap = piper.capture(spec, 1, ModelSharding(tp=2, tp_plan=spec.tp_plan, sp=True))
    traffic = in_graph_comm(cap)
    names = cap.graph.names
    seq, dim = dict(spec.options)["seq_len"], 32
    whole = seq * dim * 4  # one sample, fp32
    layers = [i for i, n in enumerate(names) if n.startswith("layer.")]
    assert all(traffic.sequence_gather[r] == (whole, whole) for r in layers)
    assert all(traffic.sequence_scatter[r] == (whole, whole) for r in layers)
    assert all(traffic.sequence_regather[r] == (whole, whole) for r in layers), \
        "q, k, v (and gate, up) keep the slice and gather it once again in backward"
    assert traffic.sequence_split[layers[0]] == (whole,)
    assert not any(traffic.sequence_split[r] for r in layers[1:])
    head = names.index("head")
    # the final norm's input gathered whole, then the output layer (the causal LM's own
    # plan: lm_head column-parallel) gathers its logits over the vocabulary
    assert traffic.forward_all_gather[head] == (whole, seq * 128 * 4)


def test_routed_experts_cost_the_routed_rows_not_every_expert_on_every_token() -> None:
    spec = load_model_file(str(ROOT / "examples" / "moe.py"), TINY)
    costs = Evaluator(spec, 1, 16, load_cluster("h100-80gb")).costs
    experts = costs.forward_flops[costs.regions.index("experts.0")]
    router = 2 * 16 * 32 * 4  # 16 tokens x dim 32 x 4 experts
    # two GEMMs over 16 tokens x top-2 rows (dim 32, hidden 64); a dense [E, T] buffer
    # would be 4 x 16 rows, twice as many
    assert experts - router == 2 * 2 * (16 * 2) * 32 * 64


def test_gathered_columns_and_split_rows_are_priced_as_their_collectives(tmp_path) -> None:
    """OLMoE's attention under tp=2: q, k and v gathered whole (three all-gathers forward),
    o_proj's input split (its gradient all-gathered backward), o_proj's output all-reduced."""
    pytest.importorskip("transformers")
    from piper.loading import load_model
    from tests.hf_models import SEQ, write_config

    spec = load_model(write_config(tmp_path / "olmoe", "olmoe"), (), (("seq_len", SEQ),))
    cap = piper.capture(spec, 1, ModelSharding(tp=2, tp_plan=spec.tp_plan))
    traffic = in_graph_comm(cap)
    layer = cap.graph.names.index("layer.0")
    whole = SEQ * 32 * 4  # one sequence of hidden 32, fp32: q gathered whole
    kv = SEQ * 16 * 4  # k and v: 2 key-value heads of 8
    assert sorted(traffic.forward_all_gather[layer]) == [kv, kv, whole]
    assert traffic.sequence_split[layer] == (whole,)
    assert traffic.forward_all_reduce[layer] == (whole,)


def test_an_all_to_all_over_nodes_sends_each_nodes_share_through_its_nic() -> None:
    """Inside a node an all-to-all runs at NVLink's collective bus bandwidth; across nodes
    each rank's NIC carries only what goes to other nodes, while NVLink carries the rest."""
    h100 = load_cluster("h100-80gb")
    n = 128 * 2**20
    inside = all_to_all_time(n, tuple(range(8)), h100)
    assert inside == pytest.approx(7 / 8 * n / h100.busbw(n, ring=True))
    two_nodes = all_to_all_time(n, tuple(range(16)), h100)  # 8 of 15 peers are remote
    assert two_nodes == pytest.approx(h100.inter_node_latency
                                      + 8 / 16 * n / h100.inter_node_bandwidth)
    one_per_node = all_to_all_time(n, tuple(range(0, 128, 8)), h100)  # every peer remote
    assert one_per_node == pytest.approx(h100.inter_node_latency
                                         + 15 / 16 * n / h100.inter_node_bandwidth)
    assert inside < two_nodes < one_per_node


def test_overlapped_expert_exchanges_add_what_the_paired_math_does_not_cover(moe_ep2
                                                                             ) -> None:
    """Megatron's EP overlap: a forward's all-to-alls run under another microbatch's
    backward, a backward's under a forward."""
    plan, costs, traffic, cluster = moe_ep2
    base = task_costs(plan, costs, cluster, 4)
    inline = with_in_graph_comm(base, plan, traffic, cluster, 4)
    hidden = with_in_graph_comm(base, plan, traffic, cluster, 4, ep_overlap=True)
    a2a = inline.forward_s[0] - base.forward_s[0]
    assert a2a > 0 and inline.backward_s[0] - base.backward_s[0] == pytest.approx(a2a)
    c = comm.contention(cluster, plan.mesh.ep_processes(0, 0))
    assert hidden.forward_s[0] - base.forward_s[0] == pytest.approx(
        overlapped(a2a, base.backward_s[0], c))
    assert hidden.backward_s[0] - base.backward_s[0] == pytest.approx(
        overlapped(a2a, base.forward_s[0], c))
