"""dp × pp × tp × cp × ep × ZeRO × microbatches × schedule × recompute × comm stream ×
all-reduce bucket size, stage boundaries balanced by cost."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from piper import schedules
from piper.capture import ModelGraph
from piper.program import Program
from piper.schedules import NO_PIPELINE
from piper.tensor_parallel import check_divisible, plan_targets
from search_spaces import conditional
from search_spaces.base import Infeasible, SearchSpace, TrialLike
from search_spaces.conditional import Dimension
from search_spaces.partition import balanced_stages

VIRTUAL = {"interleaved-1f1b": 2, "dualpipev": 2}  # stages per pipeline rank
ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "dualpipev")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


SAMPLE_ORDER = (Dimension("schedule", ordinal=False), Dimension("zero", ordinal=False),
                Dimension("recompute", ordinal=False), Dimension("tp", ordinal=True),
                Dimension("cp", ordinal=True), Dimension("pp", ordinal=True), Dimension("microbatches", ordinal=True),
                Dimension("ep", ordinal=True), Dimension("comm_stream", ordinal=True))
"""The order `sample` asks in: categorical choices first (their values never change), then
the degrees, each among the values the earlier choices left valid. The comm stream comes
last and by position: whether it is possible depends on the degrees and the ZeRO stage
(dp > 1, not ZeRO-3), and a position always lands on a value still valid. The bucket size is
not sampled: a search scores every one per point (`variants`)."""


@dataclass(frozen=True)
class PipelineSpace(SearchSpace):
    """Pipeline × data parallelism over `gpus` devices for a global batch of `batch_size`.

    `region_costs[i]` is region i's relative compute cost (forward FLOPs); stages are cut to
    balance it exactly (`balanced_stages`). pp counts pipeline ranks; interleaved-1f1b and
    dualpipev put two stages on each. `zeros` are the ZeRO stages to try for the
    data-parallel replicas; `recomputes` whether to recompute activations (`Recompute` on
    every stage: less memory for about one more forward per backward, so it pays where
    memory, not time, is what rules points out); `comm_streams` whether the data-parallel
    collectives ride a stream of their own, overlapping the compute after them
    (`schedules.with_comm_stream`); `buckets` the bucket sizes of data-parallel collectives
    in MiB, 0 for one per stage (`Replicate.bucket_mb`: all-reduce buckets start inside the
    last backward, ZeRO's units reduce-scatter inside every backward),
    which a search settles per point (`variants`).
    """

    regions: tuple[str, ...]
    region_costs: tuple[float, ...]
    gpus: int
    batch_size: int
    schedules: tuple[str, ...] = ("gpipe", "1f1b")
    max_microbatches: int = 64
    zeros: tuple[int, ...] = (0,)
    tps: tuple[int, ...] = (1,)
    """Tensor-parallel degrees to try (the model's TP_PLAN; keep them within a node)."""
    eps: tuple[int, ...] = (1,)
    """Expert-parallel degrees to try, over `expert_regions` (regions with routed experts)."""
    expert_regions: tuple[str, ...] = ()
    cps: tuple[int, ...] = (1,)
    """Context-parallel degrees to try (each splits every sequence into 2 x cp equal
    chunks); each takes its share of the devices, like tp."""
    bad_shardings: tuple[tuple[int, int], ...] = ()
    """(tp, ep) pairs whose degrees each run alone but the model's code not together."""
    recomputes: tuple[bool | str, ...] = (False,)
    """Activation recompute: False (none), True (full) or a selective policy's name
    (`piper.Recompute`); each choice multiplies the space (`planner.search.space` asks for
    them in a real search)."""
    comm_streams: tuple[bool, ...] = (False,)
    """Gradient collectives on the compute stream / on their own (only with dp > 1)."""
    buckets: tuple[float, ...] = (0,)
    """Bucket caps in MiB to try, 0: none (only with dp > 1). Not a
    grid dimension: each point's `variants`."""
    sps: tuple[bool, ...] = (False,)
    """Sequence parallelism off/on for points with tp > 1. Not a grid dimension either: each
    point's `variants` (it changes memory and communication, never which points exist)."""
    sp_with_tp: bool = False
    """Every point with tp > 1 runs sequence parallelism (torchtitan's TP always does)."""
    buckets_with_stream: bool = False
    """Buckets only where the gradient collectives overlap the backward on a stream of
    their own, one collective per stage otherwise (Megatron's DDP: --ddp-bucket-size applies
    with --overlap-grad-reduce; without, all gradients make one bucket)."""
    stream_zeros: tuple[int, ...] = (0, 1, 2)
    """ZeRO stages whose gradient collectives may overlap the backward on a comm stream
    (DeepSpeed's overlap_comm: ZeRO 1-3's; its ZeRO-0 all-reduces after the backward)."""
    expert_count: int = 0
    """The gcd of the experts modules' expert counts (0: no experts): points with tp > 1
    and ep > 1 also run as Megatron's expert mesh (ep x tp over the TP ranks), one of
    their `variants`, where the experts divide so."""
    expert_hidden: int = 0
    """The gcd of the experts' hidden sizes, when expert tensor parallelism can split every
    routed experts module (0: it cannot). Points with tp > 1 then also run with etp = tp,
    as one of their `variants`."""
    max_zero_in_pipeline: int = 3
    """The highest ZeRO stage a point with pp > 1 may run (DeepSpeed's pipeline engine: 1;
    Megatron-LM's FSDP path runs without a pipeline: 1)."""
    unit_layer_mb: float = 0
    """Nonzero: data-parallel collectives in units of one transformer block of this many
    MiB (fp32, whole) split tp ways, on every point: torchtitan's FSDP wrapping, instead of
    the bucket sizes `buckets` tries."""
    unit_layer_zeros: tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages `unit_layer_mb` applies to (torchtitan: all; Megatron-LM: its FSDP2
    path, ZeRO-3, which wraps each transformer layer; its DDP buckets the rest)."""

    @property
    def flat_schedule(self) -> str:
        """The one schedule of pp=1 points, `NO_PIPELINE`: a forward then a backward per
        microbatch, what gradient accumulation does (a pipeline schedule's name orders one
        device's tasks worse or the same)."""
        return NO_PIPELINE

    def grid(self) -> Mapping[str, Sequence[Any]]:
        pps = [p for p in divisors(self.gpus) if p <= len(self.regions)]
        mbs = [m for m in divisors(self.batch_size) if m <= self.max_microbatches]
        g: dict[str, Sequence[Any]] = {"pp": pps, "microbatches": mbs,
                                       "schedule": [*self.schedules, *(
                                           [NO_PIPELINE] if 1 in pps else [])],
                                       "zero": list(self.zeros)}
        if self.tps != (1,):
            g["tp"] = [t for t in self.tps if self.gpus % t == 0]
        if self.eps != (1,):
            g["ep"] = list(self.eps)
        if self.cps != (1,):
            g["cp"] = [c for c in self.cps if self.gpus % c == 0]
        if self.recomputes != (False,):
            g["recompute"] = list(self.recomputes)
        if self.comm_streams != (False,):
            g["comm_stream"] = list(self.comm_streams)
        return g

    def sample(self, trial: TrialLike) -> dict[str, Any]:
        keys = self.grid().keys()
        point = conditional.sample(trial, SAMPLE_ORDER, _feasible_tuples(self))
        return {k: v for k, v in point.items() if k in keys}

    def parameters(self) -> dict[str, list[Any] | None]:
        """What `sample` asks: categorical choices, or None for a position in [0, 1]."""
        return conditional.parameters(SAMPLE_ORDER, _feasible_tuples(self))

    def params_of(self, point: dict[str, Any]) -> dict[str, Any]:
        """The trial parameters `sample` maps to `point` (a feasible point)."""
        full = {**_DEFAULTS, **point}
        return conditional.params_for(SAMPLE_ORDER, _feasible_tuples(self),
                                      tuple(full[k] for k in _NAMES))

    def terms(self) -> dict[str, list[Any]]:
        """Every value each term of a strategy's summary (`Program.summary`) takes in this
        space, for studies to show trials in those terms (`planner.search.loop.strategy_params`)."""
        pts = [dict(zip(_NAMES, t, strict=True)) for t in _feasible_tuples(self)]

        def values(f: Any) -> list[Any]:
            return sorted({f(p) for p in pts}, key=lambda v: (str(type(v)), v))

        buckets = sorted({b for b in self.buckets if b})
        return {"dp": values(lambda p: self.gpus // (p["pp"] * p["tp"] * p["cp"])),
                "pp": values(lambda p: p["pp"]), "tp": values(lambda p: p["tp"]),
                "cp": values(lambda p: p["cp"]),
                "sp": [False, True] if True in self.sps and max(self.tps) > 1 else [False],
                "ep": values(lambda p: p["ep"]), "zero": values(lambda p: p["zero"]),
                "etp": sorted({1, *(t for t in self.tps if t > 1 and self.violation(
                    pp=1, microbatches=1, schedule=NO_PIPELINE, tp=t, etp=t) is None)}),
                "schedule": values(lambda p: p["schedule"]),
                "virtual_stages": values(lambda p: VIRTUAL.get(p["schedule"], 1)),
                "microbatches": values(lambda p: p["microbatches"]),
                "recompute": values(lambda p: p["recompute"]),
                "comm_stream": values(lambda p: p["comm_stream"]),
                "bucket_mb": [None, *buckets]}

    def expert_defaults(self) -> list[dict[str, Any]]:
        """What an expert runs before searching, torchtitan's defaults: FSDP (the highest
        ZeRO stage over every device, no pipeline) and FSDP with tensor parallelism over a
        node (the largest TP degree), without and with recompute, at the smallest
        microbatch and the next, and where the space splits sequences, FSDP x CP at each
        degree (torchtitan's long-context layouts); the valid ones, most likely first. A
        search starts from those that fit (`planner.search.loop.starting_points`), so its
        pick is never worse than these in its own simulator."""
        keys = set(self.grid())
        zero = max(self.zeros)
        tps = list(dict.fromkeys([1, max(self.tps)]))
        schedule = self.flat_schedule
        feasible = set(_feasible_tuples(self))
        out = []
        plain = [r for r in self.recomputes if r in (False, True)]  # without, and full
        for again, more in itertools.product(plain, (0, 1)):
            for tp, cp in [(tp, 1) for tp in tps] + [(1, c) for c in self.cps if c > 1]:
                if self.gpus % (tp * cp):
                    continue
                counts = sorted((m for m in divisors(self.batch_size)
                                 if m <= self.max_microbatches
                                 and self.batch_size % (self.gpus // (tp * cp) * m) == 0),
                                reverse=True)
                if more >= len(counts):
                    continue
                full = {**_DEFAULTS, "schedule": schedule, "zero": zero, "tp": tp, "cp": cp,
                        "pp": 1, "microbatches": counts[more], "recompute": again}
                if tuple(full[k] for k in _NAMES) in feasible:
                    out.append({k: v for k, v in full.items() if k in keys})
        return out

    def points(self) -> list[dict[str, Any]]:
        keys = list(self.grid())
        return [{k: dict(zip(_NAMES, t, strict=True))[k] for k in keys}
                for t in _feasible_tuples(self, grid_order=True)]

    def variants(self, point: dict[str, Any]) -> list[dict[str, Any]]:
        """`point` and the same with each other bucket size that applies (dp > 1).

        A bucket size changes the price of the data-parallel collectives (how much of a
        gradient collective hides under the backward that makes it) and, with ZeRO-2/3, the
        unsharded gradient a microbatch holds (units: `runtime.execute.zero`); as a sampled
        dimension it spread TPE's trials thin (GPT-1B x16: 2 of 5 seeds within 1% of the
        grid's optimum; BENCHMARKS.md). So a search scores every size that fits for each
        point it samples and keeps the fastest (`planner.search.loop.score`), and the grid's
        optimum is over the whole product all the same."""
        if (self.unit_layer_mb and point.get("zero", 0) in self.unit_layer_zeros
                and self.gpus // (point["pp"] * point.get("tp", 1)) > 1):
            unit = {**point, "bucket_mb": round(self.unit_layer_mb / point.get("tp", 1), 3)}
            return [{**unit, "sp": True} if self.sp_with_tp and point.get("tp", 1) > 1
                    else unit]
        out = [point]
        for b in self.buckets:
            other = {**point, "bucket_mb": b}
            if b != point.get("bucket_mb", 0) and self.violation(**other) is None:
                out.append(other)
        if 0 not in self.buckets and len(out) > 1:  # only the sizes given (a framework's)
            out = out[1:]
        if self.buckets_with_stream:
            out = [p for p in out if bool(p.get("bucket_mb")) == bool(p.get("comm_stream"))
                   ] or out
        if self.sp_with_tp and point.get("tp", 1) > 1:
            out = [{**p, "sp": True} for p in out]
        elif True in self.sps and point.get("tp", 1) > 1 and not point.get("sp"):
            out += [{**p, "sp": True} for p in out]  # each, with sequence parallelism
        tp, ep = point.get("tp", 1), point.get("ep", 1)
        if tp > 1 and point.get("etp", 1) == 1 and self.violation(**{**point, "etp": tp}) is None:
            out += [{**p, "etp": tp} for p in out]  # each, with expert tensor parallelism
        mesh = {**point, "ep": ep * tp, "ep_over_tp": True}
        if tp > 1 and ep > 1 and not point.get("ep_over_tp") and self.violation(**mesh) is None:
            # each without etp, as Megatron's expert mesh: the EP groups over the TP ranks
            out += [{**p, "ep": ep * tp, "ep_over_tp": True} for p in out
                    if p.get("etp", 1) == 1]
        return out

    def check(self, **params: Any) -> None:
        reason = self.violation(**params)
        if reason:
            raise Infeasible(reason)

    def violation(self, *, pp: int, microbatches: int, schedule: str, zero: int = 0,
                  tp: int = 1, ep: int = 1, recompute: bool | str = False,
                  comm_stream: bool = False, bucket_mb: float = 0, sp: bool = False,
                  cp: int = 1, etp: int = 1, ep_over_tp: bool = False) -> str | None:
        """Why the point is not a valid strategy, or None; no Program is built (recompute
        runs with everything, so it adds no rule)."""
        m, sched = microbatches, schedule
        if pp == 1 and sched != NO_PIPELINE:
            return (f"pp=1 has no pipeline to schedule: {sched} is the same strategy as "
                    f"{NO_PIPELINE} (gradient accumulation), kept once")
        if pp > 1 and sched == NO_PIPELINE:
            return f"{NO_PIPELINE} (no pipeline schedule) is for pp=1, not pp={pp}"
        per_device = VIRTUAL.get(sched, 1)
        if pp * per_device > len(self.regions):
            return f"pp={pp} x {per_device} stages exceeds the {len(self.regions)} regions"
        if self.gpus % (pp * tp * cp):
            cps = f" x cp={cp}" if cp > 1 else ""
            return f"pp={pp} x tp={tp}{cps} does not divide {self.gpus} devices"
        dp = self.gpus // (pp * tp * cp)
        reducing = dp * cp  # the ranks whose gradients the replicas' collectives sum
        if ep_over_tp and (tp == 1 or ep % tp or etp > 1
                           or (self.expert_count and self.expert_count % ep)):
            return (f"an expert mesh (ep={ep} over tp={tp}) needs ep divisible by tp, "
                    "experts divisible by ep and etp=1")
        if dp % (ep // tp if ep_over_tp else ep):
            return f"ep={ep} does not divide dp={dp}"
        if cp > 1 and ep > 1:
            return "context parallelism with expert parallelism is not supported"
        if (tp, ep) in self.bad_shardings:
            return f"the model does not run split tp={tp} and ep={ep} together"
        if self.batch_size % (dp * m):
            return f"dp={dp} x microbatches={m} does not divide batch {self.batch_size}"
        if zero and reducing == 1:
            return "ZeRO shards over data-parallel replicas; dp=1 has none"
        if pp > 1 and zero > self.max_zero_in_pipeline:
            return (f"ZeRO-{zero} with a pipeline: the target framework runs at most "
                    f"ZeRO-{self.max_zero_in_pipeline} beside one")
        if comm_stream and reducing == 1:
            return "a comm stream carries data-parallel collectives; dp=1 has none"
        if comm_stream and zero == 3:  # its gradient scatters share a group with the gathers
            return "ZeRO-3's collectives stay on the compute stream (it waits for its gathers)"
        if comm_stream and zero not in self.stream_zeros:
            return (f"the target framework reduces ZeRO-{zero}'s gradients after the "
                    "backward, not beside it")
        if bucket_mb and reducing == 1:
            return "buckets of data-parallel collectives need dp > 1"
        if sp and tp == 1:
            return "sequence parallelism splits the sequence over a tensor-parallel group"
        if etp > 1 and (etp != tp or not self.expert_hidden or self.expert_hidden % etp):
            return (f"expert tensor parallelism etp={etp} needs etp = tp ({tp}) and experts "
                    "whose hidden size it divides")
        if sched == "interleaved-1f1b" and m % pp:
            return f"interleaved-1f1b needs microbatches ({m}) divisible by pp={pp}"
        if sched == "dualpipev" and m < 2 * pp:
            return f"dualpipev needs at least 2 x pp = {2 * pp} microbatches"
        return None

    def program(self, **params: Any) -> Program:
        self.check(**params)
        pp, m, sched = params["pp"], params["microbatches"], params["schedule"]
        zero, tp, ep = params.get("zero", 0), params.get("tp", 1), params.get("ep", 1)
        cp = params.get("cp", 1)
        dp = self.gpus // (pp * tp * cp)
        prog = schedules.build(sched, self.stages(pp * VIRTUAL.get(sched, 1)), microbatches=m,
                               dp=dp, pp=pp, zero=zero,
                               recompute=params.get("recompute", False))
        prog = schedules.shard(prog, tp=tp, ep=ep, expert_regions=self.expert_regions,
                               sp=bool(params.get("sp", False)), cp=cp,
                               etp=params.get("etp", 1),
                               ep_over_tp=bool(params.get("ep_over_tp", False)))
        if params.get("bucket_mb"):
            prog = schedules.with_buckets(prog, params["bucket_mb"])
        return schedules.with_comm_stream(prog, zero) if params.get("comm_stream") else prog

    def stages(self, n: int) -> list[list[str]]:
        return [list(s) for s in _stages(self.regions, self.region_costs, n)]


_NAMES = tuple(d.name for d in SAMPLE_ORDER)
_DEFAULTS = {"tp": 1, "ep": 1, "cp": 1, "zero": 0, "recompute": False, "comm_stream": False}
"""Values of the dimensions a space may leave out of its grid."""


@functools.cache
def _stages(regions: tuple[str, ...], costs: tuple[float, ...], n: int
            ) -> tuple[tuple[str, ...], ...]:
    """Balanced stage boundaries, memoised: the exact cut is O(n x regions^2)."""
    return tuple(tuple(regions[i] for i in r) for r in balanced_stages(costs, n))


@functools.cache
def _feasible_tuples(space: PipelineSpace, grid_order: bool = False
                     ) -> tuple[tuple[Any, ...], ...]:
    """Every valid point as values of SAMPLE_ORDER (once per space: thousands of cheap
    checks); `grid_order` lists them in the grid's order instead of sampling order."""
    g = dict(space.grid())
    defaults = {k: [v] for k, v in _DEFAULTS.items() if k != "zero"}
    for k, v in defaults.items():
        g.setdefault(k, v)
    keys = list(space.grid()) + [k for k in defaults if k not in space.grid()]
    order = keys if grid_order else list(_NAMES)
    out = []
    for values in itertools.product(*(g[k] for k in order)):
        point = dict(zip(order, values, strict=True))
        if space.violation(**point) is None:
            out.append(tuple(point[k] for k in _NAMES))
    return tuple(out)


def model_space(graph: ModelGraph, region_costs: tuple[float, ...], gpus: int,
                batch_size: int, gpus_per_node: int) -> PipelineSpace:
    """Every schedule and ZeRO stage, plus the tensor-parallel degrees the model's TP_PLAN
    allows within one node and the expert-parallel degrees its experts allow. Recompute, the
    comm stream and buckets are left off (`recomputes`, `comm_streams`, `buckets`); the
    planner's search adds them (`planner.search.space`)."""
    tps = [1]
    if graph.tp_plan:
        targets = plan_targets(graph.tp_plan, dict(graph.linears))
        shapes = dict(graph.linears)
        tps += [t for t in divisors(min(gpus, gpus_per_node)) if t > 1 and all(
            check_divisible(shapes[n], style, parts, t) is None
            for n, (style, parts) in targets.items())]
    eps = [1]
    hidden = counts = 0
    if graph.experts:
        counts = math.gcd(*(count for _, count, _ in graph.experts))
        eps += [e for e in divisors(counts) if 1 < e <= gpus]
        cut = {p.rpartition(".")[0] for p, *_ in graph.expert_cuts}
        if all(name in cut for name, _, _ in graph.experts):  # none with biases
            hidden = math.gcd(*(size // halves for _, _, halves, size in graph.expert_cuts))
    return PipelineSpace(graph.names, region_costs, gpus, batch_size, schedules=ALL_SCHEDULES,
                         zeros=(0, 1, 2, 3), tps=tuple(tps), eps=tuple(eps),
                         expert_regions=graph.expert_regions, expert_hidden=hidden,
                         expert_count=counts)
