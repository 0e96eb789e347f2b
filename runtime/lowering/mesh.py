"""Where each rank of a Plan runs: logical ranks (pipeline device x replica) times TP.

A Plan has one RankPlan per logical rank `L = device * dp + replica`. Tensor parallelism
makes each logical rank `tp` processes running the same tasks on their slices: physical rank
`L * tp + t` (Megatron's layout, TP innermost so it stays inside a node). Messages and
data-parallel collectives go between processes of equal `t`; expert parallelism groups
consecutive replicas of one device.
"""

from __future__ import annotations

from dataclasses import dataclass

Group = tuple[int, ...]


@dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def physical(self, logical: int, t: int) -> int:
        return logical * self.tp + t

    def split(self, physical: int) -> tuple[int, int]:
        """Physical rank -> (logical rank, tensor-parallel index)."""
        return divmod(physical, self.tp)

    def lift(self, group: Group, t: int) -> Group:
        """A group of logical ranks as the processes of tensor-parallel index `t`."""
        return tuple(self.physical(g, t) for g in group)

    def tp_group(self, logical: int) -> Group:
        return tuple(self.physical(logical, t) for t in range(self.tp))

    def ep_group(self, logical: int) -> Group:
        """Logical ranks sharing one set of experts: `ep` consecutive replicas of a device."""
        device, replica = divmod(logical, self.dp)
        first = device * self.dp + replica - replica % self.ep
        return tuple(range(first, first + self.ep))

    def expert_dp_group(self, logical: int) -> Group:
        """Logical ranks holding the same experts: one per EP group of the device."""
        device, replica = divmod(logical, self.dp)
        return tuple(device * self.dp + r for r in range(replica % self.ep, self.dp, self.ep))

    def p2p_links(self, logical: set[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
        """(sender, receiver, grad) processes of every P2P link, in one creation order."""
        return sorted({(self.physical(a, t), self.physical(b, t), g) for a, b, g in logical
                       for t in range(self.tp)})

    def groups(self, logical_groups: tuple[Group, ...]) -> list[Group]:
        """Every process group a run needs, in one order all ranks create them in."""
        out: set[Group] = {self.lift(g, t) for g in logical_groups for t in range(self.tp)}
        out.update(self.in_graph_groups())
        for L in range(self.pp * self.dp):
            if self.ep > 1 and self.dp > self.ep:
                out.update(self.lift(self.expert_dp_group(L), t) for t in range(self.tp))
        return sorted(out)

    def in_graph_groups(self) -> list[Group]:
        """The groups of collectives inside chunks: tensor-parallel, and expert-parallel
        (lifted per tensor-parallel index)."""
        out: set[Group] = set()
        for L in range(self.pp * self.dp):
            if self.tp > 1:
                out.add(self.tp_group(L))
            if self.ep > 1:
                out.update(self.lift(self.ep_group(L), t) for t in range(self.tp))
        return sorted(out)
