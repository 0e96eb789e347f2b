"""Stream: run a kind of communication on its own logical stream, overlapping computation."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from piper.dag import Kind, TrainingDAG
from piper.directives.base import Directive, words
from piper.errors import DirectiveError

MOVABLE = {Kind.ALL_REDUCE.value, Kind.REDUCE_SCATTER.value, Kind.ALL_GATHER.value}


@dataclass(frozen=True, repr=False)
class Stream(Directive):
    """Put every task of the given kinds ("AR", "RS", "AG") on logical stream `stream`.

    A rank runs each stream in order, all streams at once (CUDA streams on GPU, one thread
    per stream on CPU); a task waits for a task of another stream only where the DAG has an
    edge between them. So `Stream("AR RS", stream="comm")` lets gradient all-reduces and
    reduce-scatters of one stage run while the backward of the next stage computes.

    Requires: Replicate done. ZeRO-3's per-chunk gathers share the stage's parameter buffer
    with the chunk that uses it, so with zero=3 "AG" must stay on the compute stream. All
    collectives of one process group must share a stream (the scheduler checks), since one
    communicator cannot take collectives from two threads in an agreed order.
    Rewrites: no edges; records the stream of each task kind (the scheduler splits each
    rank's order by stream and turns cross-stream edges into waits).
    """

    kinds: str
    _: KW_ONLY
    stream: str
    phase = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", words(self.kinds))

    def apply(self, dag: TrainingDAG, index: int) -> TrainingDAG:
        kinds = self.kinds.split()
        bad = [k for k in kinds if k not in MOVABLE]
        if bad or not kinds:
            raise DirectiveError(index, self, f"kinds must be among {sorted(MOVABLE)}, "
                                 f"got {bad or kinds}")
        if not self.stream.isidentifier():
            raise DirectiveError(index, self, f"stream name {self.stream!r} must be an "
                                 "identifier")
        if dag.zero == 3 and "AG" in kinds:
            raise DirectiveError(index, self, "ZeRO-3 gathers must stay on the compute "
                                 "stream")
        streams = dict(dag.streams)
        streams.update(dict.fromkeys(kinds, self.stream))
        return dag.with_graph(dag.graph, streams=tuple(sorted(streams.items())))
