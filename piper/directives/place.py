"""Place: group regions into a stage and put the stage on a pipeline device."""

from __future__ import annotations

import fnmatch
from dataclasses import KW_ONLY, dataclass, replace

from piper.dag import Stage, TrainingDAG, stage_dag
from piper.directives.base import Directive
from piper.errors import DirectiveError


@dataclass(frozen=True, repr=False)
class Place(Directive):
    """Put `regions` (names or globs like "layer.*") into stage `stage` on device `device`.

    Requires: nothing split or replicated yet; each region placed at most once.
    Rewrites: the chunk nodes of the named regions become one F/B/U triple for the stage; where
    two dataflow-adjacent stages sit on different devices, SEND/RECV nodes carry activations
    forward and gradients back. Regions no Place has named yet keep a stage each on device 0
    until they are placed.

        before: F[embed] -> F[layer.0] -> F[layer.1]        (all device 0)
        Place(("layer.0", "layer.1"), stage=1, device=1)
        after:  F0 -> SEND_F0>1 -> RECV_F0>1 -> F1          (F1 on device 1)
    """

    regions: tuple[str, ...]
    _: KW_ONLY
    stage: int
    device: int
    phase = 0

    def __post_init__(self) -> None:
        if isinstance(self.regions, str):
            object.__setattr__(self, "regions", (self.regions,))
        object.__setattr__(self, "regions", tuple(self.regions))

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if dag.microbatches != 1 or dag.dp != 1 or dag.ordered:
            raise DirectiveError(index, self, "Place must come before Split, Replicate and Order")
        placement = self.placed(dag.model.names, dag.placement, index)
        return replace(stage_dag(dag.model, stages_from(dag.model.names, placement),
                                 placement), kept=dag.kept)

    def placed(self, names: tuple[str, ...], placement: tuple[tuple[str, int, int], ...],
               index: int) -> tuple[tuple[str, int, int], ...]:
        """`placement` with this directive's regions added, every check made: what `apply`
        builds its DAG from. A run of Places builds the DAG once, from the last one
        (`Program.apply`): each DAG is a graph of every region."""
        if self.stage < 0 or self.device < 0:
            raise DirectiveError(index, self, "stage and device must be >= 0")
        matched: list[str] = []
        for pat in self.regions:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
            if not hits:
                raise DirectiveError(index, self, f"{pat!r} matches no region; regions are "
                                     f"{', '.join(names)}")
            matched += [h for h in hits if h not in matched]
        placed = {r for r, _, _ in placement}
        again = [r for r in matched if r in placed]
        if again:
            raise DirectiveError(index, self, f"regions {again} are already placed")
        clash = {d for r, s, d in placement if s == self.stage}
        if clash and clash != {self.device}:
            raise DirectiveError(index, self, f"stage {self.stage} is already on device "
                                 f"{clash.pop()}")
        out = placement + tuple((r, self.stage, self.device) for r in matched)
        try:
            stages_from(names, out)
        except ValueError as e:
            raise DirectiveError(index, self, str(e)) from None
        return out


def stages_from(names: tuple[str, ...], placement: tuple[tuple[str, int, int], ...]
                ) -> tuple[Stage, ...]:
    """Placed stages keep their numbers; unplaced regions get one stage each in the free ids."""
    by_stage: dict[int, list[str]] = {}
    device: dict[int, int] = {}
    for r in names:  # region order inside a stage follows the model's call order
        for rr, s, d in placement:
            if rr == r:
                by_stage.setdefault(s, []).append(r)
                device[s] = d
    free = (i for i in range(len(names) + max(by_stage, default=0) + 1) if i not in by_stage)
    for r in names:
        if not any(rr == r for rr, _, _ in placement):
            s = next(free)
            by_stage[s], device[s] = [r], 0
    ids = sorted(by_stage)
    if ids != list(range(len(ids))):
        raise ValueError(f"stage numbers must be 0..{len(ids) - 1} with no gaps, got {ids}")
    return tuple(Stage(s, tuple(by_stage[s]), device[s]) for s in ids)


def apply_places(dag: TrainingDAG, places: list[tuple[int, Place]]) -> TrainingDAG:
    """Consecutive Places (`(index, Place)` pairs): each checked as `Place.apply` checks it,
    one DAG built from the last placement, not one per directive."""
    index, first = places[0]
    if dag.microbatches != 1 or dag.dp != 1 or dag.ordered:
        raise DirectiveError(index, first, "Place must come before Split, Replicate and Order")
    placement = dag.placement
    for i, p in places:
        placement = p.placed(dag.model.names, placement, i)
    return replace(stage_dag(dag.model, stages_from(dag.model.names, placement), placement),
                   kept=dag.kept)
