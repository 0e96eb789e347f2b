"""Evaluation under a training strategy: the forward half of a rank's plan, without
gradients, on held-out batches.

A rank runs its compute stream's forwards in the plan's order, each after the receives of
its inputs and the gathers of its parameters (ZeRO-3), and sends what it made; backwards,
gradient messages, reductions and updates are left out. The plan's order was checked free of
deadlock, and the forwards of every rank keep their relative order, so this order is too:
a forward waits only on forwards that ran earlier in that order on their ranks.
"""

from __future__ import annotations

from piper.dag import Kind
from runtime.lowering.plan import COMPUTE_STREAM, RankPlan, Task


def forward_order(rp: RankPlan) -> list[Task]:
    """The tasks of one forward pass of `rp`'s microbatches, in the order to run them: a
    forward's parameter gathers (from whichever stream holds them) just before it, its
    activation receives and sends where the compute stream has them."""
    gathers: dict[tuple[int, int], list[Task]] = {}
    for _, tasks in rp.streams:
        for t in tasks:
            if t.kind is Kind.ALL_GATHER and not t.grad and t.mb >= 0:
                gathers.setdefault((t.stage, t.mb), []).append(t)
    strays = [t.name for name, tasks in rp.streams if name != COMPUTE_STREAM
              for t in tasks if t.kind is Kind.FWD or (t.kind.is_p2p and not t.grad)]
    if strays:
        raise ValueError(f"forwards or activation messages off the compute stream: {strays}")
    out: list[Task] = []
    for t in rp.stream(COMPUTE_STREAM):
        if t.kind is Kind.FWD:
            out += gathers.get((t.stage, t.mb), [])
            out.append(t)
        elif t.kind in (Kind.SEND, Kind.RECV) and not t.grad:
            out.append(t)
    return out
