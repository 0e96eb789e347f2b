"""Collectives that live *inside* a chunk's graph: Megatron's f/g for tensor parallelism (and
the gather after a vocabulary-parallel output layer) and sequence parallelism's gathers and
scatters; the groups of expert (`piper.moe`) and context parallelism
(`piper.context_parallel`), whose exchanges run inside their own ops.

They are `torch.library` custom ops with their own autograd formulas, so `torch.export`
records each as one node (the captured graph keeps them; stage modules replay them) and
backward runs the matching collective. An op names its group by a small integer key; each
worker process binds its real process groups to the keys before running (`bind_group`).
On meta tensors (capture, cost models) the ops are shape-preserving no-ops.

Overlapped pairs issue these from two threads of a rank: each lane has its own
communicators (`bind_group(..., lane=1)`; `piper.lanes`), and a collective hands the lane's
compute token over while it waits (`lanes.waiting`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from piper import lanes

TP_GROUP = 0  # the ranks that hold shards of the same tensor-parallel layers
EP_GROUP = 1  # the ranks that exchange tokens for one set of experts
CP_GROUP = 2  # the ranks that hold parts of the same sequences (context parallelism)

_groups: dict[tuple[int, int], Any] = {}


def bind_group(key: int, group: Any, lane: int = 0) -> None:
    """Make the in-graph collectives with `key` run over `group` in this process (on
    threads working for `lane`)."""
    _groups[(key, lane)] = group


def bound_group(key: int) -> Any:
    """The process group bound to `key` for this thread's lane."""
    at = (key, lanes.current())
    if at not in _groups:
        raise RuntimeError(f"no process group bound to in-graph collective key {key} "
                           f"(lane {at[1]})")
    return _groups[at]


_wire: list[torch.dtype | None] = [None]


def set_wire_dtype(dtype: torch.dtype | None) -> None:
    """Floating tensors cross the in-graph collectives as `dtype` (bf16 training: half the
    bytes, as Megatron's bf16 all-reduces; None: as they are)."""
    _wire[0] = dtype


def wire_dtype() -> torch.dtype | None:
    """The dtype floating tensors cross in-graph collectives in (None: as they are)."""
    return _wire[0]


def _on_wire(x: torch.Tensor) -> torch.Tensor:
    wire = _wire[0]
    if wire is None or not x.is_floating_point() or x.dtype == wire:
        return x.contiguous()
    return x.to(wire).contiguous()


def _all_reduce(x: torch.Tensor, key: int) -> torch.Tensor:
    out = _on_wire(x)
    out = out.clone() if out.data_ptr() == x.data_ptr() else out
    group = bound_group(key)
    with lanes.waiting():
        dist.all_reduce(out, group=group)
    return out.to(x.dtype)


# ---- f: identity forward, all-reduce backward (enters a column-parallel region) ---------
@torch.library.custom_op("piper::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.clone()


@tp_copy.register_fake
def _(x: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty_like(x)


def _keep_group(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.group = inputs[1]


tp_copy.register_autograd(lambda ctx, g: (_all_reduce(g, ctx.group), None),
                          setup_context=_keep_group)


# ---- g: all-reduce forward, identity backward (leaves a row-parallel region) ------------
@torch.library.custom_op("piper::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group: int) -> torch.Tensor:
    return _all_reduce(x, group)


@tp_reduce.register_fake
def _(x: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty_like(x)


tp_reduce.register_autograd(lambda ctx, g: (g, None), setup_context=_keep_group)


# ---- all-gather over the last dim forward, this rank's slice backward -------------------
# (leaves a column-parallel layer whose whole output every rank needs: a vocabulary-parallel
# output layer before a loss that reads all logits)
def _gather_last(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    src = _on_wire(x)
    parts = [torch.empty_like(src) for _ in range(degree)]
    g = bound_group(group)
    with lanes.waiting():
        dist.all_gather(parts, src, group=g)
    return torch.cat(parts, dim=-1).to(x.dtype)


@torch.library.custom_op("piper::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    return _gather_last(x, group, degree)


@tp_gather.register_fake
def _(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * degree))


def _keep_degree(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.group, ctx.degree = inputs[1], inputs[2]


def _own_slice(ctx: Any, g: torch.Tensor) -> tuple:
    index = dist.get_rank(bound_group(ctx.group))
    return g.chunk(ctx.degree, dim=-1)[index].contiguous(), None, None


tp_gather.register_autograd(_own_slice, setup_context=_keep_degree)


# ---- this rank's slice of the last dim forward, all-gather backward ---------------------
# (enters a row-parallel layer from replicated code: Hugging Face's `rowwise_split_input`,
# after a column-parallel layer whose output was gathered whole)
@torch.library.custom_op("piper::tp_split", mutates_args=())
def tp_split(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    index = dist.get_rank(bound_group(group))
    return x.chunk(degree, dim=-1)[index].clone(memory_format=torch.contiguous_format)


@tp_split.register_fake
def _(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // degree))


tp_split.register_autograd(
    lambda ctx, g: (_gather_last(g.contiguous(), ctx.group, ctx.degree), None, None),
    setup_context=_keep_degree)

# ---- sequence parallelism (Megatron): activations between tensor-parallel blocks hold 1/t of
# the sequence (dim 1). Entering a column-parallel layer gathers it (backward: reduce-scatter
# of the gradient); leaving a row-parallel one reduce-scatters the partial sums (backward:
# gather). Both move dim 1 to the front, where the flat collectives split.
def _seq_gather(x: torch.Tensor, key: int, degree: int) -> torch.Tensor:
    src = _on_wire(x.transpose(0, 1))  # [s/t, b, ...], contiguous
    out = src.new_empty((src.shape[0] * degree, *src.shape[1:]))
    g = bound_group(key)
    with lanes.waiting():
        dist.all_gather_single(out, src, group=g)
    # back in the model's [b, s, ...] layout, contiguous: a model may `view` it (Hugging
    # Face's MoE blocks flatten their tokens so)
    return out.transpose(0, 1).to(x.dtype).contiguous()


def _seq_scatter(x: torch.Tensor, key: int, degree: int) -> torch.Tensor:
    src = _on_wire(x.transpose(0, 1))  # [s, b, ...], contiguous
    out = src.new_empty((src.shape[0] // degree, *src.shape[1:]))
    g = bound_group(key)
    with lanes.waiting():
        dist.reduce_scatter_single(out, src, group=g)
    return out.transpose(0, 1).to(x.dtype).contiguous()


@torch.library.custom_op("piper::sp_gather", mutates_args=())
def sp_gather(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    return _seq_gather(x, group, degree)


@sp_gather.register_fake
def _(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] * degree, *x.shape[2:]))


sp_gather.register_autograd(
    lambda ctx, g: (_seq_scatter(g, ctx.group, ctx.degree), None, None),
    setup_context=_keep_degree)


@torch.library.custom_op("piper::sp_scatter", mutates_args=())
def sp_scatter(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    return _seq_scatter(x, group, degree)


@sp_scatter.register_fake
def _(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // degree, *x.shape[2:]))


sp_scatter.register_autograd(
    lambda ctx, g: (_seq_gather(g, ctx.group, ctx.degree), None, None),
    setup_context=_keep_degree)


# ---- entering and leaving a sequence-parallel stretch from replicated code ---------------
# (a model whose code between layers needs the whole sequence: Hugging Face's decoder
# builds its causal mask and rotary angles from the embeddings' length, so the sequence is
# split at the first layer and gathered whole again before the final norm)
def _own_sequence(x: torch.Tensor, key: int, degree: int) -> torch.Tensor:
    index = dist.get_rank(bound_group(key))
    # a copy, never a view: with one sequence (dim 0 of size 1) the chunk is contiguous
    # already, and a custom op may not return an alias of its input
    return x.chunk(degree, dim=1)[index].clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("piper::sp_split", mutates_args=())
def sp_split(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    """This rank's 1/t of the sequence (dim 1) of a tensor every rank holds whole."""
    return _own_sequence(x, group, degree)


@sp_split.register_fake
def _(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // degree, *x.shape[2:]))


sp_split.register_autograd(
    lambda ctx, g: (_seq_gather(g, ctx.group, ctx.degree), None, None),
    setup_context=_keep_degree)


@torch.library.custom_op("piper::sp_gather_whole", mutates_args=())
def sp_gather_whole(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    """The whole sequence on every rank, for code that runs replicated after it (backward:
    this rank's slice of the gradient, which every rank computed alike)."""
    return _seq_gather(x, group, degree)


@sp_gather_whole.register_fake
def _(x: torch.Tensor, group: int, degree: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] * degree, *x.shape[2:]))


sp_gather_whole.register_autograd(
    lambda ctx, g: (_own_sequence(g, ctx.group, ctx.degree), None, None),
    setup_context=_keep_degree)

IN_GRAPH_OPS = {"tp_copy": TP_GROUP, "tp_reduce": TP_GROUP, "tp_gather": TP_GROUP,
                "tp_split": TP_GROUP,
                "sp_gather": TP_GROUP, "sp_scatter": TP_GROUP,
                "sp_split": TP_GROUP, "sp_gather_whole": TP_GROUP}
"""Op name -> the group it runs over (cost models price these nodes as collectives)."""
