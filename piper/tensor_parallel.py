"""Tensor parallelism (Megatron-style) for `nn.Linear` layers, by a plan of module globs.

A model file may define `TP_PLAN = {"blocks.*.fc": "colwise", "blocks.*.out": "rowwise"}`
(TorchTitan's parallelize-plan idea). Styles:

    colwise      weight rows (output features) and bias split over the group; the input
                 enters through f (identity forward, all-reduce of its gradient backward)
    colwise:K    the output is K equal parts fused in one layer (e.g. q|k|v = colwise:3);
                 each rank keeps its slice of every part, so `chunk(K, -1)` stays right
    rowwise      weight columns (input features) split; the partial products leave through
                 g (all-reduce forward, identity backward); the bias is added once, after g
    replicate    any module, kept whole on every rank, whose parameters meet sharded
                 activations (a per-head q/k norm between column- and row-parallel layers):
                 each parameter enters through f, so its gradient is summed over the group
                 (Hugging Face's `replicated_with_grad_allreduce`)

A column-parallel layer followed by a row-parallel one needs no communication in between,
so each MLP or attention block costs one all-reduce forward and one backward. Code between
them sees the local width: write reshapes with -1 for the sharded dimension (heads), as
TorchTitan's models do.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from piper.collectives import TP_GROUP, tp_copy, tp_reduce

STYLES = ("colwise", "rowwise", "replicate")


def parse_style(style: str) -> tuple[str, int]:
    """`"colwise:3"` -> ("colwise", 3); raises ValueError on anything unknown."""
    name, _, parts = style.partition(":")
    if name not in STYLES or (parts and (not parts.isdigit() or int(parts) < 1)) or (
            parts and name != "colwise"):
        raise ValueError(f"unknown tensor-parallel style {style!r}; use colwise, colwise:K, "
                         "rowwise or replicate")
    return name, int(parts or 1)


def plan_targets(plan: Iterable[tuple[str, str]], module_names: Iterable[str]
                 ) -> dict[str, tuple[str, int]]:
    """Module name -> (style, parts) for every module a glob of the plan names, of the
    styles that split a Linear (`replicate` entries split nothing: see `replicated`)."""
    names = list(module_names)
    out: dict[str, tuple[str, int]] = {}
    for pattern, style in plan:
        if parse_style(style)[0] == "replicate":
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
    if style == "colwise" and out_f % (parts * degree):
        return f"{out_f} output features are not {parts} part(s) divisible by tp={degree}"
    if style == "rowwise" and in_f % degree:
        return f"{in_f} input features are not divisible by tp={degree}"
    return None


class ColwiseLinear(nn.Linear):
    """A Linear holding this rank's rows; forward enters through f."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(tp_copy(x, TP_GROUP), self.weight, self.bias)


class RowwiseLinear(nn.Linear):
    """A Linear holding this rank's input columns; forward leaves through g, then bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_reduce(F.linear(x, self.weight), TP_GROUP)
        return y if self.bias is None else y + self.bias


def _rows(t: torch.Tensor, parts: int, degree: int, rank: int) -> torch.Tensor:
    """This rank's slice of each of `parts` equal blocks of dim 0."""
    blocks = t.chunk(parts, dim=0)
    return torch.cat([b.chunk(degree, dim=0)[rank] for b in blocks], dim=0)


def shard_linears(model: nn.Module, plan: Iterable[tuple[str, str]], degree: int,
                  rank: int) -> None:
    """Replace the planned Linears' parameters by rank `rank`'s shards, in place.

    Works on meta (capture) and real tensors (workers); names of modules and parameters
    stay the same, so the captured graph's parameter names still find them.
    """
    if degree == 1:
        return
    modules = dict(model.named_modules())
    for name, (style, parts) in plan_targets(plan, modules).items():
        m = modules[name]
        if type(m) is not nn.Linear:
            raise ValueError(f"tensor-parallel plan entry {name!r} is a {type(m).__name__}, "
                             "not an nn.Linear")
        why = check_divisible(tuple(m.weight.shape), style, parts, degree)
        if why:
            raise ValueError(f"{name}: {why}")
        with torch.no_grad():
            if style == "colwise":
                w = _rows(m.weight, parts, degree, rank)
                b = None if m.bias is None else _rows(m.bias, parts, degree, rank)
                m.__class__ = ColwiseLinear
            else:
                w, b = m.weight.chunk(degree, dim=1)[rank], m.bias
                m.__class__ = RowwiseLinear
            m.weight = nn.Parameter(w.clone())
            if b is not None:
                m.bias = nn.Parameter(b.clone())
            m.out_features, m.in_features = w.shape
    for pattern, style in plan:
        if parse_style(style)[0] != "replicate":
            continue
        hits = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"tensor-parallel plan entry {pattern!r} matches no module")
        for n in hits:
            modules[n].__class__ = _replicated(type(modules[n]))


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
