"""The rank layout: TP innermost, expert groups inside a device's replicas."""

from __future__ import annotations

from runtime.lowering.mesh import Mesh


def test_physical_ranks_put_tensor_parallel_peers_next_to_each_other() -> None:
    m = Mesh(pp=2, dp=2, tp=2)
    assert m.world_size == 8
    assert [m.split(p) for p in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert m.tp_group(3) == (6, 7)
    assert m.lift((0, 1), 1) == (1, 3), "a DP group of logical ranks, as TP index 1 sees it"


def test_expert_groups_split_a_devices_replicas() -> None:
    m = Mesh(pp=2, dp=4, ep=2)
    assert [m.ep_group(L) for L in (4, 5, 6, 7)] == [(4, 5), (4, 5), (6, 7), (6, 7)]
    assert [m.expert_dp_group(L) for L in (4, 5, 6, 7)] == [(4, 6), (5, 7), (4, 6), (5, 7)]


def test_groups_are_every_lifted_group_once_in_one_order() -> None:
    m = Mesh(pp=1, dp=4, tp=1, ep=2)
    assert m.groups(((0, 1, 2, 3),)) == [(0, 1), (0, 1, 2, 3), (0, 2), (1, 3), (2, 3)]
    t = Mesh(pp=1, dp=2, tp=2)
    assert t.groups(((0, 1),)) == [(0, 1), (0, 2), (1, 3), (2, 3)]


def test_context_parallel_ranks_sit_between_tensor_and_data_parallel_ones() -> None:
    m = Mesh(pp=1, dp=2, tp=2, cp=2)  # physical ((L * cp) + c) * tp + t
    assert m.world_size == 8 and m.inner == 4
    assert m.split(6) == (1, 2), "logical rank 1, context index 1, tensor index 0"
    assert m.tp_group(1, 2) == (6, 7) and m.cp_group(1, 3) == (5, 7)
    # replicas' gradients are summed over every context-parallel rank of equal t
    assert m.dp_lift((0, 1), 1) == (1, 3, 5, 7) and m.dp_lift((0, 1), 2) == (0, 2, 4, 6)
    assert m.groups(((0, 1),)) == [(0, 1), (0, 2), (0, 2, 4, 6), (1, 3), (1, 3, 5, 7),
                                   (2, 3), (4, 5), (4, 6), (5, 7), (6, 7)]


def test_an_expert_mesh_spans_the_tensor_parallel_ranks_of_its_replicas() -> None:
    """Megatron's expert mesh, ep=4 over tp=2: two replicas' four processes exchange tokens,
    in the order of the experts they hold (replica-major: `ModelSharding.ep_rank`); the
    processes holding the same experts are those of equal place in the other group."""
    from piper.sharding import ModelSharding

    m = Mesh(pp=1, dp=4, tp=2, ep=2, ep_tp=True)
    assert m.ep_size == 4
    assert m.ep_processes(1, 1) == (0, 1, 2, 3) and m.ep_processes(2, 0) == (4, 5, 6, 7)
    sh = ModelSharding(tp=2, ep=4, ep_tp=True)
    assert sh.ep_replicas == 2
    held = {(r, t): sh.ep_rank(r, t) for r in range(4) for t in range(2)}
    assert [held[(r, t)] for r in (0, 1) for t in (0, 1)] == [0, 1, 2, 3]
    assert held[(2, 1)] == held[(0, 1)]
    assert m.lift(m.expert_dp_group(2), 1) == (1, 5), "replicas 0 and 2 at TP index 1"
    assert (0, 1, 2, 3) in m.groups(((0, 1, 2, 3),)) and (1, 5) in m.groups(((0, 1, 2, 3),))
