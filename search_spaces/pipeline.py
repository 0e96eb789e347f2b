"""dp × pp × ZeRO × microbatches × schedule, with stage boundaries balanced by region cost."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from piper import schedules
from piper.program import Program
from search_spaces.base import Infeasible, SearchSpace, TrialLike
from search_spaces.partition import balanced_stages

VIRTUAL = {"interleaved-1f1b": 2, "dualpipev": 2}  # stages per pipeline rank
SPLIT_BACKWARD = ("zb1p", "dualpipev")
ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipev")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class PipelineSpace(SearchSpace):
    """Pipeline × data parallelism over `gpus` devices for a global batch of `batch_size`.

    `region_costs[i]` is region i's relative compute cost (forward FLOPs); stages are cut to
    balance it. pp counts pipeline ranks; interleaved-1f1b and dualpipev put two stages on
    each. `zeros` are the ZeRO stages to try for the data-parallel replicas.
    """

    regions: tuple[str, ...]
    region_costs: tuple[float, ...]
    gpus: int
    batch_size: int
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    max_microbatches: int = 64
    zeros: tuple[int, ...] = (0,)

    def grid(self) -> Mapping[str, Sequence[Any]]:
        pps = [p for p in divisors(self.gpus) if p <= len(self.regions)]
        mbs = [m for m in divisors(self.batch_size) if m <= self.max_microbatches]
        return {"pp": pps, "microbatches": mbs, "schedule": list(self.schedules),
                "zero": list(self.zeros)}

    def suggest(self, trial: TrialLike) -> Program:
        g = self.grid()
        return self.program(**{k: trial.suggest_categorical(k, v) for k, v in g.items()})

    def program(self, **params: Any) -> Program:
        pp, m, sched = params["pp"], params["microbatches"], params["schedule"]
        zero = params.get("zero", 0)
        per_device = VIRTUAL.get(sched, 1)
        if pp * per_device > len(self.regions):
            raise Infeasible(f"pp={pp} x {per_device} stages exceeds the {len(self.regions)} "
                             "regions")
        if self.gpus % pp:
            raise Infeasible(f"pp={pp} does not divide {self.gpus} devices")
        dp = self.gpus // pp
        if self.batch_size % (dp * m):
            raise Infeasible(f"dp={dp} x microbatches={m} does not divide batch "
                             f"{self.batch_size}")
        if zero and dp == 1:
            raise Infeasible("ZeRO shards over data-parallel replicas; dp=1 has none")
        if zero == 3 and sched in SPLIT_BACKWARD:
            raise Infeasible(f"{sched} splits the backward, which ZeRO-3 does not support yet")
        if sched == "interleaved-1f1b" and m % pp:
            raise Infeasible(f"interleaved-1f1b needs microbatches ({m}) divisible by pp={pp}")
        if sched == "dualpipev" and m < 2 * pp:
            raise Infeasible(f"dualpipev needs at least 2 x pp = {2 * pp} microbatches")
        return schedules.build(sched, self.stages(pp * per_device), microbatches=m, dp=dp,
                               pp=pp, zero=zero)

    def stages(self, n: int) -> list[list[str]]:
        return [[self.regions[i] for i in r] for r in balanced_stages(self.region_costs, n)]
