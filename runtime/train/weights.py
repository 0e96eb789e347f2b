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
from typing import Any

import torch
from torch import nn

from piper.errors import PiperError
from piper.model_file import ModelSpec
from piper.sharding import ModelSharding
from piper.tensor_parallel import ROW_SPLIT, plan_targets


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
    from safetensors import safe_open

    with torch.device("meta"):
        model = spec.build()
    files = tensor_files(spec.weights)  # type: ignore[arg-type]
    for names, p in _parameters(model):
        stored = _stored(names, files, spec.weights)  # type: ignore[arg-type]
        with safe_open(str(files[stored]), framework="pt") as h:
            shape = tuple(h.get_slice(stored).get_shape())
        _same_shape(shape, stored, names[0], p, spec.weights)  # type: ignore[arg-type]


def load_rank_model(spec: ModelSpec, device: torch.device, sharding: ModelSharding,
                    tp_rank: int, ep_rank: int, needed: set[str]) -> nn.Module:
    """The model with the parameters named in `needed` (and their tied aliases) read from
    `spec.weights`, this rank's slice of each; the others stay on meta."""
    assert spec.weights is not None
    with parameters_on_meta():
        model = spec.build()
    sharding.apply(model, tp_rank, ep_rank)
    files = tensor_files(spec.weights)
    split = {f"{m}.{w}": (style, parts) for m, (style, parts) in plan_targets(
        sharding.tp_plan, [n for n, _ in model.named_modules()]).items()
        for w in ("weight", "bias")} if sharding.tp > 1 else {}
    handles: dict[Path, Any] = {}
    with contextlib.ExitStack() as stack:
        for names, old in _parameters(model):
            if not set(names) & needed:
                continue
            stored = _stored(names, files, spec.weights)
            f = files[stored]
            if f not in handles:
                from safetensors import safe_open

                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            t = _read(handles[f], stored, split.get(names[0]), sharding.tp, tp_rank,
                      names[0].endswith(".bias"))
            _same_shape(tuple(t.shape), stored, names[0], old, spec.weights)
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


def _stored(names: list[str], stored: Mapping[str, Any], folder: str) -> str:
    """The name one of `names` (a parameter's aliases) is stored under."""
    hit = next((n for n in names if n in stored), None)
    if hit is None:
        raise PiperError(f"{folder}: no tensor for parameter {names[0]} in its *.safetensors "
                         "files (saved from another model or version?)")
    return hit


def _same_shape(shape: tuple[int, ...], stored: str, name: str, param: torch.Tensor,
                folder: str) -> None:
    if shape != tuple(param.shape):
        raise PiperError(f"{folder}: tensor {stored} has shape {shape}, the model's {name} "
                         f"{tuple(param.shape)}")


def _read(handle: Any, name: str, style: tuple[str, int] | None, degree: int, rank: int,
          bias: bool) -> torch.Tensor:
    """The whole tensor, or this rank's rows (column-parallel: of each of `parts` fused
    blocks) or columns (row-parallel weight; its bias is whole)."""
    if style is None or style[0] == "sequence":  # a position table stays whole
        return handle.get_tensor(name)
    kind, parts = style
    sl = handle.get_slice(name)
    if kind in ROW_SPLIT:
        rows = sl.get_shape()[0]
        block = rows // parts
        piece = block // degree
        return torch.cat([sl[k * block + rank * piece:k * block + (rank + 1) * piece]
                          for k in range(parts)], dim=0)
    if bias:
        return handle.get_tensor(name)
    cols = sl.get_shape()[1]
    piece = cols // degree
    return sl[:, rank * piece:(rank + 1) * piece]


def load_all_weights(model: nn.Module, folder: str | Path) -> nn.Module:
    """Every parameter and stored buffer of `model` from the folder (single-device eager
    training, the reference a run is checked against)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(str(f)))
    for names, _ in _parameters(model):
        _stored(names, state, str(folder))
    model.load_state_dict(state, strict=False)
    return model
