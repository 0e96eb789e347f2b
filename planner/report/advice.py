"""What a search's user should hear when the planner is not what limits the result.

A planner reports the best strategy for the question asked; sometimes the question is what
limits it: a global batch too small to give every device a replica, a best strategy that
leaves devices waiting most of the step, a model that barely fits so the memory bound
rejects most of the space. Each warning is one line saying what to change; `search` prints
them on stderr (`warning: ...`) and lists them in `--json` under `warnings`.
"""

from __future__ import annotations

import math

from planner.report.idle import idle_by_rank, idle_share
from planner.search.records import SearchResult
from runtime.lowering.dryrun import Span

IDLE_SHARE = 0.25  # a best strategy idle more than this share of its step is worth a word
REJECTED_SHARE = 0.5  # the memory bound rejecting more than this share of the points too


def warnings_for(*, gpus: int, batch: int, result: SearchResult, best_spans: list[Span],
                 best_summary: dict | None, memory_bytes: int) -> list[str]:
    """Every warning that applies to this search, most fundamental first."""
    out = []
    cap = math.gcd(gpus, batch)
    if cap < gpus:
        enough = gpus * math.ceil(batch / gpus)
        out.append(f"the global batch of {batch} samples caps data parallelism at dp={cap} "
                   f"of the {gpus} devices (a replica needs whole samples): the other "
                   f"{gpus // cap}x must be pipeline, tensor or context parallelism, which "
                   "cost more; "
                   f"--batch-size {enough} (a multiple of {gpus}) would let every device "
                   "hold a replica")
    if best_spans and best_summary is not None:
        bubble, exposed = idle_share(idle_by_rank(best_spans))
        if bubble + exposed > IDLE_SHARE:
            if bubble >= exposed and best_summary["pp"] > 1:
                fix = ("more microbatches per step (a larger --batch-size) or more virtual "
                       "stages shrink the pipeline bubble")
            elif bubble >= exposed:
                fix = "the devices wait on each other: fewer devices (--gpus) would do"
            else:
                fix = ("communication is not hidden behind compute: a larger batch per "
                       "device, fewer devices (--gpus) or a faster network (--cluster) "
                       "raise the share of compute")
            out.append(f"the best strategy leaves its devices idle {(bubble + exposed):.0%} "
                       f"of the step ({bubble:.0%} waiting, {exposed:.0%} in exposed "
                       f"communication): {fix}")
    if result.proposed and result.over_memory > REJECTED_SHARE * result.proposed:
        out.append(f"the memory bound rejected {result.over_memory} of the "
                   f"{result.proposed} points proposed ({result.over_memory / result.proposed:.0%}"
                   f"): few strategies fit {memory_bytes / 2**30:.0f} GiB per device; more "
                   "devices (--gpus), a smaller batch or sequence, or a cluster with more "
                   "memory per device (--cluster) widen the choice")
    return out


def context_fit(result: SearchResult, smallest_without: int | None, memory_bytes: int
                ) -> str | None:
    """The line saying context parallelism is what made the model fit, when the best
    strategy splits sequences and nothing without it fits: no trial without it fit, and
    `smallest_without` (the least any strategy of the space without it needs, by the
    memory bound; None: the space has none) is over the device's memory."""
    best = result.best
    if best is None or best.summary.get("cp", 1) == 1:
        return None
    if any(r.feasible and r.summary.get("cp", 1) == 1 for r in result.records):
        return None
    if smallest_without is not None and smallest_without <= memory_bytes:
        return None
    least = ("" if smallest_without is None else
             f" (the least of them needs {smallest_without / 2**30:.1f} GiB)")
    return (f"context parallelism (cp={best.summary['cp']}) is what made the model fit: no "
            f"strategy without it fits {memory_bytes / 2**30:.0f} GiB per device{least}")
