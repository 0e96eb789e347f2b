"""Recompute in the cost models: a recomputed stage's backward repeats its forward (in I when
the backward is split, with the forward's in-graph collectives), so the predicted step is
longer, and its microbatches keep only their regions' inputs, so the predicted peak is lower."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import piper
from cost_models import CATALOG, ClusterSpec, ModelCosts, model_costs, simulate, task_costs
from cost_models.memory import activation_bytes
from cost_models.sharded import InGraphComm, with_in_graph_comm
from piper import schedules
from piper.dag import Kind
from piper.model_file import load_model_file
from piper.sharding import ModelSharding
from runtime.lowering.plan import Plan, Task
from runtime.lowering.scheduler import schedule
from tests.conftest import ROOT
from tests.cost_models.conftest import MICROBATCH, STAGES


@pytest.fixture(scope="module")
def plans(captured: piper.Captured) -> Callable[..., tuple[Plan, Plan]]:
    """`plans("zb1p")`: the pp=2 Plan of a schedule without and with Recompute."""
    dag0 = piper.single_device_dag(captured.graph)

    def build(name: str, tp: int = 1, stages: tuple[int, ...] = ()) -> tuple[Plan, Plan]:
        prog = schedules.build(name, STAGES[2], microbatches=4)
        prog = schedules.shard(prog, tp=tp)
        return (schedule(prog.apply(dag0)),
                schedule(schedules.with_recompute(prog, stages).apply(dag0)))
    return build


def _task(plan: Plan, rank: int, kind: Kind) -> Task:
    return next(t for t in plan.ranks[rank].tasks if t.kind is kind)


@pytest.mark.parametrize("name", ["1f1b", "zb1p"])
def test_recompute_lengthens_the_predicted_step_and_lowers_the_peak(
        plans: Callable[..., tuple[Plan, Plan]], costs: ModelCosts, name: str) -> None:
    plain, again = plans(name)
    cluster = CATALOG["h100-80gb"]
    a, b = (simulate(p, costs, cluster, MICROBATCH) for p in (plain, again))
    assert b.step_time_s > a.step_time_s
    # the first stage holds the most microbatches; with a split backward the last one holds
    # W's products from I to W, about what it saved anyway
    assert all(y <= x for x, y in zip(a.peak_memory_bytes, b.peak_memory_bytes, strict=True))
    assert b.peak_memory_bytes[0] < a.peak_memory_bytes[0]
    if name == "1f1b":
        assert b.peak_memory_bytes[1] < a.peak_memory_bytes[1]
    # the extra busy time of a rank is one forward per microbatch of its stage
    tc = task_costs(plain, costs, cluster, MICROBATCH)
    for rank, (x, y) in enumerate(zip(a.busy_s, b.busy_s, strict=True)):
        assert y - x == pytest.approx(4 * tc.forward_s[rank])
    kept, full = activation_bytes(again, costs, MICROBATCH), activation_bytes(plain, costs,
                                                                              MICROBATCH)
    assert all(k < f for k, f in zip(kept, full, strict=True))


def test_only_the_recomputed_stages_pay_and_save(plans: Callable[..., tuple[Plan, Plan]],
                                                 costs: ModelCosts) -> None:
    plain, again = plans("1f1b", stages=(0,))
    cluster = CATALOG["h100-80gb"]
    a, b = (task_costs(p, costs, cluster, MICROBATCH) for p in (plain, again))
    assert b.backward_s[0] == pytest.approx(a.backward_s[0] + a.forward_s[0])
    assert b.backward_s[1] == a.backward_s[1]
    ka, kb = (activation_bytes(p, costs, MICROBATCH) for p in (plain, again))
    assert kb[0] < ka[0] and kb[1] == ka[1]
    pa, pb = (simulate(p, costs, cluster, MICROBATCH).peak_memory_bytes for p in (plain, again))
    assert pb[0] < pa[0] and pb[1] == pa[1]


def test_split_backward_puts_the_recompute_in_i_not_w(
        plans: Callable[..., tuple[Plan, Plan]], costs: ModelCosts,
        ideal_cluster: Callable[..., ClusterSpec]) -> None:
    plain, again = plans("zb1p")
    cluster = ideal_cluster(flops=1e9)
    a, b = (task_costs(p, costs, cluster, MICROBATCH) for p in (plain, again))
    for rank in range(2):
        i, w = _task(again, rank, Kind.BWD_I), _task(again, rank, Kind.BWD_W)
        assert b.duration(rank, i) == pytest.approx(a.duration(rank, i) + a.forward_s[rank])
        assert b.duration(rank, w) == pytest.approx(a.duration(rank, w))


def test_recompute_runs_the_forward_collectives_again_in_backward(
        plans: Callable[..., tuple[Plan, Plan]], costs: ModelCosts) -> None:
    plain, again = plans("zb1p", tp=2)
    cluster = CATALOG["h100-80gb"]
    n = len(costs.regions)
    one = tuple((1 << 20,) for _ in range(n))  # 1 MiB each way per region
    traffic = InGraphComm(forward_all_reduce=one, backward_all_reduce=one,
                          all_to_all=tuple(() for _ in range(n)))
    a, b = (with_in_graph_comm(task_costs(p, costs, cluster, MICROBATCH), p, traffic, cluster,
                               MICROBATCH) for p in (plain, again))
    bare = task_costs(plain, costs, cluster, MICROBATCH)
    for s in range(2):
        comm_f = a.forward_s[s] - bare.forward_s[s]
        assert comm_f > 0
        assert b.backward_s[s] == pytest.approx(a.backward_s[s] + a.forward_s[s])
        assert b.recompute_s[s] == pytest.approx(bare.forward_s[s] + comm_f)
        i = _task(again, s, Kind.BWD_I)
        assert b.duration(s, i) == pytest.approx(a.duration(s, i) + a.forward_s[s])


LLAMA = str(ROOT / "examples" / "llama.py")
HAND_NORM = str(ROOT / "tests" / "models" / "hand_norm_llama.py")
LAYER = {"dim": 256, "heads": 8, "kv_heads": 2, "ffn": 704, "seq": 128}


def _llama_costs(model: str) -> tuple[piper.Captured, ModelCosts]:
    spec = load_model_file(model, (("size", "tiny"), *((k, v) for k, v in LAYER.items())))
    cap = piper.capture(spec, 2, ModelSharding(tp=2, tp_plan=spec.tp_plan, sp=True))
    return piper.capture(spec, 2), model_costs(cap)  # the DAG's graph, one rank's costs


@pytest.fixture(scope="module")
def llama_costs() -> tuple[piper.Captured, ModelCosts]:
    return _llama_costs(LLAMA)


@pytest.fixture(scope="module")
def hand_norm_costs() -> tuple[piper.Captured, ModelCosts]:
    """The same Llama with its norms written out op by op (Hugging Face's way)."""
    return _llama_costs(HAND_NORM)


def _per_layer(c: ModelCosts) -> dict[str, float]:
    """Layer 1's bytes kept per policy, at 16 bits, in s·b·h/t (tp 2)."""
    layer = c.regions.index("layer.1")
    unit = LAYER["seq"] * 2 * LAYER["dim"] / 2 * 2  # captured in fp32, counted at 16 bits
    return {"none": c.activation_bytes[layer] / unit, "full": c.recompute_bytes[layer] / unit,
            **{p: b[layer] / unit for p, b in c.selective_bytes}}


def test_a_llama_layer_keeps_what_fused_kernels_keep(llama_costs, hand_norm_costs) -> None:
    """Per Llama layer under tp + SP at 16 bits, in s·b·h/t, without recompute: the norm's
    input and its output's slice (2 + 2), q, k and v as attention reads them (2 + 4·kv/heads),
    its output, which the output projection reads in place (2), the projection's scattered
    output beside the residual (2), the second norm's output slice (2), gate, up and their
    product (6·ffn/h): 12 + 4·kv/heads + 6·ffn/h, Korthikanti et al.'s accounting with fused
    kernels (31.75 for Llama 3 405B's layer), since the runtime's norm, SwiGLU and attention
    keep what fused kernels keep (`runtime.execute.fused`)."""
    got = _per_layer(llama_costs[1])
    fused = 12 + 4 * LAYER["kv_heads"] / LAYER["heads"] + 6 * LAYER["ffn"] / LAYER["dim"]
    assert got["none"] == pytest.approx(fused, rel=0.03)
    assert got["op"] == got["none"], "nothing cheap is left worth recomputing"
    # with flash attention, recomputing it frees only its log-sum-exp statistics
    assert got["full"] < got["attention"] < got["none"] < got["attention"] + 0.1
    # norms written out op by op keep their normalised copies; `op` recomputes them
    hand = _per_layer(hand_norm_costs[1])
    assert hand["none"] > got["none"] + 3
    assert hand["op"] == pytest.approx(got["none"], rel=0.01)


@pytest.mark.parametrize("policy", ["attention", "op"])
def test_selective_policies_cost_time_and_memory_between_none_and_full(
        hand_norm_costs, policy: str) -> None:
    cap, c = hand_norm_costs
    dag0 = piper.single_device_dag(cap.graph)
    stages = [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]]
    prog = schedules.shard(schedules.build("1f1b", stages, microbatches=4), tp=2, sp=True)
    plain, sel, full = (schedule(p.apply(dag0)) for p in (
        prog, schedules.with_recompute(prog, policy=policy), schedules.with_recompute(prog)))
    assert sel.recompute_policy == policy
    cluster = CATALOG["h100-80gb"]
    a, b, f = (simulate(p, c, cluster, 2) for p in (plain, sel, full))
    assert a.step_time_s < b.step_time_s < f.step_time_s
    assert f.peak_memory_bytes[0] < b.peak_memory_bytes[0] < a.peak_memory_bytes[0]
    # what the backward runs again: the policy's own ops, no collective
    tc = task_costs(sel, c, cluster, 2)
    assert 0 < tc.recompute_s[0] < task_costs(full, c, cluster, 2).recompute_s[0]
