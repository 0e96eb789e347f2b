"""Recompute: stages that keep only their regions' inputs and rebuild activations in backward."""

from __future__ import annotations

from dataclasses import dataclass

from piper.dag import TrainingDAG
from piper.directives.base import Directive
from piper.errors import DirectiveError


@dataclass(frozen=True, repr=False)
class Recompute(Directive):
    """Activation recompute (Megatron's full recompute, one checkpoint per region) on
    `stages` (default: all): a chunk's forward keeps only what enters each of its regions
    and drops everything autograd would save; its backward first re-runs each region's
    forward, then differentiates it. Memory per microbatch in flight falls to the regions'
    inputs, plus one region's activations while it is rebuilt; a backward costs about one
    forward more.

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
    phase = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if dag.recompute or dag.ordered:
            raise DirectiveError(index, self, "Recompute must come once, before Order")
        bad = [s for s in self.stages
               if type(s) is not int or not 0 <= s < len(dag.stages)]
        if bad:
            raise DirectiveError(index, self, f"stages {bad} do not exist ({len(dag.stages)} "
                                 "stages)")
        return dag.with_graph(dag.graph, recompute=self.chosen(len(dag.stages)))

    def chosen(self, n_stages: int) -> tuple[int, ...]:
        """The stages it recomputes, of `n_stages`: `stages`, or all of them."""
        return tuple(sorted(set(self.stages or range(n_stages))))
