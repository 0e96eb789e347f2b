"""The standard schedule library, each written only as a directive Program.

`stages` lists the regions of each pipeline stage; stage s runs on device s (one stage per
device). Every schedule returns Place + Split (+ Replicate) + one Order per device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from piper.directives import Directive, Order, Place, Replicate, Split
from piper.program import Program


def _base(stages: Sequence[Sequence[str]], microbatches: int, dp: int) -> list[Directive]:
    ds: list[Directive] = [Place(tuple(r), stage=s, device=s) for s, r in enumerate(stages)]
    ds.append(Split(microbatches))
    if dp > 1:
        ds.append(Replicate(dp))
    return ds


def gpipe(stages: Sequence[Sequence[str]], *, microbatches: int, dp: int = 1) -> Program:
    """GPipe: every forward, then every backward (in reverse microbatch order is not needed)."""
    ds = _base(stages, microbatches, dp)
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


def one_f_one_b(stages: Sequence[Sequence[str]], *, microbatches: int, dp: int = 1) -> Program:
    """1F1B (PipeDream-flush): at most pp microbatches in flight on the first stage."""
    ds = _base(stages, microbatches, dp)
    pp = len(stages)
    for s in range(pp):
        ds.append(Order(s, " ".join(one_f_one_b_order(s, pp, microbatches))))
    return Program(ds, name="1f1b")


SCHEDULES: dict[str, Callable[..., Program]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build(schedule: str, stages: Sequence[Sequence[str]], *, microbatches: int,
          dp: int = 1) -> Program:
    """The named schedule as a Program; `KeyError` names the known ones."""
    if schedule not in SCHEDULES:
        raise KeyError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    return SCHEDULES[schedule](stages, microbatches=microbatches, dp=dp)
