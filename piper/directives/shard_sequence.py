"""ShardSequence: context parallelism, every sequence split over `degree` ranks."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace

from piper.context_parallel import MODES
from piper.dag import Kind, TrainingDAG
from piper.directives.base import Directive
from piper.errors import DirectiveError

_GRAD_COLLECTIVES = (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER)


@dataclass(frozen=True, repr=False)
class ShardSequence(Directive):
    """Split every sequence of the batch over `degree` ranks (context parallelism): each
    keeps 1/degree of the tokens through the whole model, two chunks from opposite ends of
    the sequence so causal attention costs every rank the same; attention exchanges keys
    and values (`attention`: "ring", passed round and overlapped with the blocks' compute,
    or "all_gather", Llama 3's form). See `piper.context_parallel`.

    Requires: once, after Replicate (use Replicate(1) without data parallelism) and before
    Order; no expert parallelism; a model whose attention is
    `scaled_dot_product_attention` with the causal mask or none, and a sequence that splits
    into 2 x degree equal chunks (checked when the strategy is lowered).
    Rewrites: no node changes. Every rank of the DAG becomes `degree` x tp devices running
    the same tasks on their tokens (so the world is pp x dp x degree x tp). P2P goes
    between ranks of equal context-parallel index; the replicas' gradient collectives run
    over dp x degree processes (the ranks saw different tokens), so ZeRO shards over them
    too.
    """

    degree: int
    _: KW_ONLY
    attention: str = "ring"
    phase = 3

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        if not isinstance(self.degree, int) or isinstance(self.degree, bool) \
                or self.degree < 1:
            raise DirectiveError(index, self, "degree must be an int >= 1")
        if self.attention not in MODES:
            raise DirectiveError(index, self, f"attention must be one of {', '.join(MODES)}, "
                                 f"got {self.attention!r}")
        if dag.sharding.cp != 1 or dag.ordered:
            raise DirectiveError(index, self, "ShardSequence must come once, before Order")
        if dag.sharding.ep != 1:
            raise DirectiveError(index, self, "context parallelism with expert parallelism "
                                 "(Shard) is not supported")
        if dag.sharding.capacity and self.degree > 1:
            raise DirectiveError(index, self, "an expert capacity is counted per sequence, "
                                 "which context parallelism splits over ranks: not supported "
                                 "together")
        if self.degree > 1 and not any(n.kind in _GRAD_COLLECTIVES for n in dag.graph):
            raise DirectiveError(index, self, "needs Replicate before it: the ranks' "
                                 "gradients are summed by the replicas' collectives (write "
                                 "Replicate(1) without data parallelism)")
        sharding = replace(dag.sharding, cp=self.degree, cp_mode=self.attention)
        return dag.with_graph(dag.graph, sharding=sharding)
