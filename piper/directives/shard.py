"""Shard: expert parallelism — the experts of the named regions split over data replicas."""

from __future__ import annotations

import fnmatch
from dataclasses import KW_ONLY, dataclass, replace

from piper.dag import TrainingDAG
from piper.directives.base import Directive
from piper.errors import DirectiveError


@dataclass(frozen=True, repr=False)
class Shard(Directive):
    """Split the routed experts of `regions` (names or globs) `degree` ways.

    Requires: once, before Order; the regions hold routed experts modules (`piper.Experts`,
    a Hugging Face model's experts: `piper.hf_experts`) whose expert count
    `degree` divides; the data-parallel degree (Replicate) a multiple of `degree` (of
    degree/tp with `over_tp`).
    Rewrites: no node changes. Every group of `degree` consecutive replicas of a device
    shares one set of experts, E/degree each: inside the chunk an all-to-all sends each
    token to the rank holding its expert and another brings the result back. Expert
    gradients are then already summed over the group; among the dp/degree groups they are
    all-reduced like any replicated parameter.
    """

    regions: tuple[str, ...]
    _: KW_ONLY
    degree: int
    tensor: int = 1
    """Expert tensor parallelism (Megatron's): 1, each tensor-parallel rank holds its
    experts whole; or the ShardTensor degree before this directive, each holds 1/tensor of
    every expert's hidden features and the experts' rows are summed over the TP group."""
    over_tp: bool = False
    """Megatron's expert mesh: each group of `degree` ranks spans degree/tp replicas and
    all their tensor-parallel ranks (ShardTensor before this directive), which hold
    different experts and route their own tokens; with tensor=1."""
    capacity: float = 0.0
    """An expert capacity factor (GShard, Switch, Megatron's --moe-expert-capacity-factor):
    0, dropless; else each expert keeps at most ceil(capacity x group x k / E) of each
    sequence's routed rows, the highest-gated, and drops the rest (`piper.moe_capacity`).
    Per sequence, so every strategy drops the same rows; not with sequence parallelism."""
    group: int = 0
    """Tokens per capacity group: the model's sequence length (with `capacity`)."""
    phase = 3

    def __post_init__(self) -> None:
        if isinstance(self.regions, str):
            object.__setattr__(self, "regions", (self.regions,))
        object.__setattr__(self, "regions", tuple(self.regions))

    def _fmt(self, name: str, value: object) -> str:
        if name == "regions" and isinstance(value, tuple) and len(value) == 1:
            return repr(value[0])  # Shard("experts.*", ...) reads better than a 1-tuple
        return repr(value)

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if not isinstance(self.degree, int) or self.degree < 1:
            raise DirectiveError(index, self, "degree must be an int >= 1")
        if dag.sharding.experts or dag.ordered:
            raise DirectiveError(index, self, "Shard must come once, before Order")
        if dag.sharding.cp != 1:
            raise DirectiveError(index, self, "expert parallelism with context parallelism "
                                 "(ShardSequence) is not supported")
        experts = dag.model.experts
        names: list[str] = []
        for pat in self.regions:
            hits = [e for e in experts if fnmatch.fnmatchcase(e[2], pat)]
            if not hits:
                held = sorted({e[2] for e in experts})
                raise DirectiveError(index, self, f"{pat!r} matches no region holding "
                                     f"routed experts; those are {', '.join(held) or 'none'}")
            for module, count, _ in hits:
                if count % self.degree:
                    raise DirectiveError(index, self, f"{module} has {count} experts, not "
                                         f"divisible by ep={self.degree}")
                names += [module] if module not in names else []
        cuts = self._cuts(dag, index, names)
        if self.over_tp:
            tp = dag.sharding.tp
            if tp == 1 or self.degree % tp or self.tensor != 1:
                raise DirectiveError(index, self, f"over_tp spreads the experts over the "
                                     f"tensor-parallel ranks too: it needs ShardTensor before "
                                     f"it, a degree divisible by tp={tp} and tensor=1")
        self._check_capacity(dag, index)
        sharding = replace(dag.sharding, ep=self.degree, experts=tuple(names),
                           etp=self.tensor, expert_cuts=cuts, ep_tp=self.over_tp,
                           capacity=float(self.capacity), capacity_group=int(self.group))
        return dag.with_graph(dag.graph, sharding=sharding)

    def _check_capacity(self, dag: TrainingDAG, index: int) -> None:
        if not isinstance(self.capacity, (int, float)) or self.capacity < 0:
            raise DirectiveError(index, self, "capacity must be a number >= 0 (0: dropless)")
        if not self.capacity:
            return
        if not isinstance(self.group, int) or self.group < 1:
            raise DirectiveError(index, self, "capacity needs group, the tokens of one "
                                 "sequence (an int >= 1)")
        if dag.sharding.sp:
            raise DirectiveError(index, self, "a capacity is counted per sequence, which "
                                 "sequence parallelism splits over the tensor-parallel "
                                 "ranks: not supported together")

    def _cuts(self, dag: TrainingDAG, index: int, names: list[str]
              ) -> tuple[tuple[str, int, int], ...]:
        """The expert weights `tensor` cuts, checked against the model."""
        if not isinstance(self.tensor, int) or self.tensor < 1:
            raise DirectiveError(index, self, "tensor must be an int >= 1")
        if self.tensor == 1:
            return ()
        if self.tensor != dag.sharding.tp:
            raise DirectiveError(index, self, f"tensor={self.tensor} must be 1 or the "
                                 f"tensor-parallel degree (ShardTensor before it: "
                                 f"tp={dag.sharding.tp})")
        out = []
        for module in names:
            cuts = [c for c in dag.model.expert_cuts if c[0].rpartition(".")[0] == module]
            if not cuts:
                raise DirectiveError(index, self, f"{module}: experts with biases cannot be "
                                     "split by expert tensor parallelism")
            for param, dim, halves, size in cuts:
                if size % (halves * self.tensor):
                    raise DirectiveError(index, self, f"{param}: hidden size "
                                         f"{size // halves} is not divisible by "
                                         f"tensor={self.tensor}")
                out.append((param, dim, halves))
        return tuple(out)
