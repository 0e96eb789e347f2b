"""ShardTensor: tensor parallelism (Megatron column/row-parallel linears) inside every chunk."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace

from piper.dag import TrainingDAG
from piper.directives.base import Directive
from piper.errors import DirectiveError
from piper.tensor_parallel import ROW_SPLIT, check_divisible, plan_targets


@dataclass(frozen=True, repr=False)
class ShardTensor(Directive):
    """Split the planned `nn.Linear` (and `nn.Embedding`) layers `degree` ways; each rank runs
    its slice.

    `plan` is ((module glob, style), ...) with styles colwise, colwise:K, rowwise,
    colwise_rep, vocab, sequence, replicate (see `piper.tensor_parallel`); empty means the
    model file's `TP_PLAN`.
    Requires: once, before Order; the planned layers divisible by `degree`; a tied weight
    split by rows in every layer using it.
    Rewrites: no node changes — every rank of the DAG becomes `degree` devices running the
    same tasks on their slices, with Megatron's f/g all-reduces inside the chunks (so the
    world is pp x dp x degree). P2P goes between ranks of equal tensor-parallel index;
    data-parallel collectives run among them too.

    `sequence_parallel` (Megatron's sequence parallelism): outside the split layers each rank
    holds 1/degree of the sequence (dim 1), so norms, residual adds and the activations they
    keep and send shrink by `degree`; a column-parallel layer gathers the sequence first and
    a row-parallel one reduce-scatters its sums (the embedding too), the same bytes as the
    all-reduces they replace. Parameters outside the plan then see part of the tokens, so
    their gradients are summed over the group. Every op between the split layers must work
    token by token (a learned position table must be marked `sequence` in the plan).
    """

    degree: int
    _: KW_ONLY
    plan: tuple[tuple[str, str], ...] = ()
    sequence_parallel: bool = False
    phase = 3

    def __post_init__(self) -> None:
        plan = self.plan.items() if isinstance(self.plan, dict) else self.plan
        object.__setattr__(self, "plan", tuple(tuple(p) for p in plan))

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if not isinstance(self.degree, int) or self.degree < 1:
            raise DirectiveError(index, self, "degree must be an int >= 1")
        if dag.sharding.tp != 1 or dag.ordered:
            raise DirectiveError(index, self, "ShardTensor must come once, before Order")
        plan = self.plan or dag.model.tp_plan
        if not plan:
            raise DirectiveError(index, self, "no plan given and the model file defines no "
                                 "TP_PLAN")
        shapes = dict(dag.model.linears)
        try:
            targets = plan_targets(plan, shapes)
        except ValueError as e:
            raise DirectiveError(index, self, f"{e} (nn.Linear modules: "
                                 f"{', '.join(list(shapes)[:6])}...)") from None
        tied = {p for p, _ in dag.model.tied}
        for name, (style, parts) in targets.items():
            why = check_divisible(shapes[name], style, parts, self.degree)
            if why:
                raise DirectiveError(index, self, f"{name}: {why}")
            if f"{name}.weight" in tied and (style not in ROW_SPLIT or parts != 1):
                raise DirectiveError(index, self, f"{name}.weight is tied to another layer; "
                                     "a tied weight splits only by rows (vocab, colwise, "
                                     "colwise_rep) in every layer using it")
        if self.sequence_parallel and self.degree == 1:
            raise DirectiveError(index, self, "sequence_parallel needs degree > 1")
        sharding = replace(dag.sharding, tp=self.degree, tp_plan=tuple(plan),
                           sp=bool(self.sequence_parallel))
        return dag.with_graph(dag.graph, sharding=sharding)
