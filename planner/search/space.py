"""The space a search walks: the model's default space with activation recompute, a comm
stream for gradient collectives and bucket sizes of data-parallel collectives as choices,
less the tensor/expert-parallel degrees (and pairs of them) its code cannot run at.

`model_space` allows a TP degree when every TP_PLAN linear divides by it, but the model's
forward may still not run split that way (attention heads fewer than the degree, a reshape
with a hard-coded size). Capturing each degree once (two layers of it, `planner.search.repeats`)
finds out before the search, so no trial is spent on a degree that can never run, and every
worker of a Ray search finds the captures ready.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from planner.search.evaluate import Evaluator
from search_spaces import Infeasible
from search_spaces.pipeline import PipelineSpace, model_space

BUCKETS_MB = (0, 25, 100)
"""Bucket caps tried (MiB; 0: one per stage): DDP's default and a coarser one; with ZeRO
they are its units (FSDP's), whose reduce-scatters start inside the backward."""


RECOMPUTES = (False, True, "attention", "op")
"""Recompute choices a search tries: none, full, and the selective policies
(`piper.Recompute`)."""


def search_space(evaluator: Evaluator, gpus_per_node: int) -> tuple[PipelineSpace, list[str]]:
    """The viable default space, without activation recompute and with each policy of it
    (`RECOMPUTES`), with and without a comm stream,
    with one collective per stage or in buckets (`BUCKETS_MB`), and a line per
    degree left out (with the reason)."""
    ev = evaluator
    space = model_space(ev.graph, ev.region_costs(), ev.gpus, ev.batch_size, gpus_per_node)
    return viable(dataclasses.replace(space, recomputes=RECOMPUTES,
                                      comm_streams=(False, True), buckets=BUCKETS_MB,
                                      sps=(False, True)), ev)


def viable(space: PipelineSpace, evaluator: Evaluator) -> tuple[PipelineSpace, list[str]]:
    """`space` without the TP/EP degrees whose sharded capture fails, and without the
    (tp, ep) pairs that fail together although each degree runs alone; captures the rest.

    Single degrees go first, so a failing pair never takes a good degree out with it."""
    first: dict[tuple[int, int], dict[str, Any]] = {}
    for p in space.points():
        first.setdefault((p.get("tp", 1), p.get("ep", 1)), p)
    bad_tp, bad_ep, bad_pairs, why = set(), set(), [], []
    for (tp, ep), point in sorted(first.items(), key=lambda kv: (min(kv[0]) > 1, kv[0])):
        if (tp, ep) == (1, 1) or tp in bad_tp or ep in bad_ep:
            continue
        try:
            evaluator.sharded_costs(evaluator.skeleton(space.program(**point)).sharding)
        except Infeasible as e:
            if tp > 1 and ep > 1:
                bad_pairs.append((tp, ep))
                why.append(f"tp={tp} with ep={ep}: {e}")
            else:
                (bad_tp if tp > 1 else bad_ep).add(tp if tp > 1 else ep)
                why.append(f"{'tp' if tp > 1 else 'ep'}={tp if tp > 1 else ep}: {e}")
    space = dataclasses.replace(space, tps=tuple(t for t in space.tps if t not in bad_tp),
                                eps=tuple(e for e in space.eps if e not in bad_ep),
                                bad_shardings=tuple(bad_pairs))
    if True in space.sps:  # sequence parallelism needs a model whose ops go token by token
        for (tp, ep), point in sorted(first.items()):
            if tp == 1 or ep > 1 or tp in bad_tp:
                continue
            try:
                evaluator.sharded_costs(evaluator.skeleton(
                    space.program(**point, sp=True)).sharding)
            except Infeasible as e:
                why.append(f"sequence parallelism: {e}")
                space = dataclasses.replace(space, sps=(False,))
                break
    return space, why
