"""Activation memory per region, measured where autograd decides it: saved-tensor hooks.

Each region's stage module runs forward on meta tensors (no real memory) under
`torch.autograd.graph.saved_tensors_hooks`; every tensor autograd packs for backward is
charged once per storage, parameters and buffers excluded (they are model state, counted by
the memory model). That is exactly what a microbatch keeps alive from its forward to its
backward, not an upper bound from op outputs.

With recompute (activation checkpointing per region, Megatron-style per layer), a region
keeps only its inputs and rebuilds the rest in backward, so its figure is its inputs' bytes.
Under a selective policy (`piper.Recompute` attention or op) the region is rewritten as the
runtime rewrites it (`runtime.execute.recompute`) and run under the runtime's own ledger
(`runtime.execute.memory.SavedTensors`): what autograd packs outside the checkpointed
segments plus the inputs they keep.

The output region also holds the model's outputs until its backward (the runtime keeps them
as backward's roots) and what the loss saves: for a language model the logits and their
log-softmax, each batch x tokens x vocabulary, often the largest activation of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from piper.capture import Captured
from piper.directives.recompute import POLICIES
from runtime.execute.memory import SavedTensors
from runtime.execute.recompute import checkpointing
from runtime.execute.selective import meta_args, segments
from runtime.execute.stage_module import StageModule, build_stage
from runtime.execute.weight_grad import weight_matmul

_META = torch.device("meta")
SELECTIVE = tuple(p for p in POLICIES if p != "full")


@dataclass(frozen=True)
class Figures:
    """Per region at the capture batch: bytes kept for backward without recompute
    (`saved`), under full recompute (`inputs`), the part of both the model's outputs and
    the loss keep (`tails`); per selective policy, bytes kept (`selective`) and the names of
    the ops its backward runs again (`recomputed`)."""

    saved: tuple[int, ...]
    inputs: tuple[int, ...]
    tails: tuple[int, ...]
    selective: dict[str, tuple[int, ...]]
    recomputed: dict[str, tuple[frozenset[str], ...]]
    cast: tuple[int, ...] = ()
    """Per region, elements of its parameters a matmul-class op reads (autocast casts them
    to bf16: `runtime.execute.chunk_math.ChunkMath.step_casts` keeps one cast a step)."""


def saved_bytes(captured: Captured) -> Figures | None:
    """What every region keeps, measured; None if some region's ops cannot run on meta (the
    caller keeps its upper bound)."""
    rows = []
    try:
        for i in range(len(captured.graph.regions)):
            rows.append(_region(captured, i))
    except Exception:  # noqa: BLE001 - an op without a meta kernel or autograd formula
        return None
    saved, inputs, tails, selective, cast = zip(*rows, strict=True)
    return Figures(saved, inputs, tails,
                   {p: tuple(r[p][0] for r in selective) for p in SELECTIVE},
                   {p: tuple(r[p][1] for r in selective) for p in SELECTIVE}, cast)


def _region(captured: Captured, index: int
            ) -> tuple[int, int, int, dict[str, tuple[int, frozenset[str]]], int]:
    sm = build_stage(captured, {index}, _META)  # attention as flash keeps it (fused)
    cast = _cast_params(sm)
    policies = {}
    for policy in SELECTIVE:
        policies[policy] = _selective(captured, build_stage(captured, {index}, _META), policy)
    args, state = _inputs(sm)
    input_bytes = sum(_nbytes(t) for t in args if _storage(t) not in state)
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key not in state:
            packed[key] = max(packed.get(key, 0), _nbytes(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = dict(zip(sm.outputs, sm.module(*args)))
    tail = _output_tail(captured, sm, outs, state | set(packed))
    return sum(packed.values()) + tail, input_bytes + tail, tail, policies, cast


_aten = torch.ops.aten
_MATMULS = frozenset({_aten.linear, _aten.mm, _aten.matmul, _aten.bmm, _aten.addmm,
                      _aten.baddbmm, _aten.convolution, _aten.conv1d, _aten.conv2d,
                      _aten.conv3d})
"""ATen overload packets autocast runs in bf16, casting their fp32 operands."""


def _cast_params(sm: StageModule) -> int:
    """Elements of `sm`'s parameters some matmul-class op (or the runtime's `weight_matmul`,
    which casts as autocast would) reads."""
    def matmul(u: torch.fx.Node) -> bool:
        t = u.target
        return u.op == "call_function" and (
            getattr(t, "overloadpacket", None) in _MATMULS or t is weight_matmul)

    placeholders = [n for n in sm.module.graph.nodes if n.op == "placeholder"]
    return sum(n.meta["val"].numel() for (kind, _), n in zip(sm.inputs, placeholders,
                                                             strict=True)
               if kind == "param" and any(map(matmul, n.users)))


def _selective(captured: Captured, sm: StageModule, policy: str
               ) -> tuple[int, frozenset[str]]:
    """(bytes kept, ops run again) of a region under a selective recompute `policy`."""
    kinds = [kind for kind, _ in sm.inputs]
    picked = segments(sm.module, captured.node_region, kinds, policy)
    rewritten = checkpointing(sm, picked)
    args, state = _inputs(sm)
    ledger = SavedTensors(state)
    with ledger.counting():
        outs = dict(zip(rewritten.outputs, rewritten.module(*args)))
    tail = _output_tail(captured, rewritten, outs, state | set(ledger.storages))
    return (sum(ledger.storages.values()) + tail,
            frozenset(n.name for seg in picked for n in seg))


def _inputs(sm: StageModule) -> tuple[list[torch.Tensor], set[int]]:
    """Meta tensors for `sm`'s inputs as training sees them, and the model state's
    storages among them (`runtime.execute.selective.meta_args`, as the runtime's `op`
    policy measures)."""
    return meta_args(sm.module, [kind for kind, _ in sm.inputs])


def _output_tail(captured: Captured, sm: StageModule, outs: dict[str, torch.Tensor],
                 skip: set[int]) -> int:
    """Bytes the model's outputs and the loss on them keep until backward (kept with or
    without recompute: the loss runs outside the stage)."""
    outputs = [outs[n] for n in sm.model_outputs]
    if not outputs:
        return 0
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _storage(t) not in skip:
            packed[_storage(t)] = max(packed.get(_storage(t), 0), _nbytes(t))
        return t

    if captured.loss is not None:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            captured.loss(sm.model_output(outs), captured.targets)
    for t in outputs:
        pack(t)
    return sum(packed.values())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage a saved view keeps alive."""
    return t.untyped_storage().nbytes()
