"""Context parallelism in the cost model: each rank's math at its share of the sequence (its
attention over every key), the key/value exchange as `piper.context_parallel` runs it, and
gradients summed and sharded over dp x cp."""

from __future__ import annotations

import dataclasses

import pytest

import piper
from cost_models import comm, load_cluster
from cost_models.analytical import model_costs
from cost_models.attention import ATTENTION_BACKWARD_RATIO, CAUSAL_WORK
from cost_models.sharded import context_seconds, in_graph_comm
from piper import schedules
from piper.model_file import load_model_file
from piper.sharding import ModelSharding
from planner.search.evaluate import Evaluator
from runtime.lowering.scheduler import schedule
from tests.conftest import ROOT

LLAMA = str(ROOT / "examples" / "llama.py")
# a long sequence on the tiny shapes: dim 32, 4 heads (2 key/value) of 8, seq 256
SPEC = load_model_file(LLAMA, (("size", "tiny"), ("seq", 256)))


def _plan(cp: int, mode: str = "ring", dp: int = 1, zero: int = 0):
    dag = piper.single_device_dag(piper.capture(SPEC, 1).graph)
    prog = schedules.build("none", [list(dag.model.names)], microbatches=1, dp=dp, zero=zero)
    return schedule(schedules.shard(prog, cp=cp, cp_attention=mode).apply(dag))


def test_a_rank_computes_its_share_and_attends_over_every_key():
    whole = model_costs(piper.capture(SPEC, 1))
    cap = piper.capture(SPEC, 1, ModelSharding(cp=4))
    part = model_costs(cap)
    layer = whole.regions.index("layer.0")
    # linears on 1/4 of the tokens; attention: 64 queries x 256 keys, 1/4 of 256 x 256
    assert part.forward_flops[layer] * 4 == whole.forward_flops[layer]
    attention = [g for g in part.ops[layer] if g.attention]
    assert [(g.flops, g.work) for g in attention] == [(4 * 4 * 64 * 256 * 8, CAUSAL_WORK)]
    # a quarter (attention's output laid out as flash lays it out either way)
    assert part.activation_bytes[layer] * 4 <= whole.activation_bytes[layer] * 1.05
    traffic = in_graph_comm(cap)
    kv = 2 * (1 * 2 * 64 * 8) * 4  # k and v: 2 heads x 64 tokens x 8, fp32
    assert traffic.context_kv[layer] == (kv,) and traffic.context_acc[layer] == (kv,)


def test_ring_hops_show_past_the_blocks_math_and_all_gather_runs_in_line():
    cluster = load_cluster("h100-80gb")
    traffic = in_graph_comm(piper.capture(SPEC, 1, ModelSharding(cp=4)))
    layers = [i for i, kv in enumerate(traffic.context_kv) if kv]
    ring, gather = _plan(4), _plan(4, "all_gather")
    group = ring.mesh.cp_group(0)
    kv = traffic.context_kv[layers[0]][0]
    f, b = context_seconds(traffic, layers[:1], gather, cluster, 1.0)
    assert f == comm.collective_time(comm.ALL_GATHER, 4 * kv, group, cluster)
    assert b == comm.collective_time(comm.REDUCE_SCATTER, 4 * kv, group, cluster)
    # tiny blocks: nothing to hide behind, every hop shows (3 out, 3 + 3 back, 1 home)
    hop = comm.p2p_message_time(cluster, 0, 1, kv)
    f, b = context_seconds(traffic, layers[:1], ring, cluster, 1.0)
    # a step's kernel: an unmasked block over the rank's 64 keys, at that length's rate
    assert traffic.context_keys[layers[0]] == (64,)
    flops = traffic.context_flops[layers[0]][0]
    block = cluster.attention_seconds(flops, 0, 64, False, False) / 4
    back = cluster.attention_seconds(ATTENTION_BACKWARD_RATIO * flops, 0, 64, False, True) / 4
    assert f == pytest.approx(3 * (hop - block))
    assert b == pytest.approx(3 * (2 * hop - 2 * back) + hop)
    # a million times the tokens: the math hides the ring's hops, only the last one shows
    big = dataclasses.replace(traffic, context_flops=tuple(
        tuple(x * 1e12 for x in r) for r in traffic.context_flops))
    f, b = context_seconds(big, layers[:1], ring, cluster, 1.0)
    assert f == 0 and b == hop


def test_gradients_are_summed_and_sharded_over_dp_x_cp():
    cluster = load_cluster("h100-80gb")
    ev = Evaluator(SPEC, 8, 8, cluster)
    program = schedules.shard(schedules.build("none", [list(ev.graph.names)], microbatches=1,
                                              dp=2, zero=3), cp=4)
    plan = ev.evaluate(program).plan
    assert (plan.dp, plan.shard_ways, plan.world_size) == (2, 8, 8)
    flat = schedules.build("none", [list(ev.graph.names)], microbatches=1, dp=8, zero=3)
    # ZeRO-3 over 8 ranks either way: the same weights, gradients and optimizer state
    assert ev.memory_parts(ev.evaluate(program))[0].weights == \
        ev.memory_parts(ev.evaluate(flat))[0].weights
