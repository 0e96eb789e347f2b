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
    `degree` divides; the data-parallel degree (Replicate) a multiple of `degree`.
    Rewrites: no node changes. Every group of `degree` consecutive replicas of a device
    shares one set of experts, E/degree each: inside the chunk an all-to-all sends each
    token to the rank holding its expert and another brings the result back. Expert
    gradients are then already summed over the group; among the dp/degree groups they are
    all-reduced like any replicated parameter.
    """

    regions: tuple[str, ...]
    _: KW_ONLY
    degree: int
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
        if dag.sharding.ep != 1 or dag.ordered:
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
        sharding = replace(dag.sharding, ep=self.degree, experts=tuple(names))
        return dag.with_graph(dag.graph, sharding=sharding)
