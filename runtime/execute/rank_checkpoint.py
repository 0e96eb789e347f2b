"""A rank's part of a checkpoint: what it saves and loads, and which of its parameter copies
count (`runtime.train.checkpoint` writes them under the model's own names). A part of
`RankExecutor` (`runtime.execute.executor`), which owns the state these methods read."""

from __future__ import annotations

from typing import Any


class Checkpointing:
    """Save, load, and ownership of this rank's parameter copies."""

    def checkpoint_state(self, saving: bool) -> dict[str, Any]:
        """This rank's part of a checkpoint (`runtime.train.checkpoint`)."""
        from runtime.train.checkpoint import rank_state

        buffers = self.buffers if self.rank == 0 or not saving else {}
        return rank_state(self.held, self.optim, buffers, saving)

    def save(self, folder: str) -> None:
        from runtime.train.checkpoint import save

        save(self.checkpoint_state(saving=True), folder)

    def load(self, folder: str) -> None:
        """Parameters, optimizer state and buffers from a checkpoint of any layout."""
        from runtime.train.checkpoint import load, prepare_optimizer_state

        prepare_optimizer_state(self.held, self.optim, folder)
        load(self.checkpoint_state(saving=False), folder)
        for sh in self.sharded.values():
            if sh.zero < 3 and any(u.separate for u in sh.units):
                sh.materialize()  # bf16 buffers from the fp32 master shards just loaded

    def _owner(self, key: Any, name: str) -> bool:
        """Whether this rank's copy of parameter `name` (of optimizer `key`) is the one that
        counts: of a tensor-parallel replicated one, TP rank 0's; of a data-parallel copy,
        replica 0's (context-parallel index 0's) (experts: of their expert-data-parallel group); a ZeRO shard is this
        rank's alone; a tied weight counts on its group's first stage."""
        if not (self.slicing.tp_split(name) or self.tp_rank == 0):
            return False
        if key in self.sharded:
            return True
        if isinstance(key, tuple) and key[0] == "experts":
            return self.rp.replica < self.plan.sharding.ep_replicas
        if isinstance(key, tuple) and key[0] == "tied" and name not in self.tie_owner:
            return False
        return self.rp.replica == 0 and self.cp_rank == 0  # context-parallel copies alike
