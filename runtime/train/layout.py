"""Where each element of a rank's tensors sits in the model's own tensors.

A rank holds its parameters (and their gradients and optimizer state) in one of two
carriers: the parameter itself, cut by tensor/expert parallelism to blocks of the model's
tensor, or a ZeRO shard, a flat range of several such parameters laid end to end. Both
reduce to `Box`es: a block of one model tensor (name, offsets, sizes), contiguous in the
carrier from `start`. Checkpoints write and read boxes under the model's names (so any
strategy reads what any other wrote), and the global gradient norm sums the boxes a rank
`owns`, so a copy held by several ranks counts once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from piper.moe import expert_params
from piper.sharding import ModelSharding
from piper.tensor_parallel import ROW_SPLIT, plan_targets

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    name: str  # the model's parameter name (the first of a tied weight's names)
    full: Shape  # the model tensor's shape
    offsets: Shape  # where the block starts in it
    sizes: Shape
    start: int  # where the block starts in the flat carrier
    owner: bool  # this rank writes it and counts it in the gradient norm

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def view(self, carrier: torch.Tensor) -> torch.Tensor:
        return carrier.reshape(-1)[self.start:self.start + self.numel].view(self.sizes)


@dataclass(frozen=True)
class Piece:
    """A block of the local tensor and where it lies in the model's tensor."""

    local: Shape
    sizes: Shape
    full: Shape


class Slicing:
    """How tensor and expert parallelism cut each parameter of a model (names as in
    `named_parameters`), from the model's module names and its full shapes."""

    def __init__(self, sharding: ModelSharding, module_names: list[str],
                 full_shapes: dict[str, Shape], tp_rank: int, ep_rank: int) -> None:
        self.sh, self.full = sharding, full_shapes
        self.tp_rank, self.ep_rank = tp_rank, ep_rank
        self.styles = {f"{m}.{w}": st for m, st in plan_targets(
            sharding.tp_plan, module_names).items() for w in ("weight", "bias")
        } if sharding.tp > 1 else {}
        self.experts = expert_params(sharding.experts, full_shapes) if sharding.ep > 1 \
            else set()
        # expert tensor parallelism: (hidden dimension, halves) of each expert weight cut
        self.cuts = {p: (dim, halves) for p, dim, halves in sharding.expert_cuts
                     } if sharding.etp > 1 else {}

    def tp_split(self, name: str) -> bool:
        """Each tensor-parallel rank holds a different part (else rank 0's copy counts)."""
        if name in self.cuts or (name in self.experts and self.sh.ep_tp):
            return True
        style = self.styles.get(name)
        return style is not None and style[0] != "sequence" and not (
            style[0] in ("rowwise", "rowwise_split") and name.endswith(".bias"))

    def pieces(self, name: str) -> list[Piece]:
        full = self.full[name]
        zero = (0,) * len(full)
        if name in self.experts or name in self.cuts:
            return self._expert_pieces(name, full)
        if not self.tp_split(name):
            return [Piece(zero, full, zero)]
        kind, parts = self.styles[name]
        tp, r = self.sh.tp, self.tp_rank
        if kind in ROW_SPLIT:
            block = full[0] // parts
            piece = block // tp
            rest = full[1:]
            return [Piece((k * piece, *zero[1:]), (piece, *rest),
                          (k * block + r * piece, *zero[1:])) for k in range(parts)]
        cols = full[1] // tp  # rowwise weight: this rank's input columns
        return [Piece(zero, (full[0], cols), (0, r * cols))]

    def _expert_pieces(self, name: str, full: Shape) -> list[Piece]:
        """An expert weight: this rank's E/ep experts (dimension 0), and with expert tensor
        parallelism its 1/etp of each half of the hidden dimension."""
        ep = self.sh.ep if name in self.experts else 1
        n = full[0] // ep
        sizes, local = [n, *full[1:]], [0] * len(full)
        whole = [self.ep_rank * n if ep > 1 else 0] + [0] * (len(full) - 1)
        if name not in self.cuts:
            return [Piece(tuple(local), tuple(sizes), tuple(whole))]
        dim, halves = self.cuts[name]
        half = full[dim] // halves
        part = half // self.sh.etp
        out = []
        for k in range(halves):
            sizes[dim], local[dim], whole[dim] = part, k * part, k * half + self.tp_rank * part
            out.append(Piece(tuple(local), tuple(sizes), tuple(whole)))
        return out

    def local_shape(self, name: str) -> Shape:
        ps = self.pieces(name)
        return tuple(max(p.local[d] + p.sizes[d] for p in ps) for d in range(len(ps[0].sizes)))

    def boxes(self, name: str, lo: int, hi: int, base: int, owner: bool) -> list[Box]:
        """Boxes of the local parameter `name`'s flat elements `lo:hi`, which sit in the
        carrier from `base` (its element `lo` at `base + lo`)."""
        shape = self.local_shape(name)
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        out = []
        for off, sizes in range_boxes(shape, lo, hi):
            for p in self.pieces(name):
                a = [max(o, q) for o, q in zip(off, p.local)]
                b = [min(o + s, q + t) for o, s, q, t in zip(off, sizes, p.local, p.sizes)]
                if any(x >= y for x, y in zip(a, b)):
                    continue
                # a piece cut inside a dimension (expert tensor parallelism's halves) can
                # meet a block in a part that is not one run of memory: in runs
                for at, sub in _runs(tuple(a), tuple(y - x for x, y in zip(a, b)), shape):
                    start = sum(x * s for x, s in zip(at, strides))
                    out.append(Box(name, self.full[name],
                                   tuple(f + x - q for f, x, q in zip(p.full, at, p.local)),
                                   sub, base + start, owner))
        return out


def _runs(at: Shape, sub: Shape, shape: Shape) -> list[tuple[Shape, Shape]]:
    """Block `sub` at `at` of a row-major tensor of `shape` as contiguous blocks: whole once
    every dimension after its first non-unit one is whole, else one per index of it."""
    lead = next((d for d, n in enumerate(sub) if n > 1), len(sub))
    if all(sub[d] == shape[d] for d in range(lead + 1, len(sub))):
        return [(at, sub)]
    out = []
    for i in range(sub[lead]):
        out += _runs((*at[:lead], at[lead] + i, *at[lead + 1:]),
                     (*sub[:lead], 1, *sub[lead + 1:]), shape)
    return out


def range_boxes(shape: Shape, lo: int, hi: int) -> list[tuple[Shape, Shape]]:
    """Flat elements `lo:hi` of a row-major tensor of `shape` as (offsets, sizes) blocks,
    each contiguous: a partial row, whole rows, a partial row (recursively by dimension)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    r0, o0 = divmod(lo, inner)
    r1, o1 = divmod(hi, inner)
    out: list[tuple[Shape, Shape]] = []

    def within(row: int, a: int, b: int) -> None:
        out.extend(((row, *o), (1, *s)) for o, s in range_boxes(shape[1:], a, b))

    if r0 == r1:
        within(r0, o0, o1)
        return out
    if o0:
        within(r0, o0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * (len(shape) - 1)), (r1 - r0, *shape[1:])))
    if o1:
        within(r1, 0, o1)
    return out
