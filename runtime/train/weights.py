"""Parameters from a model folder's `*.safetensors`, each rank reading only its own.

A rank builds the model with its parameters on meta (buffers real: rotary tables and masks
are computed, not stored), cuts it to its tensor/expert-parallel slice, then reads from the
files only the tensors of its own stages, and of a tensor-parallel layer only its rows or
columns (`safe_open`'s lazy slices). So no process ever holds the whole model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Self

import torch
from torch import nn

from piper.errors import PiperError
from piper.model_file import ModelSpec
from piper.sharding import ModelSharding
from runtime.train.layout import Piece, Slicing


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered meanwhile lives on meta (its init costs nothing); buffers
    stay where they are made. Each parameter exists for real only for a moment, alone."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def tensor_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (headers only are read)."""
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[k] = f
    return out


def check_weights(spec: ModelSpec) -> None:
    """Every parameter of the model has a tensor of its shape in `spec.weights` (headers
    only are read): a folder that does not fit the config is an input error on the driver,
    not a worker failing in setup."""
    with torch.device("meta"):
        model = spec.build()
    files = tensor_files(spec.weights)  # type: ignore[arg-type]
    with Stored(files) as reader:
        for names, p in _parameters(model):
            source = _stored(names, files, spec)
            _same_shape(reader.shape(source), _label(source), names[0], p,
                        spec.weights)  # type: ignore[arg-type]


def load_rank_model(spec: ModelSpec, device: torch.device, sharding: ModelSharding,
                    tp_rank: int, ep_rank: int, needed: set[str]) -> nn.Module:
    """The model with the parameters named in `needed` (and their tied aliases) read from
    `spec.weights`, this rank's slice of each; the others stay on meta."""
    assert spec.weights is not None
    with parameters_on_meta():
        model = spec.build()
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    # what tensor, expert and expert tensor parallelism leave this rank of each parameter,
    # as checkpoints lay out a rank's pieces (`Slicing`)
    cut = Slicing(sharding, [n for n, _ in model.named_modules()], full, tp_rank, ep_rank)
    sharding.apply(model, tp_rank, ep_rank)
    files = tensor_files(spec.weights)
    with Stored(files) as reader:
        for names, old in _parameters(model):
            if not set(names) & needed:
                continue
            source = _stored(names, files, spec)
            # shapes were checked against the files on the driver (`check_weights`)
            t = _read_pieces(reader, source, cut.pieces(names[0]), tuple(old.shape))
            new = nn.Parameter(t.to(device=device, dtype=old.dtype),
                               requires_grad=old.requires_grad)
            for n in names:
                owner, _, leaf = n.rpartition(".")
                model.get_submodule(owner)._parameters[leaf] = new
    for name, b in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = b.to(device)
    return model


def _parameters(model: nn.Module) -> list[tuple[list[str], nn.Parameter]]:
    """Each parameter once, with every name it has (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return [(names[k], params[k]) for k in names]


Source = str | tuple[tuple[str, ...], int]
"""Where a parameter is stored: a tensor's name, or stacked experts kept one tensor per
expert (`ModelSpec.stored_as`: the per-expert templates and the dimension they join on)."""


def _stored(names: list[str], stored: Mapping[str, Any], spec: ModelSpec) -> Source:
    """Where one of `names` (a parameter's aliases) is stored."""
    hit = next((n for n in names if n in stored), None)
    if hit is None and spec.stored_as is not None:
        hit = next((s for n in names if (s := spec.stored_as(n, stored)) is not None), None)
    if hit is None:
        raise PiperError(f"{spec.weights}: no tensor for parameter {names[0]} in its "
                         "*.safetensors files (saved from another model or version?)")
    return hit


def _label(source: Source) -> str:
    return source if isinstance(source, str) else source[0][0].format(e="*")


class Stored:
    """Open safetensors files, read lazily: a stored tensor's shape, slices of it, and a
    stacked parameter's slices assembled from its per-expert tensors."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = files
        self.stack = contextlib.ExitStack()
        self.open: dict[Path, Any] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def handle(self, name: str) -> Any:
        from safetensors import safe_open

        f = self.files[name]
        if f not in self.open:
            self.open[f] = self.stack.enter_context(safe_open(str(f), framework="pt"))
        return self.open[f]

    def _slice(self, name: str) -> Any:
        return self.handle(name).get_slice(name)

    def experts(self, parts: tuple[str, ...]) -> int:
        n = 0
        while all(p.format(e=n) in self.files for p in parts):
            n += 1
        return n

    def shape(self, source: Source) -> tuple[int, ...]:
        if isinstance(source, str):
            return tuple(self._slice(source).get_shape())
        parts, cat = source
        shapes = [list(self._slice(p.format(e=0)).get_shape()) for p in parts]
        shapes[0][cat] = sum(s[cat] for s in shapes)
        return (self.experts(parts), *shapes[0])

    def box(self, source: Source, at: tuple[int, ...], sizes: tuple[int, ...]
            ) -> torch.Tensor:
        """Elements `at:at+sizes` of the stored tensor (or of the stacked one the per-expert
        tensors make), reading nothing else."""
        index = tuple(slice(a, a + n) for a, n in zip(at, sizes))
        if isinstance(source, str):
            return self._slice(source)[index] if index else self.handle(source).get_tensor(
                source)
        parts, cat = source
        rows = []
        for e in range(at[0], at[0] + sizes[0]):
            pieces, start = [], 0
            for p in parts:
                sl = self._slice(p.format(e=e))
                size = sl.get_shape()[cat]
                lo = max(at[cat + 1], start)
                hi = min(at[cat + 1] + sizes[cat + 1], start + size)
                if lo < hi:
                    inner = list(index[1:])
                    inner[cat] = slice(lo - start, hi - start)
                    pieces.append(sl[tuple(inner)])
                start += size
            rows.append(torch.cat(pieces, dim=cat))
        return torch.stack(rows)


def _same_shape(shape: tuple[int, ...], stored: str, name: str, param: torch.Tensor,
                folder: str) -> None:
    if shape != tuple(param.shape):
        raise PiperError(f"{folder}: tensor {stored} has shape {shape}, the model's {name} "
                         f"{tuple(param.shape)}")


def _read_pieces(reader: Stored, source: Source, pieces: list[Piece], shape: tuple[int, ...]
                 ) -> torch.Tensor:
    """A rank's part of a stored tensor made of `pieces` (its experts, each hidden half's
    slice), read piece by piece: nothing else of the tensor is loaded."""
    out: torch.Tensor | None = None
    for p in pieces:
        block = reader.box(source, p.full, p.sizes)
        if out is None:
            out = torch.empty(shape, dtype=block.dtype)
        out[tuple(slice(o, o + n) for o, n in zip(p.local, p.sizes))] = block
    assert out is not None
    return out


def load_all_weights(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """Every parameter and stored buffer of `model` from `spec.weights` (single-device eager
    training, the reference a run is checked against), stored tensors under their own names
    or where `spec.stored_as` says."""
    from safetensors.torch import load_file

    assert spec.weights is not None
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(spec.weights).glob("*.safetensors")):
        state.update(load_file(str(f)))
    files = tensor_files(spec.weights)
    with Stored(files) as reader:
        for names, _ in _parameters(model):
            source = _stored(names, files, spec)
            if source != names[0]:  # another name, or assembled from per-expert tensors
                shape = reader.shape(source)
                state[names[0]] = reader.box(source, (0,) * len(shape), shape)
    model.load_state_dict(state, strict=False)
    return model
