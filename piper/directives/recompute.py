"""Recompute: stages that keep less for backward and rebuild the rest when backward needs it."""

from __future__ import annotations

from dataclasses import dataclass

from piper.dag import TrainingDAG
from piper.directives.base import Directive
from piper.errors import DirectiveError

POLICIES = ("full", "attention", "op")
"""What a recomputed stage keeps for backward (`Recompute.policy`)."""
_ALIASES = {"selective": "attention", "core_attn": "attention", True: "full"}


def policy_name(policy: object) -> str:
    """The policy `policy` names (Megatron's "selective" is "attention"); ValueError names
    the choices."""
    name = _ALIASES.get(policy, policy) if isinstance(policy, (str, bool)) else policy
    if name not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; use full, attention "
                         "(alias selective) or op")
    return name  # type: ignore[return-value]


def recompute_value(policy: str | None) -> bool | str:
    """A strategy's `recompute` as summaries, searches and strategy files say it: False
    (none), True (full) or a selective policy's name."""
    if policy is None:
        return False
    return True if policy == "full" else policy


def value_policy(value: object) -> str | None:
    """The inverse of `recompute_value`: None for no recompute (False, None, "none")."""
    if value in (False, None, "none", "off"):
        return None
    return policy_name(value)


@dataclass(frozen=True, repr=False)
class Recompute(Directive):
    """Activation recompute on `stages` (default: all), by `policy`:

    full       Megatron's full recompute, one checkpoint per region: a chunk's forward
               keeps only what enters each of its regions; its backward first re-runs each
               region's forward. Memory per microbatch in flight falls to the regions'
               inputs, plus one region's activations while it is rebuilt; a backward costs
               about one forward more.
    attention  Megatron's selective recompute (`--recompute-granularity selective`, its
               core_attn module; Korthikanti et al. 2022, sec. 5): each attention op keeps
               only its inputs and runs again in backward.
    op         every run of cheap ops between matmuls, attention and collectives (norms,
               activations, rotary embeddings, residual adds) keeps only its inputs where
               that frees memory, and runs again in backward: what fused kernels keep
               (torchtitan's `op` selective checkpointing saves the same matmul outputs).

    Requires: once, with Replicate/Shard/ShardTensor (after Place, Split, SplitBackward;
    before Order); stage indices that exist.
    Rewrites: no node changes (the rebuild is part of B, or of I with SplitBackward, so it
    composes with every schedule, ZeRO stage and sharding); records the stages in
    `TrainingDAG.recompute` for the runtime and the cost models.

        before: F0.m keeps every saved tensor of stage 0 until B0.m
        Recompute()
        after:  F0.m keeps its regions' inputs; B0.m re-runs F0.m's regions, then backward
    """

    stages: tuple[int, ...] = ()
    policy: str = "full"
    phase = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "policy", policy_name(self.policy))

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if dag.recompute or dag.ordered:
            raise DirectiveError(index, self, "Recompute must come once, before Order")
        bad = [s for s in self.stages
               if type(s) is not int or not 0 <= s < len(dag.stages)]
        if bad:
            raise DirectiveError(index, self, f"stages {bad} do not exist ({len(dag.stages)} "
                                 "stages)")
        return dag.with_graph(dag.graph, recompute=self.chosen(len(dag.stages)),
                              recompute_policy=self.policy)

    def chosen(self, n_stages: int) -> tuple[int, ...]:
        """The stages it recomputes, of `n_stages`: `stages`, or all of them."""
        return tuple(sorted(set(self.stages or range(n_stages))))
