"""Loss parallelism: cross-entropy over vocabulary-parallel logits, never gathered.

A vocabulary-parallel output layer (`colwise_rep`) gathers the logits whole on every
tensor-parallel rank so that the model file's loss can read them: a microbatch of Llama 3
(8,192 tokens, 128,256 entries) then holds 4 GiB of fp32 logits and log-softmax per rank
whatever tp is, and pays an all-gather of them. Megatron-LM's
`vocab_parallel_cross_entropy` and torchtitan's `loss_parallel` keep each rank's slice:
the maximum, the sum of exponentials and the target's logit are all-reduced over the group
(three vectors of one number per token), and the backward is local (softmax minus the
target's one-hot, on the rank's own columns).

`parallelize_loss` does it where it gives the same loss: the captured output is a gathered
leaf read by nothing else, and the model file's `loss_fn`, traced, is plain
`cross_entropy` of that leaf (flattened by views to [tokens, vocabulary]) against a leaf of
the targets (flattened to [tokens]), without class weights or label smoothing, mean or sum.
Any other loss keeps the gather. The graph then outputs the rank's slice and the capture's
loss is `VocabParallelLoss`, which the runtime and the cost models run alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import TensorArgument
from torch.fx.experimental.proxy_tensor import make_fx

from piper import lanes
from piper.collectives import bound_group

_aten = torch.ops.aten
_VIEWS = frozenset({_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default,
                    _aten.flatten.using_ints, _aten.squeeze.dim, _aten.unsqueeze.default})
"""Ops that keep the elements' order (a flattened loss reads the same rows)."""
_REDUCTIONS = {1: "mean", 2: "sum"}  # ATen's reduction enum (0: none, not a scalar loss)


@dataclass(frozen=True)
class CrossEntropy:
    """What a model file's loss computes when it is plain cross-entropy: which leaf of the
    output holds the logits, which leaf of the targets the classes, and how it reduces."""

    logits: int
    targets: int
    ignore_index: int
    reduction: str


def cross_entropy_of(loss_fn: Any, output: Any, targets: Any) -> CrossEntropy | None:
    """`loss_fn(output, targets)` traced on meta: a `CrossEntropy` if that is all it does,
    else None (also when it cannot be traced)."""
    leaves, out_spec = pytree.tree_flatten(output)
    tleaves, t_spec = pytree.tree_flatten(targets)
    if not all(isinstance(t, torch.Tensor) for t in (*leaves, *tleaves)):
        return None
    n = len(leaves)

    def flat(*xs: torch.Tensor) -> torch.Tensor:
        return loss_fn(pytree.tree_unflatten(list(xs[:n]), out_spec),
                       pytree.tree_unflatten(list(xs[n:]), t_spec))

    metas = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
             for t in (*leaves, *tleaves)]
    try:
        g = make_fx(flat, pre_dispatch=True)(*metas).graph
    except Exception:  # noqa: BLE001 - user code that does not trace: keep the gather
        return None
    inputs = [p for p in g.nodes if p.op == "placeholder"]
    ces = [x for x in g.nodes if x.target is _aten.cross_entropy_loss.default]
    out = next(x for x in g.nodes if x.op == "output")
    if len(ces) != 1 or out.args[0] is not ces[0]:
        return None
    ce = ces[0]
    args = dict(zip(("input", "target", "weight", "reduction", "ignore_index",
                     "label_smoothing"), ce.args, strict=False)) | ce.kwargs
    if (args.get("weight") is not None or args.get("label_smoothing", 0.0)
            or args.get("reduction", 1) not in _REDUCTIONS):
        return None
    x, xs = _through_views(args["input"])
    t, ts = _through_views(args["target"])
    if x not in inputs[:n] or t not in inputs[n:]:
        return None
    vocab = x.meta["val"].shape[-1]
    if (args["input"].meta["val"].dim() != 2
            or any(v.meta["val"].shape[-1] != vocab for v in (x, *xs))
            or args["target"].meta["val"].dim() != 1):
        return None
    used = {ce, out, x, t, *xs, *ts}
    if any(v.op == "call_function" and v not in used for v in g.nodes):
        return None  # it computes something besides the cross-entropy
    return CrossEntropy(inputs.index(x), inputs.index(t) - n,
                        int(args.get("ignore_index", -100)),
                        _REDUCTIONS[args.get("reduction", 1)])


def _through_views(v: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The node `v` views, through order-keeping view ops each read only once, and those."""
    chain = []
    while v.op == "call_function" and v.target in _VIEWS and len(v.users) == 1:
        chain.append(v)
        v = v.args[0]  # type: ignore[assignment]
    return v, chain


@dataclass(frozen=True)
class VocabParallelLoss:
    """The model file's cross-entropy on this rank's columns of the logits (`group`: the
    in-graph collective key of the tensor-parallel group, `degree` ranks)."""

    ce: CrossEntropy
    group: int
    degree: int

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        logits = pytree.tree_leaves(output)[self.ce.logits]
        target = pytree.tree_leaves(targets)[self.ce.targets]
        x = logits.reshape(-1, logits.shape[-1])
        if x.dtype in (torch.float16, torch.bfloat16):  # fp32, as autocast runs it
            x = x.float()
        return _VocabParallelCE.apply(x, target.reshape(-1), self.group,
                                      self.ce.ignore_index, self.ce.reduction == "mean")


def _all_reduce(t: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> None:
    if group is not None:
        with lanes.waiting():
            dist.all_reduce(t, op=op, group=group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy of [tokens, vocabulary / tp] fp32 logits against global class ids.
    Keeps the slice's softmax (fp32) for the backward, as Megatron's does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor, key: int,
                ignore_index: int, mean: bool) -> torch.Tensor:
        group = None if x.device.type == "meta" else bound_group(key)
        width = x.shape[-1]
        start = dist.get_rank(group) * width if group is not None else 0
        top = x.max(-1).values
        _all_reduce(top, group, dist.ReduceOp.MAX)
        e = (x - top[:, None]).exp_()
        total = e.sum(-1)
        _all_reduce(total, group)
        local = target - start
        hit = (local >= 0) & (local < width)
        index = local.clamp(0, width - 1)
        picked = (x.gather(1, index[:, None]).squeeze(1) - top).masked_fill_(~hit, 0.0)
        _all_reduce(picked, group)
        valid = target != ignore_index
        loss = (total.log() - picked).masked_fill_(~valid, 0.0).sum()
        count = valid.sum()
        e.div_(total[:, None])  # the slice's softmax
        ctx.save_for_backward(e, index, hit & valid, valid, count)
        ctx.mean = mean
        return loss / count if mean else loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, index, hit, valid, count = ctx.saved_tensors
        # in place, as Megatron's: the softmax is read once (no second [tokens, vocab] buffer)
        grad = softmax.scatter_add_(1, index[:, None], -hit.to(softmax.dtype)[:, None])
        scale = g / count if ctx.mean else g
        grad.mul_(valid.to(grad.dtype)[:, None] * scale)
        return grad, None, None, None, None


def parallelize_loss(ep: ExportedProgram, loss_fn: Any, targets: Any
                     ) -> VocabParallelLoss | None:
    """Rewrite `ep` (a captured tensor-parallel slice) to output the logits' slice instead
    of gathering them, where `loss_fn` is plain cross-entropy of them (module docstring);
    returns the loss to run on the slice, or None (nothing changed)."""
    gm = ep.graph_module
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(out.args[0])
    gather = torch.ops.piper.tp_gather.default
    if (not all(isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)
                for v in leaves) or not any(v.target is gather for v in leaves)):
        return None
    whole = pytree.tree_unflatten([v.meta["val"] for v in leaves], ep.call_spec.out_spec)
    ce = cross_entropy_of(loss_fn, whole, targets)
    if ce is None:
        return None
    node = leaves[ce.logits]
    if (node.target is not gather or set(node.users) != {out}
            or leaves.count(node) != 1):
        return None
    src, key, degree = node.args
    node.replace_all_uses_with(src)  # type: ignore[arg-type]
    gm.graph.erase_node(node)
    gm.recompile()
    for spec in ep.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name == node.name:
            spec.arg = TensorArgument(name=src.name)  # type: ignore[union-attr]
    return VocabParallelLoss(ce, int(key), int(degree))  # type: ignore[arg-type]
