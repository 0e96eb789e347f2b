"""Each directive's rewrite, checked against node and edge count formulas, and its errors.

The tiny GPT is a chain of R = 6 regions. For S stages in chain order with C cuts between
consecutive stages, C_x of them across devices (every flow is floating point, so a cut across
devices carries activations forward and gradients back):

    nodes = 3S + 4 C_x                       (F, B, U per stage; SEND/RECV fwd + grad per cut)
    edges = 2S + 6 C_x + 2 (C - C_x)         (F->B, B->U; F->SEND->RECV->F and back per cut;
                                              F->F and B->B where both stages share a device)
Split(M) multiplies every edge by M (no edge joins two updates). Replicate(D) adds one AR per
stage and replica and cuts the M edges B->U into M edges B->AR plus one AR->U:
    edges = D (E + S)
"""

from __future__ import annotations

import itertools
from collections import Counter

import networkx as nx
import pytest

import piper
from piper import Order, Place, Program, Replicate, Split, schedules
from piper.dag import Kind, Node, TrainingDAG, VerifyError, verify
from piper.model_file import load_model_file

REGIONS = ("embed", "layer.0", "layer.1", "layer.2", "layer.3", "head")
STAGES = {
    1: [list(REGIONS)],
    2: [["embed", "layer.0", "layer.1"], ["layer.2", "layer.3", "head"]],
    3: [["embed", "layer.0"], ["layer.1", "layer.2"], ["layer.3", "head"]],
    6: [[r] for r in REGIONS],
}


@pytest.fixture(scope="module")
def dag0() -> TrainingDAG:
    cap = piper.capture(load_model_file("examples/gpt.py", (("size", "tiny"),)), 2)
    return piper.single_device_dag(cap.graph)


def kinds(dag: TrainingDAG) -> Counter:
    return Counter(n.kind for n in dag.graph.nodes)


def placed(dag0: TrainingDAG, stages: list[list[str]], devices: list[int]) -> TrainingDAG:
    ds = [Place(tuple(r), stage=s, device=d) for s, (r, d) in enumerate(zip(stages, devices))]
    return Program(ds).apply(dag0)


def chain_counts(devices: list[int]) -> tuple[int, int]:
    s = len(devices)
    cross = sum(a != b for a, b in itertools.pairwise(devices))
    return 3 * s + 4 * cross, 2 * s + 6 * cross + 2 * (s - 1 - cross)


# --- single_device_dag -----------------------------------------------------------------

def test_single_device_dag_has_forward_backward_update_per_region(dag0: TrainingDAG) -> None:
    r = len(REGIONS)
    assert dag0.graph.number_of_nodes() == 3 * r
    assert kinds(dag0) == {Kind.FWD: r, Kind.BWD: r, Kind.UPDATE: r}
    assert dag0.graph.number_of_edges() == r + r + 2 * (r - 1)
    assert [s.regions for s in dag0.stages] == [(name,) for name in REGIONS]
    assert {s.device for s in dag0.stages} == {0}
    assert (dag0.pp, dag0.dp, dag0.microbatches, dag0.world_size) == (1, 1, 1, 1)


def test_single_device_dag_chains_forwards_down_and_backwards_up(dag0: TrainingDAG) -> None:
    g = dag0.graph
    for s in range(len(REGIONS)):
        assert g.has_edge(Node(Kind.FWD, s, 0), Node(Kind.BWD, s, 0))
        assert g.has_edge(Node(Kind.BWD, s, 0), Node(Kind.UPDATE, s))
    for s in range(len(REGIONS) - 1):
        assert g.has_edge(Node(Kind.FWD, s, 0), Node(Kind.FWD, s + 1, 0))
        assert g.has_edge(Node(Kind.BWD, s + 1, 0), Node(Kind.BWD, s, 0))
    assert all(d["kind"] == "data" for *_, d in g.edges(data=True))
    verify(dag0)


# --- Place ------------------------------------------------------------------------------

@pytest.mark.parametrize("devices", [[0], [0, 1], [0, 1, 2], [0, 1, 0], [0, 0, 1],
                                     [0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 0, 1]])
def test_place_adds_four_p2p_nodes_per_cut_across_devices(dag0: TrainingDAG,
                                                         devices: list[int]) -> None:
    stages = STAGES[len(devices)]
    dag = placed(dag0, stages, devices)
    nodes, edges = chain_counts(devices)
    cross = sum(a != b for a, b in itertools.pairwise(devices))
    s = len(stages)
    assert kinds(dag) == Counter({Kind.FWD: s, Kind.BWD: s, Kind.UPDATE: s,
                                  Kind.SEND: 2 * cross, Kind.RECV: 2 * cross})
    assert dag.graph.number_of_nodes() == nodes
    assert dag.graph.number_of_edges() == edges
    assert dag.pp == max(devices) + 1
    assert [st.regions for st in dag.stages] == [tuple(r) for r in stages]


def test_place_routes_activations_and_gradients_through_send_recv(dag0: TrainingDAG) -> None:
    dag = placed(dag0, STAGES[2], [0, 1])
    g = dag.graph
    f0, f1 = Node(Kind.FWD, 0, 0), Node(Kind.FWD, 1, 0)
    b0, b1 = Node(Kind.BWD, 0, 0), Node(Kind.BWD, 1, 0)
    send, recv = Node(Kind.SEND, 0, 0, src=0, dst=1), Node(Kind.RECV, 1, 0, src=0, dst=1)
    gsend = Node(Kind.SEND, 1, 0, src=1, dst=0, grad=True)
    grecv = Node(Kind.RECV, 0, 0, src=1, dst=0, grad=True)
    assert nx.is_path(g, [f0, send, recv, f1])
    assert nx.is_path(g, [b1, gsend, grecv, b0])
    assert not g.has_edge(f0, f1)
    assert dag.device_of(send) == 0 and dag.device_of(recv) == 1
    assert (send.name, grecv.name) == ("SEND_F0>1.0", "RECV_B1>0.0")


def test_place_leaves_unplaced_regions_one_stage_each_on_device_zero(dag0: TrainingDAG) -> None:
    dag = Place(("layer.*", "head"), stage=0, device=1).apply(dag0, 0)
    assert [(s.regions, s.device) for s in dag.stages] == [
        (("layer.0", "layer.1", "layer.2", "layer.3", "head"), 1), (("embed",), 0)]
    assert dag.placement == tuple((r, 0, 1) for r in REGIONS[1:])


def test_place_glob_matching_no_region_raises_naming_the_pattern(dag0: TrainingDAG) -> None:
    with pytest.raises(piper.DirectiveError, match=r"'block\.\*' matches no region") as e:
        Program([Place(("block.*",), stage=0, device=0)]).apply(dag0)
    assert e.value.index == 0


def test_place_of_an_already_placed_region_raises(dag0: TrainingDAG) -> None:
    prog = Program([Place(("embed", "layer.*"), stage=0, device=0),
                    Place(("layer.3", "head"), stage=1, device=1)])
    with pytest.raises(piper.DirectiveError, match=r"\['layer.3'\] are already placed") as e:
        prog.apply(dag0)
    assert e.value.index == 1


def test_place_of_one_stage_on_two_devices_raises(dag0: TrainingDAG) -> None:
    prog = Program([Place(("embed",), stage=0, device=0), Place(("head",), stage=0, device=1)])
    with pytest.raises(piper.DirectiveError, match="stage 0 is already on device 0"):
        prog.apply(dag0)


def test_split_before_place_raises_phase_order_error(dag0: TrainingDAG) -> None:
    prog = Program([Split(2), *(Place(tuple(r), stage=s, device=s)
                                for s, r in enumerate(STAGES[2]))])
    with pytest.raises(piper.DirectiveError, match="in the order Place, Split, SplitBackward, "
                       "Replicate/Shard/ShardTensor/Recompute, Order/Stream") as e:
        prog.apply(dag0)
    assert e.value.index == 1
    assert isinstance(e.value.directive, Place)


def test_place_on_a_split_dag_raises_when_applied_directly(dag0: TrainingDAG) -> None:
    split = Split(2).apply(dag0, 0)
    with pytest.raises(piper.DirectiveError, match="Place must come before"):
        Place(("embed",), stage=0, device=0).apply(split, 1)


def test_program_leaving_a_region_unplaced_lists_it(dag0: TrainingDAG) -> None:
    prog = Program([Place(("embed", "layer.0", "layer.1"), stage=0, device=0),
                    Place(("layer.2",), stage=1, device=1)])
    with pytest.raises(piper.PiperError, match="regions layer.3, head are not placed"):
        prog.apply(dag0)


# --- Split ------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("devices", [[0, 1], [0, 1, 2], [0, 0, 1]])
def test_split_multiplies_per_microbatch_nodes_and_keeps_one_update(
        dag0: TrainingDAG, devices: list[int], m: int) -> None:
    base = placed(dag0, STAGES[len(devices)], devices)
    dag = Split(m).apply(base, len(devices))
    before, after = kinds(base), kinds(dag)
    for k in (Kind.FWD, Kind.BWD, Kind.SEND, Kind.RECV):
        assert after[k] == m * before[k]
    assert after[Kind.UPDATE] == len(devices)
    assert dag.graph.number_of_edges() == m * base.graph.number_of_edges()
    assert dag.microbatches == m
    g = dag.graph
    for s in range(len(devices)):
        for mb in range(m):
            assert nx.has_path(g, Node(Kind.BWD, s, mb), Node(Kind.UPDATE, s))
            assert nx.has_path(g, Node(Kind.FWD, 0, mb), Node(Kind.FWD, s, mb))
    # microbatches are independent until the update
    if m > 1:
        assert not nx.has_path(g, Node(Kind.FWD, 0, 0), Node(Kind.BWD, 0, 1))


@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_split_rejects_non_positive_or_non_int_microbatches(dag0: TrainingDAG,
                                                            bad: object) -> None:
    with pytest.raises(piper.DirectiveError, match="microbatches must be an int >= 1"):
        Split(bad).apply(dag0, 0)  # type: ignore[arg-type]


def test_split_twice_raises(dag0: TrainingDAG) -> None:
    with pytest.raises(piper.DirectiveError, match="Split must come once") as e:
        Program([Split(2), Split(2)]).apply(dag0)
    assert e.value.index == 1


# --- Replicate --------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 4])
def test_replicate_copies_every_node_and_adds_one_all_reduce_per_stage(
        dag0: TrainingDAG, d: int, m: int) -> None:
    s = 2
    split = Split(m).apply(placed(dag0, STAGES[s], [0, 1]), 2)
    dag = Replicate(d).apply(split, 3)
    before, after = kinds(split), kinds(dag)
    for k in before:
        assert after[k] == d * before[k]
    assert after[Kind.ALL_REDUCE] == s * d
    assert dag.graph.number_of_nodes() == d * split.graph.number_of_nodes() + s * d
    assert dag.graph.number_of_edges() == d * (split.graph.number_of_edges() + s)
    assert (dag.dp, dag.world_size) == (d, 2 * d)
    g = dag.graph
    for ar in (n for n in g.nodes if n.kind is Kind.ALL_REDUCE):
        preds = sorted(g.predecessors(ar), key=lambda n: n.mb)
        assert preds == [Node(Kind.BWD, ar.stage, mb, ar.replica) for mb in range(m)]
        assert list(g.successors(ar)) == [Node(Kind.UPDATE, ar.stage, replica=ar.replica)]
    assert not any(u.kind is Kind.BWD and v.kind is Kind.UPDATE for u, v in g.edges)
    # replicas never talk to each other except through the (implicit) all-reduce group
    assert all(u.replica == v.replica for u, v in g.edges)


def test_replica_ranks_of_one_device_are_adjacent(dag0: TrainingDAG) -> None:
    dag = schedules.gpipe(STAGES[2], microbatches=1, dp=2).apply(dag0)
    ranks = {(dag.device_of(n), n.replica): dag.rank_of(n) for n in dag.graph.nodes}
    assert ranks == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}


@pytest.mark.parametrize("directive, msg", [
    (Replicate(0), "degree must be an int >= 1"),
    (Replicate(2, zero=4), "zero must be 0, 1, 2 or 3"),
    (Replicate(2, bucket_mb=0), "bucket_mb must be a number > 0 or None"),
    (Replicate(2, bucket_mb="25"), "bucket_mb must be a number > 0 or None"),
    (Replicate(2, zero=2, bucket_mb=-1), "bucket_mb must be a number > 0 or None")])
def test_replicate_rejects_bad_degree_and_unknown_zero(
        dag0: TrainingDAG, directive: Replicate, msg: str) -> None:
    with pytest.raises(piper.DirectiveError, match=msg):
        directive.apply(dag0, 0)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize(("s", "m", "d"), [(2, 1, 2), (2, 3, 2), (3, 4, 4)])
def test_replicate_zero_inserts_its_collectives(dag0: TrainingDAG, zero: int, s: int, m: int,
                                                d: int) -> None:
    """Counts per the Replicate docstring: AR per stage (ZeRO-0); RS + AG per stage
    (ZeRO-1); RS per microbatch + AG per stage (ZeRO-2); AG before every chunk and RS per
    microbatch (ZeRO-3) — all times replicas."""
    dag = schedules.gpipe(STAGES[s], microbatches=m, dp=d, zero=zero).apply(dag0)
    count = {k: len(dag.nodes(k)) for k in (Kind.ALL_REDUCE, Kind.ALL_GATHER,
                                            Kind.REDUCE_SCATTER)}
    expected = {
        0: (s * d, 0, 0),
        1: (0, s * d, s * d),
        2: (0, s * d, s * m * d),
        3: (0, 2 * s * m * d, s * m * d),
    }[zero]
    assert (count[Kind.ALL_REDUCE], count[Kind.ALL_GATHER], count[Kind.REDUCE_SCATTER]) \
        == expected
    assert dag.zero == zero
    for u in dag.nodes(Kind.UPDATE):  # every backward's gradient reaches its update
        bwds = {n for n in nx.ancestors(dag.graph, u) if n.kind is Kind.BWD
                and n.stage == u.stage}
        assert len(bwds) == m and all(b.replica == u.replica for b in bwds)
    if zero == 3:
        for n in dag.nodes(Kind.FWD) + dag.nodes(Kind.BWD):
            ag = [p for p in dag.graph.predecessors(n) if p.kind is Kind.ALL_GATHER]
            assert len(ag) == 1 and ag[0].grad == (n.kind is Kind.BWD)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("s", "m", "d"), [(2, 1, 2), (2, 3, 2), (3, 4, 4)])
def test_zero3_gathers_before_forward_and_input_backward_only(
        dag0: TrainingDAG, s: int, m: int, d: int, split: bool) -> None:
    """Per stage, microbatch and replica ZeRO-3 adds two gathers (before F, before B or I)
    and one reduce-scatter (after B or W), each with one edge in and out except the gathers'
    one out: nodes D(N + 3MS), edges D(E + 3MS) over the unreplicated DAG's N and E. W reads
    no parameters, so nothing is gathered for it."""
    base = [x for x in schedules.gpipe(STAGES[s], microbatches=m).directives
            if isinstance(x, Place | Split)] + ([piper.SplitBackward()] if split else [])
    plain = Program(base).apply(dag0)
    dag = Program([*base, Replicate(d, zero=3)]).apply(dag0)
    n, e = plain.graph.number_of_nodes(), plain.graph.number_of_edges()
    assert dag.graph.number_of_nodes() == d * (n + 3 * m * s)
    assert dag.graph.number_of_edges() == d * (e + 3 * m * s)
    g = dag.graph
    for node in dag.graph.nodes:
        ag = [p for p in g.predecessors(node) if p.kind is Kind.ALL_GATHER]
        if node.kind in (Kind.FWD, Kind.BWD, Kind.BWD_I):
            assert len(ag) == 1 and ag[0].grad == (node.kind is not Kind.FWD)
            assert (ag[0].stage, ag[0].mb, ag[0].replica) == (node.stage, node.mb, node.replica)
        else:
            assert not ag, node
        if node.kind.ends_backward:
            rs = [x for x in g.successors(node) if x.kind is Kind.REDUCE_SCATTER]
            assert len(rs) == 1 and rs[0].mb == node.mb
    assert len(dag.nodes(Kind.BWD_W)) == (d * s * m if split else 0)
    verify(dag)


def test_replicate_after_order_raises(dag0: TrainingDAG) -> None:
    ordered = Order(0, "F0.0").apply(dag0, 0)
    with pytest.raises(piper.DirectiveError, match="before Order"):
        Replicate(2).apply(ordered, 1)


# --- Order ------------------------------------------------------------------------------

def temporal(dag: TrainingDAG) -> list[tuple[Node, Node]]:
    return [(u, v) for u, v, k in dag.graph.edges(data="kind") if k == "temporal"]


@pytest.mark.parametrize("d", [1, 2])
def test_order_adds_one_temporal_edge_per_consecutive_pair_and_replica(
        dag0: TrainingDAG, d: int) -> None:
    m = 4
    split = Split(m).apply(placed(dag0, STAGES[2], [0, 1]), 2)
    base = Replicate(d).apply(split, 3)
    tasks = "F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3"  # no consecutive pair is a data edge
    dag = Order(0, tasks).apply(base, 4)
    added = temporal(dag)
    assert len(added) == (len(tasks.split()) - 1) * d
    assert dag.graph.number_of_edges() == base.graph.number_of_edges() + len(added)
    assert dag.graph.number_of_nodes() == base.graph.number_of_nodes()
    assert all(dag.graph.edges[e]["directive"] == 4 for e in added)
    for r in range(d):
        assert (Node(Kind.FWD, 0, 3, r), Node(Kind.BWD, 0, 0, r)) in added
    assert dag.ordered == (0,)


def test_order_keeps_existing_data_edges_as_data(dag0: TrainingDAG) -> None:
    base = Split(2).apply(placed(dag0, STAGES[2], [0, 1]), 2)
    dag = Order(1, "F1.0 B1.0 F1.1 B1.1").apply(base, 3)
    assert dag.graph.edges[Node(Kind.FWD, 1, 0), Node(Kind.BWD, 1, 0)]["kind"] == "data"
    assert temporal(dag) == [(Node(Kind.BWD, 1, 0), Node(Kind.FWD, 1, 1))]


def test_order_does_not_mutate_the_dag_it_rewrites(dag0: TrainingDAG) -> None:
    base = Split(2).apply(dag0, 0)
    edges = base.graph.number_of_edges()
    Order(0, "F0.0 F0.1").apply(base, 1)
    assert base.graph.number_of_edges() == edges
    assert base.ordered == ()


def test_order_against_data_dependences_raises_cycle_error(dag0: TrainingDAG) -> None:
    prog = Program([*schedules.gpipe(STAGES[2], microbatches=2).directives[:3],
                    Order(0, "B0.0 F0.0 F0.1 B0.1")])
    with pytest.raises(piper.DirectiveError, match=r"^directive 3 .*cycle") as e:
        prog.apply(dag0)
    assert e.value.index == 3
    assert "B0.0" in e.value.reason and "F0.0" in e.value.reason


def test_two_contradicting_orders_name_both_directives(dag0: TrainingDAG) -> None:
    prog = Program([Split(2), Order(0, "F0.0 F0.1"), Order(0, "F0.1 F0.0")])
    with pytest.raises(piper.DirectiveError, match=r"cycle.*Order directives \[1, 2\]"):
        prog.apply(dag0)


@pytest.mark.parametrize("tasks, msg", [
    ("F0.0 F5.0", "task F5.0 does not exist"),
    ("F0.0 F0.9", "task F0.9 does not exist"),
    ("F0.0 X0.0", "bad task name 'X0.0'"),
    ("F0.0 F0", "bad task name 'F0'"),
    ("F0.0 F1.0", "task F1.0 runs on device 1, not 0"),
    ("F0.0 B0.0 F0.0", "a task appears twice"),
    ("F0.0 U0", "list only F and B tasks"),
])
def test_order_rejects_bad_tasks(dag0: TrainingDAG, tasks: str, msg: str) -> None:
    prog = Program([*schedules.gpipe(STAGES[2], microbatches=2).directives[:3], Order(0, tasks)])
    with pytest.raises(piper.DirectiveError, match=msg) as e:
        prog.apply(dag0)
    assert e.value.index == 3


def v_dag(dag0: TrainingDAG, m: int = 4) -> TrainingDAG:
    """Four stages in a V on two devices (stages 0 and 3 on device 0), backward split."""
    ds = schedules.dualpipev([[r] for r in ("embed", "layer.0")] + [
        ["layer.1", "layer.2"], ["layer.3", "head"]], microbatches=m).directives
    return Program([d for d in ds if not isinstance(d, Order)]).apply(dag0)


def test_order_pair_runs_both_tasks_between_their_neighbours(dag0: TrainingDAG) -> None:
    base = v_dag(dag0)
    dag = Order(0, "F0.0 F0.1 F0.2 F3.0 I3.0+F0.3 W3.0").apply(base, 9)
    f, b = Node(Kind.FWD, 0, 3), Node(Kind.BWD_I, 3, 0)
    assert dag.pairs == ((f, b),)  # forward first, whatever the written order
    before, after = Node(Kind.FWD, 3, 0), Node(Kind.BWD_W, 3, 0)
    assert {(before, f), (f, after)} <= set(temporal(dag))
    assert {(before, b), (b, after)} <= set(dag.graph.edges)  # data edges already
    assert (f, b) not in dag.graph.edges and (b, f) not in dag.graph.edges
    assert Order(0, "F0.0 I3.0+F0.3").names == ["F0.0", "F0.3", "I3.0"]


@pytest.mark.parametrize("tasks, msg", [
    ("F0.0+F3.0", "joins a forward .F. and a backward"),
    ("I3.0+W3.0", "joins a forward .F. and a backward"),
    ("F0.1+I0.0", "different stages"),
    ("F0.1+I3.0+F0.2", "exactly two tasks"),
    ("F0.1+I3.0 F0.1", "a task appears twice"),
])
def test_order_rejects_bad_pairs(dag0: TrainingDAG, tasks: str, msg: str) -> None:
    with pytest.raises(piper.DirectiveError, match=msg):
        Order(0, tasks).apply(v_dag(dag0), 9)


def test_order_normalises_whitespace_and_accepts_a_task_list() -> None:
    assert Order(0, "  F0.0\tF0.1\n B0.0 ") == Order(0, "F0.0 F0.1 B0.0")
    assert Order(0, ["F0.0", "F0.1"]) == Order(0, "F0.0 F0.1")  # type: ignore[arg-type]


# --- verify ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(set(schedules.SCHEDULES) - {"dualpipev"}))  # V: own test
@pytest.mark.parametrize("pp", [1, 2, 3, 6])
@pytest.mark.parametrize("m, dp", [(1, 1), (4, 1), (3, 2)])
def test_every_schedule_dag_verifies(dag0: TrainingDAG, name: str, pp: int, m: int,
                                     dp: int) -> None:
    dag = schedules.build(name, STAGES[pp], microbatches=m, dp=dp).apply(dag0)
    verify(dag)
    assert nx.is_directed_acyclic_graph(dag.graph)
    assert (dag.pp, dag.dp, dag.microbatches, dag.world_size) == (pp, dp, m, pp * dp)
    assert dag.ordered == tuple(range(pp))
    # each device's order is total: its F/B tasks of one replica lie on a single path
    for s in range(pp):
        chain = [n for n in dag.graph.nodes if n.stage == s and n.replica == 0
                 and n.kind in (Kind.FWD, Kind.BWD)]
        order = [n for n in nx.topological_sort(dag.graph) if n in set(chain)]
        assert all(nx.has_path(dag.graph, a, b) for a, b in itertools.pairwise(order))


def test_verify_rejects_a_forward_without_backward(dag0: TrainingDAG) -> None:
    dag = schedules.one_f_one_b(STAGES[2], microbatches=2, dp=2).apply(dag0)
    g = dag.graph.copy()
    g.remove_node(Node(Kind.BWD, 1, 1, 1))
    with pytest.raises(VerifyError, match=r"F1\.1@r1 has no backward"):
        verify(dag.with_graph(g))
    verify(dag)  # the original is untouched


def test_verify_rejects_a_backward_that_reaches_no_update(dag0: TrainingDAG) -> None:
    dag = schedules.gpipe(STAGES[2], microbatches=2).apply(dag0)
    g = dag.graph.copy()
    g.remove_node(Node(Kind.UPDATE, 0))
    with pytest.raises(VerifyError) as e:
        verify(dag.with_graph(g))
    assert "B0.0 reaches no update" in str(e.value)
    assert "expected 2 updates, got 1" in str(e.value)


def test_verify_rejects_a_cycle(dag0: TrainingDAG) -> None:
    g = dag0.graph.copy()
    g.add_edge(Node(Kind.UPDATE, 0), Node(Kind.FWD, 0, 0), kind="temporal")
    with pytest.raises(VerifyError, match="cycle"):
        verify(dag0.with_graph(g))


def test_verify_rejects_a_send_without_its_recv(dag0: TrainingDAG) -> None:
    dag = placed(dag0, STAGES[2], [0, 1])
    g = dag.graph.copy()
    g.remove_node(Node(Kind.RECV, 1, 0, src=0, dst=1))
    with pytest.raises(VerifyError, match=r"SEND_F0>1\.0 must feed exactly one RECV"):
        verify(dag.with_graph(g))


def test_verify_rejects_stages_that_do_not_cover_every_region(dag0: TrainingDAG) -> None:
    bad = dag0.with_graph(dag0.graph, stages=dag0.stages[:-1])
    with pytest.raises(VerifyError, match=r"missing \['head'\]"):
        verify(bad)


def test_place_on_device_one_only_fails_verify_for_the_device_gap(dag0: TrainingDAG) -> None:
    with pytest.raises(VerifyError, match=r"devices must be 0\.\.0, got \[1\]"):
        Program([Place(REGIONS, stage=0, device=1)]).apply(dag0)


# --- DAG helpers ------------------------------------------------------------------------

def test_node_names_are_short_and_printable() -> None:
    assert Node(Kind.FWD, 0, 3).name == "F0.3"
    assert Node(Kind.UPDATE, 1).name == "U1"
    assert Node(Kind.ALL_REDUCE, 2, replica=1).name == "AR2"
    assert repr(Node(Kind.BWD, 1, 0, replica=2)) == "B1.0@r2"
    assert Node(Kind.RECV, 0, 2, src=1, dst=0, grad=True).name == "RECV_B1>0.2"


def test_nodes_of_one_kind_are_sorted_by_stage_and_microbatch(dag0: TrainingDAG) -> None:
    dag = Split(2).apply(dag0, 0)
    fwd = dag.nodes(Kind.FWD)
    assert [n.name for n in fwd[:4]] == ["F0.0", "F0.1", "F1.0", "F1.1"]
    assert len(fwd) == 12


def test_all_nodes_can_be_listed_without_a_kind_filter(dag0: TrainingDAG) -> None:
    # Node sorts by kind first, so Kind must be orderable (a plain Enum is not)
    nodes = dag0.nodes()
    assert len(nodes) == 3 * len(REGIONS)
    assert nodes == sorted(nodes)
    assert {n.kind for n in nodes[:len(REGIONS)]} == {Kind.FWD}
