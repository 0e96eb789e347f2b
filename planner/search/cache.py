"""Evaluations cached by a content hash of everything a prediction depends on.

A search proposes the same strategy many times (samplers revisit good points; different
trials can spell one Program). The key is a sha256 over stable text — the Program's JSON, the
captured model graph and its costs, the cluster as TOML, the microbatch size and device count
— so it is equal exactly when the inputs are, across processes too, and needs no hashing of
the (large) Plan itself.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from cost_models import ClusterSpec, ModelCosts, to_toml
from piper.capture import ModelGraph
from piper.program import Program

KEY_VERSION = "piper-plan-evaluation-5"
"""Part of every key: bump it when the meaning of a cached evaluation changes."""

V = TypeVar("V")


def evaluation_key(program: Program, model: ModelGraph, costs: ModelCosts,
                   cluster: ClusterSpec, microbatch_size: int, gpus: int, *,
                   tp_overlap: bool = False, expert_skew: float = 1.0,
                   ep_overlap: bool = False, param_gather_overlap: bool = False) -> str:
    """Hex sha256 of the inputs of one evaluation, as text that is stable across runs."""
    h = hashlib.sha256()
    for part in (KEY_VERSION, program.to_json(), repr(model), repr(costs), to_toml(cluster),
                 f"microbatch_size={microbatch_size}", f"gpus={gpus}",
                 f"tp_overlap={tp_overlap}", f"expert_skew={expert_skew!r}",
                 f"ep_overlap={ep_overlap}", f"param_gather_overlap={param_gather_overlap}"):
        h.update(part.encode())
        h.update(b"\0")  # a separator no part contains, so parts cannot run together
    return h.hexdigest()


@dataclass
class EvaluationCache(Generic[V]):
    """Least-recently-used map from `evaluation_key` to a result, with hit/miss counts.

    Bounded because each entry keeps a whole simulated timeline.
    """

    size: int = 128
    hits: int = 0
    misses: int = 0
    _entries: OrderedDict[str, V] = field(default_factory=OrderedDict, repr=False)

    def get(self, key: str) -> V | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: str, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
