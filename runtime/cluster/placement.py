"""Which node each rank runs on: the map the cost model priced, held by placement groups.

The planner prices ranks as filling nodes in order (`ClusterSpec.node_of`: rank // per
node), and the mesh keeps tensor-parallel groups innermost (`runtime.lowering.mesh`), so ranks
`[k * per_node, (k + 1) * per_node)` must share a node. Each such block is one placement
group of `STRICT_PACK` (one bundle per rank, all on one node), reserved for the whole job
before any worker starts: the job either gets the layout it was planned for, or is told at
once that the cluster cannot give it (never half started, never waiting forever).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from piper.errors import PiperError

SHARED_CPU = 0.001
"""A CPU rank's reservation on a Ray this machine runs: ranks share its cores (as many as
its memory holds, `launcher.check_workers`), but a bundle cannot reserve nothing."""
READY_S = 60.0  # how long the cluster gets to find room for every block


def blocks(world: int, per_node: int) -> list[range]:
    """Ranks that share a node, in order."""
    return [range(a, min(a + per_node, world)) for a in range(0, world, per_node)]


def rank_resources(device: str, joined: bool, world: int = 1) -> dict[str, float]:
    """What one rank reserves: a GPU; or on a cluster joined that has a CPU for every rank,
    one CPU (a CPU rank keeps a core busy, and CPU counts are what spread CPU ranks over
    nodes); else a token share (ranks share the cores, as on one machine)."""
    if device == "cuda":
        return {"GPU": 1.0}
    whole = joined and ray.cluster_resources().get("CPU", 0) >= world
    return {"CPU": 1.0 if whole else SHARED_CPU}


def default_per_node(world: int, resources: dict[str, float], joined: bool) -> int:
    """Ranks per node when the user did not say: on a cluster joined, as many as its
    smallest node holds (GPUs, or CPUs for CPU ranks); else all on this machine."""
    if not joined:
        return world
    key = "GPU" if "GPU" in resources else "CPU"
    sizes = [int(n["Resources"][key]) for n in ray.nodes()
             if n.get("Alive") and n.get("Resources", {}).get(key, 0) >= 1]
    return max(1, min(sizes)) if sizes else world


@dataclass
class Placement:
    """The job's placement groups; `options(rank)` puts a rank's actor in its bundle."""

    groups: list[Any]
    per_node: int

    def options(self, rank: int) -> dict[str, Any]:
        block, index = divmod(rank, self.per_node)
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.groups[block], placement_group_bundle_index=index)}

    def remove(self) -> None:
        for g in self.groups:
            with contextlib.suppress(Exception):  # Ray down, or the group already gone
                remove_placement_group(g)
        self.groups = []


def place(world: int, per_node: int, resources: dict[str, float],
          ready_s: float = READY_S) -> Placement:
    """Reserve one `STRICT_PACK` group per block of `per_node` ranks; a cluster without
    room for them within `ready_s` is bad input (exit 2), saying what it has."""
    if per_node < 1:
        raise PiperError(f"--gpus-per-node must be >= 1, got {per_node}")
    groups = [placement_group([dict(resources) for _ in b], strategy="STRICT_PACK")
              for b in blocks(world, per_node)]
    out = Placement(groups, per_node)
    end = time.monotonic() + ready_s
    try:
        for g in groups:
            left = end - time.monotonic()
            ready, _ = ray.wait([g.ready()], timeout=max(0.0, left))
            if not ready:
                raise PiperError(
                    f"the Ray cluster has no room for {world} ranks in blocks of {per_node} "
                    f"per node ({_need(resources, per_node)} each) within {ready_s:.0f} s; "
                    f"its nodes: {_nodes()}: change --gpus-per-node, or add nodes")
    except BaseException:
        out.remove()
        raise
    return out


def _need(resources: dict[str, float], n: int) -> str:
    return ", ".join(f"{v * n:g} {k}" for k, v in resources.items())


def _nodes() -> str:
    out = []
    for n in ray.nodes():
        if n.get("Alive"):
            r = n.get("Resources", {})
            have = ", ".join(f"{r[k]:g} {k}" for k in ("CPU", "GPU") if k in r)
            out.append(f"{n.get('NodeManagerAddress')} ({have})")
    return "; ".join(out) or "none alive"
