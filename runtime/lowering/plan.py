"""Plan: per rank, per logical stream, the total order of tasks one training step runs.

Plans are what executors consume: the Ray workers run them for real, the cost-model simulator
runs them in simulated time. Everything here is a small frozen value so a Plan pickles to
workers and hashes for caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from piper.capture import ModelGraph
from piper.dag import Kind
from piper.sharding import ModelSharding
from runtime.lowering.mesh import Mesh

COMPUTE_STREAM = "compute"
PAIR_STREAM = "pair"
"""The second compute lane: the backward of an overlapped pair (`Order("F0.2+I3.0")`) runs
here beside its forward on COMPUTE_STREAM."""


@dataclass(frozen=True, slots=True)
class Task:
    """One step of a rank's program.

    P2P tasks carry the peer rank, the FX value names of the tensors and a tag (tensor k of
    the message uses tag + k); collectives carry their process-group ranks. `after` names the
    tasks on other streams of the same rank this one waits for (events); within a stream,
    order alone orders.
    """

    kind: Kind
    stage: int
    mb: int = -1
    peer: int = -1
    values: tuple[str, ...] = ()
    grad: bool = False
    tag: int = 0
    group: tuple[int, ...] = ()
    name: str = ""
    after: tuple[str, ...] = ()  # tasks of another stream of this rank that must finish first
    pair: str = ""  # a backward on PAIR_STREAM: the forward it is paired with

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class RankPlan:
    rank: int
    device: int
    replica: int
    stages: tuple[int, ...]
    streams: tuple[tuple[str, tuple[Task, ...]], ...]

    def stream(self, name: str = COMPUTE_STREAM) -> tuple[Task, ...]:
        return dict(self.streams).get(name, ())

    @property
    def tasks(self) -> tuple[Task, ...]:
        return tuple(t for _, ts in self.streams for t in ts)


@dataclass(frozen=True)
class Plan:
    """The whole step for every logical rank, plus what executors need to interpret tasks.

    Ranks, peers and groups are logical (`runtime.lowering.mesh`): with tensor parallelism each is
    `tp` processes running the same tasks.
    """

    model: ModelGraph
    stage_regions: tuple[tuple[str, ...], ...]
    stage_device: tuple[int, ...]
    output_stage: int
    pp: int
    dp: int
    microbatches: int
    ranks: tuple[RankPlan, ...]
    groups: tuple[tuple[int, ...], ...]  # collective groups, in the order to create them
    zero: int = 0  # ZeRO stage of the data-parallel replicas
    bucket_bytes: int = 0  # all-reduce buckets of at most this many bytes (0: one per stage)
    ties: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = ()  # (params, stages) tied
    sharding: ModelSharding = field(default_factory=ModelSharding)  # tensor / expert parallelism inside chunks
    recompute: tuple[int, ...] = ()  # stages whose backward rebuilds their activations
    recompute_policy: str = "full"  # what they keep: full, attention or op (`piper.Recompute`)

    @property
    def mesh(self) -> Mesh:
        sh = self.sharding
        return Mesh(self.pp, self.dp, sh.tp, sh.ep_replicas, sh.cp, sh.ep_tp)

    @property
    def shard_ways(self) -> int:
        """Processes a stage's data-parallel collectives (and ZeRO's shards) span: the
        replicas times the context-parallel ranks, whose gradients are summed alike."""
        return self.dp * self.sharding.cp

    @property
    def world_size(self) -> int:
        """Processes: one per logical rank and context- and tensor-parallel index."""
        return self.mesh.world_size

    @property
    def complete(self) -> bool:
        """Whether every logical rank has its RankPlan: a simulation view keeps one replica
        of each kind (`TrainingDAG.kept`), which no executor can run."""
        return len(self.ranks) == self.pp * self.dp

    @property
    def paired(self) -> bool:
        """Whether some rank runs overlapped pairs (a second compute lane)."""
        return any(name == PAIR_STREAM for rp in self.ranks for name, _ in rp.streams)

    def p2p_links(self) -> set[tuple[int, int, bool]]:
        """(sender, receiver, grad) of every message of the step: logical ranks, and whether
        it carries gradients (each kind of message gets its own communicator per
        direction, so the two lanes of an overlapped pair never share one)."""
        return {(rp.rank, t.peer, t.grad) for rp in self.ranks for t in rp.tasks
                if t.kind is Kind.SEND}

    def describe(self) -> str:
        """One line per rank: its tasks by short name (torch pipelining style)."""
        return "\n".join(f"rank {rp.rank}: " + " ".join(t.name for t in rp.tasks)
                         for rp in self.ranks)
