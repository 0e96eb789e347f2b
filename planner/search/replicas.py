"""Which data-parallel replicas a simulation must hold: one of each kind.

Replicas of a pipeline run the same tasks on equal shares of the batch, and meet only in
collectives whose groups span them all, so on a cluster of identical devices two replicas
take the same time whenever their links are alike: the same pipeline neighbours on the same
or other nodes, the same tensor- and expert-parallel groups within or across nodes. The
simulator then runs one replica of each kind (`TrainingDAG.kept`) and prices every
collective with its whole group, which gives the step time of the whole cluster at a cost
that does not grow with the number of replicas: a 16,384-GPU plan with 128 replicas is
simulated as one or two.

Where ranks share a node's cores (`ClusterSpec.cores_per_node`, CPU ranks), how many of them
compute at once changes each one's speed, so every replica is kept.
"""

from __future__ import annotations

from cost_models.cluster import ClusterSpec
from runtime.lowering.mesh import Mesh
from runtime.lowering.plan import Plan


def representative_replicas(mesh: Mesh, cluster: ClusterSpec) -> tuple[int, ...]:
    """The first replica of each kind, in order (replica 0 always among them)."""
    return tuple(replica_kinds(mesh, cluster))


def replica_kinds(mesh: Mesh, cluster: ClusterSpec) -> dict[int, tuple[int, ...]]:
    """First replica of each kind -> every replica of that kind (itself included)."""
    if cluster.cores_per_node is not None or mesh.dp == 1:
        return {r: (r,) for r in range(mesh.dp)}
    first: dict[tuple, int] = {}
    out: dict[int, list[int]] = {}
    for r in range(mesh.dp):
        rep = first.setdefault(_signature(mesh, cluster, r), r)
        out.setdefault(rep, []).append(r)
    return {rep: tuple(rs) for rep, rs in out.items()}


def _signature(mesh: Mesh, cluster: ClusterSpec, replica: int) -> tuple:
    """What prices replica `replica`'s tasks: per pipeline device, its node relative to the
    replica's first device, how many nodes its tensor-parallel group spans, and where the
    members of its expert-parallel group sit relative to it."""
    def node(logical: int, t: int = 0) -> int:
        return cluster.node_of(mesh.physical(logical, t))

    first = node(replica)
    out = []
    for d in range(mesh.pp):
        L = d * mesh.dp + replica
        here = node(L)
        tp_span = node(L, mesh.inner - 1) - here  # its context- and tensor-parallel ranks
        ep = tuple(cluster.node_of(p) - here for p in mesh.ep_processes(L, 0)
                   ) if mesh.ep_size > 1 else ()
        out.append((here - first, tp_span, ep))
    return tuple(out)


def stands_for(plan: Plan, cluster: ClusterSpec) -> dict[int, tuple[int, ...]]:
    """Each logical rank of `plan` (a simulation view keeps one replica of each kind) ->
    the processes whose step it shows: its context- and tensor-parallel ranks, and those of every
    replica of its kind the view left out."""
    mesh = plan.mesh
    kinds = ({r: (r,) for r in range(mesh.dp)} if plan.complete
             else replica_kinds(mesh, cluster))
    return {rp.rank: tuple(sorted(mesh.physical(rp.device * mesh.dp + r, t)
                                  for r in kinds.get(rp.replica, (rp.replica,))
                                  for t in range(mesh.inner)))
            for rp in plan.ranks}
