"""dp × pp × microbatches × schedule, with stage boundaries balanced by region cost."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from piper import schedules
from piper.program import Program
from search_spaces.base import Infeasible, SearchSpace, TrialLike
from search_spaces.partition import balanced_stages


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class PipelineSpace(SearchSpace):
    """Pipeline × data parallelism over `gpus` devices for a global batch of `batch_size`.

    `region_costs[i]` is region i's relative compute cost (forward FLOPs); stages are cut to
    balance it. pp counts pipeline ranks (one stage per rank in this space).
    """

    regions: tuple[str, ...]
    region_costs: tuple[float, ...]
    gpus: int
    batch_size: int
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    max_microbatches: int = 64

    def grid(self) -> Mapping[str, Sequence[Any]]:
        pps = [p for p in divisors(self.gpus) if p <= len(self.regions)]
        mbs = [m for m in divisors(self.batch_size) if m <= self.max_microbatches]
        return {"pp": pps, "microbatches": mbs, "schedule": list(self.schedules)}

    def suggest(self, trial: TrialLike) -> Program:
        g = self.grid()
        return self.program(**{k: trial.suggest_categorical(k, v) for k, v in g.items()})

    def program(self, **params: Any) -> Program:
        pp, m, sched = params["pp"], params["microbatches"], params["schedule"]
        if pp > len(self.regions):
            raise Infeasible(f"pp={pp} exceeds the {len(self.regions)} regions")
        if self.gpus % pp:
            raise Infeasible(f"pp={pp} does not divide {self.gpus} devices")
        dp = self.gpus // pp
        if self.batch_size % (dp * m):
            raise Infeasible(f"dp={dp} x microbatches={m} does not divide batch "
                             f"{self.batch_size}")
        return schedules.build(sched, self.stages(pp), microbatches=m, dp=dp)

    def stages(self, pp: int) -> list[list[str]]:
        return [[self.regions[i] for i in r] for r in balanced_stages(self.region_costs, pp)]
