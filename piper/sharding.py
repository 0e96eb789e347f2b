"""How a model's layers are split across ranks inside one chunk: tensor and expert parallelism.

`ModelSharding` is what `ShardTensor` and `Shard` leave in the DAG and the Plan carries to
workers. Applying it rewrites an `nn.Module` in place: on meta before capture (so the
stage graphs have local shapes and the in-graph collectives) and on the real, seeded model
in each worker (so every rank keeps exactly its slice of the single-device parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from piper.moe import shard_experts
from piper.moe_capacity import limit_capacity
from piper.tensor_parallel import shard_linears


@dataclass(frozen=True)
class ModelSharding:
    tp: int = 1
    tp_plan: tuple[tuple[str, str], ...] = ()  # (module glob, style)
    ep: int = 1
    experts: tuple[str, ...] = ()  # names of the `Experts` modules EP splits
    sp: bool = False
    """Sequence parallelism (Megatron): between tensor-parallel blocks each rank holds 1/tp of
    the sequence; gathers and reduce-scatters replace the f/g all-reduces."""
    cp: int = 1
    """Context parallelism: each of `cp` ranks holds its share of every sequence through the
    whole model (`piper.context_parallel`); the modules are not changed, the capture is."""
    cp_mode: str = "ring"  # how attention exchanges keys and values: ring or all_gather
    etp: int = 1
    """Expert tensor parallelism (Megatron's): 1, each TP rank holds its experts whole, or
    `tp`, each holds 1/tp of every expert's hidden features (`piper.moe.shard_experts`)."""
    expert_cuts: tuple[tuple[str, int, int], ...] = ()
    """With etp > 1: (parameter, hidden dimension, halves) of every expert weight it cuts,
    so checkpoints know each rank's piece without the module."""
    ep_tp: bool = False
    """Megatron's expert mesh: each EP group spans the tensor-parallel ranks of its replicas
    too (ep = replicas x tp), so each TP rank holds other experts and routes its own share
    of the tokens (`piper.moe.routed_forward`)."""
    capacity: float = 0.0
    """Expert capacity factor per sequence of `capacity_group` tokens; 0: dropless
    (`piper.moe_capacity`)."""
    capacity_group: int = 0

    @property
    def ep_replicas(self) -> int:
        """Data-parallel replicas one EP group spans."""
        return self.ep // self.tp if self.ep_tp else self.ep

    def ep_rank(self, replica: int, tp_rank: int) -> int:
        """Which 1/ep of the experts the process of `replica` and `tp_rank` holds."""
        r = replica % self.ep_replicas
        return r * self.tp + tp_rank if self.ep_tp else r

    @property
    def trivial(self) -> bool:
        return (self.tp == 1 and self.ep == 1 and self.cp == 1 and self.etp == 1
                and not self.capacity)

    def describe(self) -> str:
        cp = f" cp={self.cp} {self.cp_mode}" if self.cp > 1 else ""
        etp = (f" etp={self.etp}" if self.etp > 1 else "") + (" over tp" if self.ep_tp else "")
        cap = f" capacity={self.capacity:g}" if self.capacity else ""
        return f"tp={self.tp}{' sp' if self.sp else ''} ep={self.ep}{etp}{cap}{cp}"

    def apply(self, model: nn.Module, tp_rank: int, ep_rank: int) -> nn.Module:
        # experts first: once cut by expert tensor parallelism they are TP shards, which
        # sequence parallelism must not treat as replicated
        shard_experts(model, self.experts, self.ep, ep_rank, self.etp, tp_rank, self.sp,
                      spans_tp=self.tp if self.ep_tp else 1)
        shard_linears(model, self.tp_plan, self.tp, tp_rank, self.sp)
        if self.capacity:
            limit_capacity(model, self.experts, self.capacity, self.capacity_group)
        return model
