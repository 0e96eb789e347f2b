"""Tensor parallelism (Megatron-style) for `nn.Linear` layers, by a plan of module globs.

A model file may define `TP_PLAN = {"blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}`
(TorchTitan's parallelize-plan idea). Styles:

    colwise      weight rows (output features) and bias split over the group; the input
                 enters through f (identity forward, all-reduce of its gradient backward)
    colwise:K    the output is K equal parts fused in one layer (e.g. q|k|v = colwise:3);
                 each rank keeps its slice of every part, so `chunk(K, -1)` stays right
    rowwise      weight columns (input features) split; the partial products leave through
                 g (all-reduce forward, identity backward); the bias is added once, after g
    rowwise_split  rowwise, whose input every rank holds whole (after a colwise_rep layer
                 and replicated code): each rank takes its slice of the features first
                 (backward: all-gather); Hugging Face's `rowwise_split_input`
    colwise_rep  colwise, then the output gathered whole on every rank (Hugging Face's
                 name; TorchTitan's ColwiseParallel(output_layouts=Replicate())): a
                 vocabulary-parallel output layer before a loss that reads every logit
                 (a plain cross-entropy reads the slices instead: `piper.loss_parallel`)
    vocab        an nn.Embedding's rows (the vocabulary) split; each rank looks up the
                 tokens in its range, zeros for the rest, and the partial embeddings leave
                 through g (Megatron's VocabParallelEmbedding)
    sequence     an nn.Embedding indexed by position (a learned position table), kept
                 whole: with sequence parallelism each rank keeps the rows of its share of
                 the sequence, and the table's gradient is summed over the group; without,
                 nothing changes
    replicate    any module, kept whole on every rank, whose parameters meet sharded
                 activations (a per-head q/k norm between column- and row-parallel layers):
                 each parameter enters through f, so its gradient is summed over the group
                 (Hugging Face's `replicated_with_grad_allreduce`)

For models whose code reads the sequence length from a block's input (Hugging Face's
attention views q by `hidden_states.shape`), sequence parallelism can gather at the blocks
instead of at each column-parallel layer; these module styles do nothing without it:

    sequence_block   an attention or MLP module holding split layers: its input is gathered
                     whole on entry (backward: reduce-scatter) and its output
                     reduce-scattered on exit, so its code sees the whole sequence and the
                     split layers inside take no collective of their own
    sequence_split   the first layer: its input, whole on every rank, is split (each rank
                     keeps its 1/t of the sequence; backward: all-gather)
    sequence_gather  the module after the last layer (a final norm): its input is gathered
                     whole for the replicated code after it (backward: this rank's slice)

With `sequence_split` in the plan, only the modules under the split layer's parent (the
layer list) see 1/t of the tokens, so only their parameters' gradients are summed.

A column-parallel layer followed by a row-parallel one needs no communication in between,
so each MLP or attention block costs one all-reduce forward and one backward. Code between
them sees the local width: write reshapes with -1 for the sharded dimension (heads), as
TorchTitan's models do.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from piper.collectives import (
    TP_GROUP,
    sp_gather,
    sp_gather_whole,
    sp_scatter,
    sp_split,
    tp_copy,
    tp_gather,
    tp_reduce,
    tp_split,
)

STYLES = ("colwise", "rowwise", "colwise_rep", "vocab", "sequence", "replicate",
          "sequence_block", "sequence_split", "sequence_gather", "rowwise_split")
MODULE_STYLES = ("replicate", "sequence_block", "sequence_split", "sequence_gather")
"""Styles that name any module and split no weight."""
ROW_SPLIT = ("colwise", "colwise_rep", "vocab")
"""Styles that keep a slice of the weight's rows (dim 0) on each rank."""


def parse_style(style: str) -> tuple[str, int]:
    """`"colwise:3"` -> ("colwise", 3); raises ValueError on anything unknown."""
    name, _, parts = style.partition(":")
    if name not in STYLES or (parts and (not parts.isdigit() or int(parts) < 1)) or (
            parts and name != "colwise"):
        raise ValueError(f"unknown tensor-parallel style {style!r}; use colwise, colwise:K, "
                         "rowwise, rowwise_split, colwise_rep, vocab, sequence, replicate, "
                         "sequence_block, sequence_split or sequence_gather")
    return name, int(parts or 1)


def plan_targets(plan: Iterable[tuple[str, str]], module_names: Iterable[str]
                 ) -> dict[str, tuple[str, int]]:
    """Module name -> (style, parts) for every module a glob of the plan names, of the
    styles that split a weight (`MODULE_STYLES` split nothing)."""
    names = list(module_names)
    out: dict[str, tuple[str, int]] = {}
    for pattern, style in plan:
        if parse_style(style)[0] in MODULE_STYLES:
            continue
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module")
        for n in hits:
            out[n] = parse_style(style)
    return out


def check_divisible(weight_shape: tuple[int, ...], style: str, parts: int, degree: int
                    ) -> str | None:
    """Why a linear weight of this shape cannot be split `degree` ways, or None."""
    out_f, in_f = weight_shape
    if style == "sequence":
        return None  # kept whole
    if style in ROW_SPLIT and out_f % (parts * degree):
        what = "vocabulary rows" if style == "vocab" else "output features"
        return f"{out_f} {what} are not {parts} part(s) divisible by tp={degree}"
    if style in ("rowwise", "rowwise_split") and in_f % degree:
        return f"{in_f} input features are not divisible by tp={degree}"
    return None


_last_entry: tuple[weakref.ref, torch.Tensor, bool, int] | None = None


def _enter(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Into a column-parallel layer: f, or with sequence parallelism the gather of the
    sequence (dim 1) whose gradient is reduce-scattered back. Layers reading one input (q, k
    and v; SwiGLU's gate and up) share one f or gather, whose backward then all-reduces
    (reduce-scatters) their summed gradient once, as Megatron's fused QKV and FC1 do."""
    global _last_entry
    if getattr(m, "sp_in_block", False):  # its block gathered the sequence already
        return x
    key = (m.sequence_parallel, m.tp_degree)
    if _last_entry is not None and _last_entry[0]() is x and _last_entry[2:] == key:
        return _last_entry[1]
    y = sp_gather(x, TP_GROUP, m.tp_degree) if m.sequence_parallel else tp_copy(x, TP_GROUP)
    _last_entry = (weakref.ref(x), y, *key)  # y held until the next layer enters
    return y


def _leave(m: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """Out of a row-parallel layer: g, or with sequence parallelism the reduce-scatter of
    the partial sums over the sequence (each rank keeps 1/t of the tokens); inside a
    `sequence_block`, nothing: the block reduce-scatters its output."""
    if getattr(m, "sp_in_block", False):
        return y
    if m.sequence_parallel:
        return sp_scatter(y, TP_GROUP, m.tp_degree)
    return tp_reduce(y, TP_GROUP)


class ColwiseLinear(nn.Linear):
    """A Linear holding this rank's rows; forward enters through f."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_enter(self, x), self.weight, self.bias)


class ColwiseRepLinear(nn.Linear):
    """A column-parallel Linear whose output is gathered whole (last dim) on every rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(_enter(self, x), self.weight, self.bias)
        return tp_gather(y, TP_GROUP, self.tp_degree)


class VocabEmbedding(nn.Embedding):
    """An Embedding holding rows `vocab_start:vocab_start + num_embeddings` of the whole
    (`vocab_start`: a 0-d buffer holding this rank's first row)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_start + self.num_embeddings)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                        self.scale_grad_by_freq, self.sparse)
        return _leave(self, y.masked_fill(outside.unsqueeze(-1), 0.0))


class SequenceEmbedding(nn.Embedding):
    """A position table under sequence parallelism: the whole lookup, then this rank's
    share of its rows (`sp_rank`: a 0-d buffer, as `vocab_start` is); the table enters
    through f, so its gradient (its rows for this rank's positions) is summed."""

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        y = F.embedding(pos, tp_copy(self.weight, TP_GROUP), self.padding_idx, self.max_norm,
                        self.norm_type, self.scale_grad_by_freq, self.sparse)
        # index_select, not [sp_rank]: a tensor index stays a tensor op (no .item()), so
        # the region also runs on meta tensors, where the memory model measures it
        share = y.view(self.tp_degree, -1, *y.shape[1:])
        return share.index_select(0, self.sp_rank.reshape(1)).squeeze(0)


class RowwiseLinear(nn.Linear):
    """A Linear holding this rank's input columns; forward leaves through g, then bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _leave(self, F.linear(x, self.weight))
        if self.bias is None:
            return y
        # with sequence parallelism the bias meets 1/t of the tokens: sum its gradient
        return y + (tp_copy(self.bias, TP_GROUP) if self.sequence_parallel else self.bias)


class RowwiseSplitLinear(RowwiseLinear):
    """A row-parallel Linear entered from code every rank runs whole: this rank's slice of
    the input features first (backward: the slices' gradients gathered)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(tp_split(x, TP_GROUP, self.tp_degree))


def _rows(t: torch.Tensor, parts: int, degree: int, rank: int) -> torch.Tensor:
    """This rank's slice of each of `parts` equal blocks of dim 0."""
    blocks = t.chunk(parts, dim=0)
    return torch.cat([b.chunk(degree, dim=0)[rank] for b in blocks], dim=0)


def shard_linears(model: nn.Module, plan: Iterable[tuple[str, str]], degree: int,
                  rank: int, sequence_parallel: bool = False) -> None:
    """Replace the planned Linears' parameters by rank `rank`'s shards, in place.

    Works on meta (capture) and real tensors (workers); names of modules and parameters
    stay the same, so the captured graph's parameter names still find them.
    """
    if degree == 1:
        return
    modules = dict(model.named_modules())
    # a weight tied between two row-split layers (embedding and output) keeps one slice
    sliced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(whole): (whole, slice)
    for name, (style, parts) in plan_targets(plan, modules).items():
        m = modules[name]
        want = nn.Embedding if style in ("vocab", "sequence") else nn.Linear
        if style == "sequence":
            if type(m) is not want:
                raise ValueError(f"tensor-parallel plan entry {name!r} is a "
                                 f"{type(m).__name__}; style sequence splits an nn.Embedding")
            if sequence_parallel:
                m.__class__ = SequenceEmbedding
                m.tp_degree = degree
                m.register_buffer("sp_rank", torch.tensor(rank, device=m.weight.device),
                                  persistent=False)
            continue
        if type(m) is not want:
            raise ValueError(f"tensor-parallel plan entry {name!r} is a {type(m).__name__}; "
                             f"style {style} splits an nn.{want.__name__}")
        why = check_divisible(tuple(m.weight.shape), style, parts, degree)
        if why:
            raise ValueError(f"{name}: {why}")
        with torch.no_grad():
            old = m.weight
            if style in ROW_SPLIT:
                w = _rows(m.weight, parts, degree, rank)
                b = None if getattr(m, "bias", None) is None else _rows(m.bias, parts, degree,
                                                                         rank)
            else:
                w, b = m.weight.chunk(degree, dim=1)[rank], m.bias
            m.tp_degree, m.sequence_parallel = degree, sequence_parallel
            if style == "vocab":
                m.__class__ = VocabEmbedding
                # a buffer, not a Python int: a captured graph is shared by every rank of a
                # stage, and feeds each its own buffers (a constant would be rank 0's)
                m.register_buffer("vocab_start", torch.tensor(rank * w.shape[0],
                                                              device=w.device),
                                  persistent=False)
                m.num_embeddings = w.shape[0]
            else:
                m.__class__ = {"colwise": ColwiseLinear, "colwise_rep": ColwiseRepLinear,
                               "rowwise": RowwiseLinear,
                               "rowwise_split": RowwiseSplitLinear}[style]
                m.out_features, m.in_features = w.shape
            if id(old) in sliced and style in ROW_SPLIT:
                m.weight = sliced[id(old)][1]
            else:
                m.weight = nn.Parameter(w.clone(), requires_grad=old.requires_grad)
                sliced[id(old)] = (old, m.weight)  # holding `old` keeps its id unique
            if b is not None:
                m.bias = nn.Parameter(b.clone())
    for name, m in model.named_modules():  # a tied weight split in one layer only
        for leaf, p in m.named_parameters(recurse=False):
            if id(p) in sliced and p is sliced[id(p)][0]:
                raise ValueError(f"{name}.{leaf} is tied to a tensor-parallel layer's weight; "
                                 "split every layer using it by rows (vocab, colwise_rep)")
    replicated = set(_module_style(plan, modules, "replicate"))
    for n in replicated:
        modules[n].__class__ = _replicated(type(modules[n]))
    if sequence_parallel:
        split = set(plan_targets(plan, modules))
        _sequence_modules(plan, modules, split, degree)
        # every other layer with parameters (norms, the row-parallel biases' owners are
        # split already) that sees 1/t of the tokens: its gradients are partial sums
        inside = _sequence_region(plan, modules)
        for n in split:  # a split layer after the sequence is gathered whole (an output
            if not inside(n):  # layer past `sequence_gather`): plain tensor parallelism
                modules[n].sequence_parallel = False
        for n, m in modules.items():
            if (n not in split and n not in replicated and inside(n)
                    and not getattr(m, "tp_split", False)  # already TP shards (experts)
                    and any(True for _ in m.parameters(recurse=False))):
                m.__class__ = _replicated(type(m))


def _module_style(plan: Iterable[tuple[str, str]], modules: dict[str, nn.Module], style: str
                  ) -> list[str]:
    """Names of the modules the plan's entries of (module) `style` match."""
    out = []
    for pattern, s in plan:
        if parse_style(s)[0] != style:
            continue
        hits = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module")
        out += [n for n in hits if n not in out]
    return out


def _sequence_modules(plan: Iterable[tuple[str, str]], modules: dict[str, nn.Module],
                      split: set[str], degree: int) -> None:
    """Sequence parallelism's module styles, in place (see the module docstring)."""
    plan = list(plan)
    for n in _module_style(plan, modules, "sequence_block"):
        inner = [k for k in split if k.startswith(n + ".")]
        for k in inner:
            if modules[k].__class__ is RowwiseLinear and modules[k].bias is not None:
                raise ValueError(f"{k}: a row-parallel bias inside a sequence_block would "
                                 "be added on every rank before the block's reduce-scatter")
            modules[k].sp_in_block = True
        modules[n].__class__ = _entering(type(modules[n]), sp_gather, sp_scatter)
        modules[n].tp_degree = degree
    for style, op in (("sequence_split", sp_split), ("sequence_gather", sp_gather_whole)):
        for n in _module_style(plan, modules, style):
            modules[n].__class__ = _entering(type(modules[n]), op, None)
            modules[n].tp_degree = degree


def _sequence_region(plan: Iterable[tuple[str, str]], modules: dict[str, nn.Module]
                     ) -> Callable[[str], bool]:
    """Which modules see 1/t of the tokens under sequence parallelism: those under the
    parent of a `sequence_split` module (the layer list), or without one every module."""
    parents = {n.rpartition(".")[0] for n in _module_style(plan, modules, "sequence_split")}
    if not parents:
        return lambda name: True
    return lambda name: any(name.startswith(p + ".") for p in parents)


_ENTERING: dict[tuple[type, object, object], type] = {}


def _entering(cls: type, enter: Callable[..., torch.Tensor],
              leave: Callable[..., torch.Tensor] | None) -> type:
    """`cls` whose forward passes its first tensor input (the first positional argument,
    or `hidden_states`) through `enter(x, TP_GROUP, self.tp_degree)` and, with `leave`, its
    output (or the output's first element) through `leave` likewise."""
    key = (cls, enter, leave)
    if key not in _ENTERING:
        def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
            def into(x: torch.Tensor) -> torch.Tensor:
                return enter(x, TP_GROUP, self.tp_degree)
            if args:
                args = (into(args[0]), *args[1:])  # type: ignore[arg-type]
            else:
                name = "hidden_states" if "hidden_states" in kwargs else next(
                    k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
                kwargs = {**kwargs, name: into(kwargs[name])}  # type: ignore[arg-type]
            out = cls.forward(self, *args, **kwargs)
            if leave is None:
                return out
            if isinstance(out, torch.Tensor):
                return leave(out, TP_GROUP, self.tp_degree)
            first = leave(out[0], TP_GROUP, self.tp_degree)  # type: ignore[index]
            return type(out)((first, *out[1:]))  # type: ignore[index, call-arg]

        _ENTERING[key] = type(f"Sequence{cls.__name__}", (cls,), {"forward": forward})
    return _ENTERING[key]


_REPLICATED: dict[type, type] = {}


def _replicated(cls: type) -> type:
    """`cls` whose forward sees each of its own parameters through f (identity forward,
    gradient all-reduced over the tensor-parallel group), under the same names."""
    if cls not in _REPLICATED:
        def forward(self: nn.Module, *args: object, **kwargs: object) -> object:
            own = dict(self._parameters)
            try:
                for k, p in own.items():
                    if p is not None:
                        self._parameters[k] = tp_copy(p, TP_GROUP)  # type: ignore[assignment]
                return cls.forward(self, *args, **kwargs)
            finally:
                self._parameters.update(own)

        _REPLICATED[cls] = type(f"Replicated{cls.__name__}", (cls,), {"forward": forward})
    return _REPLICATED[cls]
