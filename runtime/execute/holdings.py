"""What a rank holds of the model, optimizer entry by optimizer entry, as boxes of the
model's own tensors (`runtime.train.layout`): the common ground of the gradient norm
(`runtime.train.updates`) and of checkpoints (`runtime.train.checkpoint`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runtime.execute.zero import ShardedStage
from runtime.train.layout import Slicing
from runtime.train.updates import Held


def holdings(optim: dict[Any, torch.optim.Optimizer], names: dict[Any, list[str]],
             params: dict[Any, list[torch.Tensor]], sharded: dict[Any, ShardedStage],
             slicing: Slicing, owner: Callable[[Any, str], bool]) -> list[Held]:
    """One `Held` per tensor an optimizer updates. `names[key]`: the model names of the
    parameters of optimizer `key` in order (of its unsharded parameters `params[key]`, or
    of the stage a ZeRO `sharded[key]` was built from); `owner(key, name)`: whether this
    rank's copy of a replicated tensor is the one that counts."""
    out: list[Held] = []
    for key in optim:
        sh = sharded.get(key)
        if sh is None:
            seen: set[int] = set()
            for name, p in zip(names[key], params[key], strict=True):
                if id(p) in seen:  # a tied weight listed under each of its names
                    continue
                seen.add(id(p))
                out.append(Held(key, p, slicing.boxes(name, 0, p.numel(), 0,
                                                      owner(key, name))))
            continue
        units: dict[int, list[tuple[str, int, int]]] = {}
        for name, (k, off, n) in zip(names[key], sh.spans(), strict=True):
            units.setdefault(k, []).append((name, off, n))
        for k, members in units.items():
            lo, hi = sh.shard_range(k)
            boxes, whole = [], []
            for name, off, n in members:
                # this rank's shard holds elements lo:hi of the unit: the parameter's part
                a, b = max(0, lo - off), min(n, hi - off)
                boxes += slicing.boxes(name, a, b, off - lo, owner(key, name))
                whole += slicing.boxes(name, 0, n, off, False)
            u = sh.units[k]
            # a shard that is a view of its ZeRO-1/2 buffer loads through the buffer; a
            # separate (master) shard loads itself and the buffer is gathered from it
            out.append(Held(key, u.shard, boxes, None if u.separate else (u.flat, whole)))
    return out
