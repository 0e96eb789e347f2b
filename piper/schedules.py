"""The standard schedule library, each written only as a directive Program.

`stages` lists the regions of each pipeline stage, in dataflow order. gpipe and 1f1b put
stage s on device s; interleaved-1f1b loops the stages over `pp` devices (stage s on device
s mod pp, `len(stages) / pp` virtual stages each). Every schedule returns
Place + Split (+ Replicate) + one Order per device; `shard` and `with_recompute` add tensor/expert
parallelism and activation recompute to any of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from piper.directives import (
    Directive,
    Order,
    Place,
    Recompute,
    Replicate,
    Shard,
    ShardSequence,
    ShardTensor,
    Split,
    SplitBackward,
    Stream,
)
from piper.directives.recompute import value_policy
from piper.program import Program

NO_PIPELINE = "none"
"""The name of a one-stage program's schedule: each microbatch's forward then backward."""


def _base(stages: Sequence[Sequence[str]], microbatches: int, dp: int,
          pp: int | None = None, zero: int = 0, split_backward: bool = False
          ) -> list[Directive]:
    pp = pp or len(stages)
    ds: list[Directive] = [Place(tuple(r), stage=s, device=s % pp)
                           for s, r in enumerate(stages)]
    ds.append(Split(microbatches))
    if split_backward:
        ds.append(SplitBackward())
    if dp > 1 or zero:
        ds.append(Replicate(dp, zero=zero))
    return ds


def _one_stage_per_device(name: str, stages: Sequence[Sequence[str]], pp: int | None) -> None:
    if pp not in (None, len(stages)):
        raise ValueError(f"{name} runs one stage per device: pp={pp} but {len(stages)} stages")


def gpipe(stages: Sequence[Sequence[str]], *, microbatches: int, dp: int = 1,
          zero: int = 0, pp: int | None = None) -> Program:
    """GPipe: every forward, then every backward."""
    _one_stage_per_device("gpipe", stages, pp)
    ds = _base(stages, microbatches, dp, zero=zero)
    for s in range(len(stages)):
        fw = [f"F{s}.{m}" for m in range(microbatches)]
        bw = [f"B{s}.{m}" for m in range(microbatches)]
        ds.append(Order(s, " ".join(fw + bw)))
    return Program(ds, name="gpipe")


def one_f_one_b_order(stage: int, pp: int, microbatches: int) -> list[str]:
    """1F1B on one device: pp-stage-1 warm-up forwards, steady F/B pairs, cool-down backwards."""
    warmup = min(pp - stage - 1, microbatches)
    order = [f"F{stage}.{m}" for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [f"F{stage}.{warmup + i}", f"B{stage}.{i}"]
    order += [f"B{stage}.{m}" for m in range(microbatches - warmup, microbatches)]
    return order


def one_f_one_b(stages: Sequence[Sequence[str]], *, microbatches: int, dp: int = 1,
                zero: int = 0, pp: int | None = None) -> Program:
    """1F1B (PipeDream-flush): at most pp microbatches in flight on the first stage. On one
    stage there is no pipeline: a forward and a backward per microbatch (gradient
    accumulation, Megatron-LM's `forward_backward_no_pipelining`), named `NO_PIPELINE`."""
    _one_stage_per_device("1f1b", stages, pp)
    ds = _base(stages, microbatches, dp, zero=zero)
    pp = len(stages)
    for s in range(pp):
        ds.append(Order(s, " ".join(one_f_one_b_order(s, pp, microbatches))))
    return Program(ds, name="1f1b" if pp > 1 else NO_PIPELINE)


def interleaved_order(device: int, pp: int, virtual: int, microbatches: int) -> list[str]:
    """Megatron's interleaved 1F1B on one device.

    Forwards walk microbatches in groups of pp, moving to the next virtual stage (chunk) after
    each group; backwards walk the chunks in reverse. The warm-up is long enough that every
    device has the next chunk's input by the time it needs it.
    """
    total = microbatches * virtual

    def at(k: int, reverse: bool) -> tuple[int, int]:
        chunk = (k // pp) % virtual
        mb = (k // (pp * virtual)) * pp + k % pp
        return (virtual - 1 - chunk if reverse else chunk) * pp + device, mb

    fwd = [f"F{s}.{m}" for s, m in (at(k, False) for k in range(total))]
    bwd = [f"B{s}.{m}" for s, m in (at(k, True) for k in range(total))]
    if microbatches == pp:
        warmup = total
    else:
        warmup = min((pp - device - 1) * 2 + (virtual - 1) * pp, total)
    order = fwd[:warmup]
    for i in range(total - warmup):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[total - warmup:]


def interleaved_1f1b(stages: Sequence[Sequence[str]], *, microbatches: int, dp: int = 1,
                     zero: int = 0, pp: int | None = None) -> Program:
    """Interleaved 1F1B (Megatron virtual pipeline): len(stages)/pp stages per device cut the
    bubble by that factor; microbatches must be a multiple of pp. With one stage per device
    it is plain 1F1B."""
    pp = pp or len(stages)
    if len(stages) % pp:
        raise ValueError(f"interleaved-1f1b: {len(stages)} stages do not split over pp={pp}")
    if len(stages) == pp:
        prog = one_f_one_b(stages, microbatches=microbatches, dp=dp, zero=zero)
        return Program(prog.directives, name="interleaved-1f1b")
    if microbatches % pp:
        raise ValueError(f"interleaved-1f1b: microbatches={microbatches} must be a multiple "
                         f"of pp={pp}")
    ds = _base(stages, microbatches, dp, pp, zero)
    v = len(stages) // pp
    for d in range(pp):
        ds.append(Order(d, " ".join(interleaved_order(d, pp, v, microbatches))))
    return Program(ds, name="interleaved-1f1b")


def zb1p_order(stage: int, pp: int, microbatches: int) -> list[str]:
    """ZB-H1 on one device: 1F1B with each backward split into I then W, and W of
    microbatch i run right after I of microbatch i + lag (lag = stage). Later stages put
    off more weight gradients, so the input gradients that every earlier stage waits for
    leave sooner, and the held-back W fill the cool-down that 1F1B leaves idle; each stage
    still holds at most pp microbatches, 1F1B's memory."""
    lag = stage
    order: list[str] = []
    for task in one_f_one_b_order(stage, pp, microbatches):
        if task[0] == "B":
            mb = int(task.split(".")[1])
            order.append(f"I{stage}.{mb}")
            if mb - lag >= 0:
                order.append(f"W{stage}.{mb - lag}")
        else:
            order.append(task)
    order += [f"W{stage}.{m}" for m in range(max(0, microbatches - lag), microbatches)]
    return order


def zb1p(stages: Sequence[Sequence[str]], *, microbatches: int, dp: int = 1,
         zero: int = 0, pp: int | None = None) -> Program:
    """Zero-bubble ZB-H1 (Qi et al. 2024): 1F1B's memory, about a third of its bubble."""
    _one_stage_per_device("zb1p", stages, pp)
    ds = _base(stages, microbatches, dp, zero=zero, split_backward=True)
    for s in range(len(stages)):
        ds.append(Order(s, " ".join(zb1p_order(s, len(stages), microbatches))))
    return Program(ds, name="zb1p")


def dualpipev_order(rank: int, pp: int, microbatches: int) -> list[str]:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half) on one device, in its eight phases.

    The device holds chunk 0 = stage `rank` (forward path going out) and chunk 1 = stage
    2·pp−1−rank (coming back; the last stage, with the loss, is on device 0). Phases:
    1 nF0, 2 nF0F1, 3 nB1W1F1 (zero-bubble), 4 nF0B1F1B0 (the steady state: each forward
    overlapped with a backward of the other chunk, `F0.k+I3.j`, so one's communication
    hides behind the other's compute), 5 nB1F1B0 (F1 overlapped with B0), 6 nB1B0 (second
    half zero-bubble), 7 nWB0, 8 nW. A zero-bubble backward runs I now and queues W;
    `weight` runs the oldest queued W.
    """
    chunk = (rank, 2 * pp - 1 - rank)
    fwd, bwd = [0, 0], [0, 0]
    queue: list[str] = []
    out: list[str] = []

    def f(c: int) -> None:
        out.append(f"F{chunk[c]}.{fwd[c]}")
        fwd[c] += 1

    def b(c: int, zero_bubble: bool = False) -> None:
        out.append(f"I{chunk[c]}.{bwd[c]}")
        w = f"W{chunk[c]}.{bwd[c]}"
        bwd[c] += 1
        if zero_bubble:
            queue.append(w)
        else:
            out.append(w)

    def weight() -> None:
        out.append(queue.pop(0))

    def overlapped(fc: int, bc: int) -> None:  # F of chunk fc beside the backward of bc
        f(fc)
        b(bc)
        forward, backward, w = out[-3:]
        out[-3:] = [f"{forward}+{backward}", w]

    for _ in range((pp - rank - 1) * 2):  # 1
        f(0)
    for _ in range(rank + 1):  # 2
        f(0)
        f(1)
    for _ in range(pp - rank - 1):  # 3
        b(1, zero_bubble=True)
        weight()
        f(1)
    for _ in range(microbatches - 2 * pp + rank + 1):  # 4 (F0 with B1, then F1 with B0)
        overlapped(0, 1)
        overlapped(1, 0)
    for _ in range(pp - rank - 1):  # 5
        b(1)
        overlapped(1, 0)
    half = rank + 1
    zb = False
    for i in range(half):  # 6
        if i == half // 2 and rank % 2 == 1:
            zb = True
        b(1, zero_bubble=zb)
        if i == half // 2 and rank % 2 == 0:
            zb = True
        b(0, zero_bubble=zb)
    for _ in range(pp - rank - 1):  # 7
        weight()
        b(0, zero_bubble=True)
    while queue:  # 8
        weight()
    return out


def dualpipev(stages: Sequence[Sequence[str]], *, microbatches: int, dp: int = 1,
              zero: int = 0, pp: int | None = None) -> Program:
    """DualPipeV: 2·pp stages in a V (stage s on device s, then back: 2·pp−1−s), pairs of
    forward and backward chunks, and zero-bubble weight gradients; microbatches >= 2·pp."""
    pp = pp or len(stages) // 2
    if len(stages) != 2 * pp:
        raise ValueError(f"dualpipev needs 2 x pp = {2 * pp} stages, got {len(stages)}")
    if microbatches < 2 * pp:
        raise ValueError(f"dualpipev: microbatches={microbatches} must be at least "
                         f"2 x pp = {2 * pp}")
    ds: list[Directive] = [Place(tuple(r), stage=s, device=s if s < pp else 2 * pp - 1 - s)
                           for s, r in enumerate(stages)]
    ds += [Split(microbatches), SplitBackward()]
    if dp > 1 or zero:
        ds.append(Replicate(dp, zero=zero))
    for d in range(pp):
        ds.append(Order(d, " ".join(dualpipev_order(d, pp, microbatches))))
    return Program(ds, name="dualpipev")


def no_pipeline(stages: Sequence[Sequence[str]], *, microbatches: int, dp: int = 1,
                zero: int = 0, pp: int | None = None) -> Program:
    """One stage, no pipeline: each microbatch's forward then its backward (1F1B's order on
    one stage), named `NO_PIPELINE`."""
    if len(stages) != 1 or (pp or 1) != 1:
        raise ValueError(f"{NO_PIPELINE}: no pipeline means one stage (pp=1), got "
                         f"{len(stages)} stages")
    return one_f_one_b(stages, microbatches=microbatches, dp=dp, zero=zero, pp=1)


SCHEDULES: dict[str, Callable[..., Program]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved-1f1b": interleaved_1f1b, "zb1p": zb1p,
    "dualpipev": dualpipev}
"""The pipeline schedules; `build` also takes `NO_PIPELINE` (one stage)."""


def build(schedule: str, stages: Sequence[Sequence[str]], *, microbatches: int,
          dp: int = 1, pp: int | None = None, zero: int = 0, recompute: bool | str = False
          ) -> Program:
    """The named schedule as a Program (with `recompute` on every stage: True for full, or
    a policy's name); `KeyError` names the known ones, `ValueError` says why the schedule
    does not fit the stages."""
    known = {**SCHEDULES, NO_PIPELINE: no_pipeline}
    if schedule not in known:
        raise KeyError(f"unknown schedule {schedule!r}; known: {', '.join(known)}")
    prog = known[schedule](stages, microbatches=microbatches, dp=dp, pp=pp, zero=zero)
    policy = value_policy(recompute)
    return with_recompute(prog, policy=policy) if policy else prog


def shard(program: Program, *, tp: int = 1, ep: int = 1,
          expert_regions: Sequence[str] = (), sp: bool = False, cp: int = 1,
          cp_attention: str = "ring", etp: int = 1, ep_over_tp: bool = False,
          capacity: float = 0.0, capacity_group: int = 0) -> Program:
    """`program` with tensor (ShardTensor, with `sp` sequence parallel), expert (Shard, with
    `etp` expert tensor parallelism, `ep_over_tp` its groups over the TP ranks too,
    `capacity` a capacity factor per sequence of `capacity_group` tokens) and
    context (ShardSequence) parallelism added, in the
    phase they belong to (after Replicate, before Order). Context parallelism sums
    gradients with the replicas' collectives, so a program without Replicate gets
    Replicate(1)."""
    extra: list[Directive] = []
    if cp > 1 and not any(isinstance(d, Replicate) for d in program.directives):
        extra.append(Replicate(1))
    if tp > 1:
        extra.append(ShardTensor(tp, sequence_parallel=sp))
    if ep > 1 or etp > 1 or capacity:
        extra.append(Shard(tuple(expert_regions), degree=ep, tensor=etp, over_tp=ep_over_tp,
                           capacity=capacity, group=capacity_group if capacity else 0))
    if cp > 1:
        extra.append(ShardSequence(cp, attention=cp_attention))
    return _insert(program, extra)


def with_recompute(program: Program, stages: Sequence[int] = (), policy: str = "full"
                   ) -> Program:
    """`program` with activation recompute (`Recompute`, by `policy`) on `stages` (default:
    all), before its Orders: the schedule is unchanged, each backward rebuilds what its
    forward did not keep first."""
    return _insert(program, [Recompute(tuple(stages), policy)])


def with_comm_stream(program: Program, zero: int = 0) -> Program:
    """`program` with its data-parallel collectives on a stream of their own ("comm"), so
    a gradient all-reduce or reduce-scatter overlaps the compute after it. One group's
    collectives share the stream (they must meet in one order on every rank); ZeRO-3's
    parameter gathers stay on the compute stream, which waits for them anyway."""
    kinds = "AR" if zero == 3 else "AR RS AG" if zero else "AR RS"
    return Program([*program.directives, Stream(kinds, stream="comm")], name=program.name)


def with_buckets(program: Program, bucket_mb: float | None) -> Program:
    """`program` with its data-parallel collectives in buckets of at most `bucket_mb` MiB
    (`Replicate.bucket_mb`; None: one per stage). A program without Replicate is returned
    as is: it has no data-parallel collectives."""
    return Program([dataclasses.replace(d, bucket_mb=bucket_mb) if isinstance(d, Replicate)
                    else d for d in program.directives], name=program.name)


def _insert(program: Program, extra: list[Directive]) -> Program:
    """`program` with `extra` (all of one phase) after the last directive of their phase."""
    ds = list(program.directives)
    phase = max((d.phase for d in extra), default=0)
    at = next((i for i, d in enumerate(ds) if d.phase > phase), len(ds))
    return Program([*ds[:at], *extra, *ds[at:]], name=program.name)
