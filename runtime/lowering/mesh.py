"""Where each rank of a Plan runs: logical ranks (pipeline device x replica) times CP x TP.

A Plan has one RankPlan per logical rank `L = device * dp + replica`. Context and tensor
parallelism make each logical rank `cp * tp` processes running the same tasks, each on its
share of the sequence and its slice of the layers: physical rank `(L * cp + c) * tp + t`
(Megatron's order, TP innermost so it stays inside a node, CP next). The process's *inner
index* `i = c * tp + t` says which. Messages go between processes of equal inner index;
data-parallel collectives run over dp x cp processes of equal `t` (context-parallel ranks
saw different tokens, so their gradients are summed as replicas' are); expert parallelism
groups consecutive replicas of one device.
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
    """Data-parallel replicas an EP group spans."""
    cp: int = 1
    ep_tp: bool = False
    """An EP group also spans the tensor-parallel ranks of its replicas (Megatron's expert
    mesh; `ModelSharding.ep_tp`)."""

    @property
    def ep_size(self) -> int:
        """Processes one EP group spans."""
        return self.ep * (self.tp if self.ep_tp else 1)

    def ep_processes(self, logical: int, i: int) -> Group:
        """The processes exchanging tokens with logical rank `logical`'s process of inner
        index `i`, in the order of the experts they hold (`ModelSharding.ep_rank`)."""
        if not self.ep_tp:
            return self.lift(self.ep_group(logical), i)
        c = i // self.tp
        return tuple(self.physical(g, c * self.tp + t) for g in self.ep_group(logical)
                     for t in range(self.tp))

    @property
    def inner(self) -> int:
        """Processes per logical rank."""
        return self.cp * self.tp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.inner

    def physical(self, logical: int, i: int) -> int:
        return logical * self.inner + i

    def split(self, physical: int) -> tuple[int, int]:
        """Physical rank -> (logical rank, inner index)."""
        return divmod(physical, self.inner)

    def lift(self, group: Group, i: int) -> Group:
        """A group of logical ranks as the processes of inner index `i`."""
        return tuple(self.physical(g, i) for g in group)

    def dp_lift(self, group: Group, i: int) -> Group:
        """A data-parallel group of logical ranks as the processes its collectives run over:
        every context-parallel index of each, at the tensor-parallel index of `i`; a
        process's place in it is `replica * cp + c`."""
        t = i % self.tp
        return tuple(self.physical(g, c * self.tp + t) for g in group for c in range(self.cp))

    def tp_group(self, logical: int, i: int = 0) -> Group:
        first = i - i % self.tp
        return tuple(self.physical(logical, first + t) for t in range(self.tp))

    def cp_group(self, logical: int, i: int = 0) -> Group:
        t = i % self.tp
        return tuple(self.physical(logical, c * self.tp + t) for c in range(self.cp))

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
        return sorted({(self.physical(a, i), self.physical(b, i), g) for a, b, g in logical
                       for i in range(self.inner)})

    def groups(self, logical_groups: tuple[Group, ...]) -> list[Group]:
        """Every process group a run needs, in one order all ranks create them in."""
        out: set[Group] = {self.dp_lift(g, t) for g in logical_groups for t in range(self.tp)}
        out.update(self.in_graph_groups())
        for L in range(self.pp * self.dp):
            if self.ep_size > 1 and self.dp > self.ep:
                out.update(self.lift(self.expert_dp_group(L), i) for i in range(self.inner))
        return sorted(out)

    def in_graph_groups(self) -> list[Group]:
        """The groups of collectives inside chunks: tensor-parallel (per context-parallel
        index), context-parallel (per tensor-parallel index) and expert-parallel (per inner
        index)."""
        out: set[Group] = set()
        for L in range(self.pp * self.dp):
            for i in range(self.inner):
                if self.tp > 1:
                    out.add(self.tp_group(L, i))
                if self.cp > 1:
                    out.add(self.cp_group(L, i))
                if self.ep_size > 1:
                    out.add(self.ep_processes(L, i))
        return sorted(out)
