"""Checkpoints under the model's own names, written and read with
`torch.distributed.checkpoint` (DCP), so a run under one strategy resumes under any other.

Every rank offers DCP the blocks of model tensors it holds (`runtime.train.layout.Box`, through
`Pieces`, which speaks DCP's chunk protocol): its parameters as `model.<name>` and each
optimizer state tensor as `optim.<name>.<key>` (e.g. `exp_avg`); persistent buffers as
`buffer.<name>`. On save only the copy that counts (`Box.owner`) is written, so the chunks
tile each tensor exactly once; on load every rank asks for all it holds and DCP reads the
overlaps, whatever layout wrote them (other pp, dp, tp, ep, ZeRO stage).

A checkpoint is a folder `step-NNNNNNN` with DCP's files and `piper.json` (the step, the
run's settings). It is written as `.tmp-step-NNNNNNN` and renamed by the driver once every
rank has finished, so a run killed while saving leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from piper.errors import PiperError
from runtime.train.layout import Box
from runtime.train.updates import Held

STEP_DIR = re.compile(r"^step-(\d+)$")
INFO = "piper.json"


class Pieces:
    """Blocks of one model tensor held by this rank, each a view of local memory; DCP
    writes them as chunks and reads any saved chunks' overlap into them."""

    def __init__(self, full: tuple[int, ...], blocks: list[tuple[Box, torch.Tensor]]) -> None:
        self.full = torch.Size(full)
        self.blocks = blocks

    def size(self) -> torch.Size:
        return self.full

    def __create_write_items__(self, fqn: str, _obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(b.offsets)),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(b.offsets),
                                                         torch.Size(b.sizes)),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self.full))
                for b, t in self.blocks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes))
                for b, _ in self.blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for b, t in self.blocks:
            if tuple(b.offsets) == tuple(index.offset or ()):
                return t
        raise ValueError(f"{index.fqn}: no block at {index.offset}")


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else \
            super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # DCP's setup replaces values of types it does not know by None: put ours back
        ours = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, *args, **kwargs)
        state_dict.update(ours)
        self.state_dict.update(ours)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else \
            super().lookup_tensor(index)


def _pieces(prefix: str, entries: Iterable[tuple[Box, torch.Tensor]], suffix: str = ""
            ) -> dict[str, Pieces]:
    out: dict[str, Pieces] = {}
    for box, carrier in entries:
        key = f"{prefix}{box.name}{suffix}"
        out.setdefault(key, Pieces(box.full, [])).blocks.append(
            (box, box.view(carrier.detach())))
    return out


def rank_state(held: list[Held], optim: dict[Any, torch.optim.Optimizer],
               buffers: dict[str, torch.Tensor], saving: bool) -> dict[str, Any]:
    """This rank's DCP state dict: for saving, the blocks it owns; for loading, every block
    it holds (parameters of ZeRO-1/2 into their whole gathered buffer)."""
    sd: dict[str, Any] = {}
    for h in held:
        if saving:
            params = [(b, h.param) for b in h.boxes if b.owner]
        elif h.whole is not None:
            params = [(b, h.whole[0]) for b in h.whole[1]]
        else:
            params = [(b, h.param) for b in h.boxes]
        sd.update(_merge(sd, _pieces("model.", params)))
        boxes = [b for b in h.boxes if b.owner or not saving]
        for k, v in optim[h.key].state.get(h.param, {}).items():
            if isinstance(v, torch.Tensor) and v.shape == h.param.shape:
                sd.update(_merge(sd, _pieces("optim.", [(b, v) for b in boxes], f".{k}")))
            elif isinstance(v, torch.Tensor):  # a per-tensor scalar (Adam's step)
                for b in boxes:
                    sd[f"optim.{b.name}.{k}"] = v
    sd.update({f"buffer.{n}": b for n, b in buffers.items()})
    return sd


def _merge(sd: dict[str, Any], new: dict[str, Pieces]) -> dict[str, Pieces]:
    for k, p in new.items():
        if k in sd:
            sd[k].blocks.extend(p.blocks)
    return {k: p for k, p in new.items() if k not in sd}


def prepare_optimizer_state(held: list[Held], optim: dict[Any, torch.optim.Optimizer],
                            path: str) -> None:
    """Create the optimizer state a checkpoint holds (optimizers make theirs lazily, in the
    first step) so that DCP can read into it: tensors shaped like the held tensor, and
    per-tensor scalars as saved."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for h in held:
        names = {b.name for b in h.boxes}
        if not names:
            continue
        state = optim[h.key].state[h.param]
        for key, m in md.items():
            parts = key.split(".")
            if parts[0] != "optim" or ".".join(parts[1:-1]) not in names:
                continue
            k = parts[-1]
            if k in state or not isinstance(m, TensorStorageMetadata):
                continue
            full = next(b.full for b in h.boxes if ".".join(parts[1:-1]) == b.name)
            if tuple(m.size) == tuple(full) and len(full) > 0:
                state[k] = torch.zeros_like(h.param, dtype=m.properties.dtype)
            else:
                state[k] = torch.zeros(m.size, dtype=m.properties.dtype)


def save(state: dict[str, Any], folder: str) -> None:
    dcp.save(state, checkpoint_id=folder, planner=_SavePlanner())


def load(state: dict[str, Any], folder: str) -> None:
    dcp.load(state, checkpoint_id=folder, planner=_LoadPlanner())


# ---- the driver's side -------------------------------------------------------------------
def step_folder(root: str | Path, step: int, tmp: bool = False) -> Path:
    return Path(root) / f"{'.tmp-' if tmp else ''}step-{step:07d}"


def commit(root: str | Path, step: int, info: dict[str, Any]) -> Path:
    """Make the checkpoint of `step` (written by every rank) the latest: its description,
    then one rename."""
    tmp, final = step_folder(root, step, tmp=True), step_folder(root, step)
    (tmp / INFO).write_text(json.dumps({"step": step, **info}, indent=1))
    if final.exists():  # a run from an earlier checkpoint wrote this step again
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root` (or `root` itself when it is one)."""
    root = Path(root)
    if (root / INFO).is_file():
        return root
    found = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := STEP_DIR.match(p.name))
             and (p / INFO).is_file()] if root.is_dir() else []
    return max(found)[1] if found else None


def info(folder: Path) -> dict[str, Any]:
    return json.loads((folder / INFO).read_text())


def check_compatible(folder: Path, full_shapes: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint holds every parameter of this model, with the same shape (a driver-side
    check: a mismatch is the user's input, not a worker failure)."""
    md = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    for name, shape in full_shapes.items():
        m = md.get(f"model.{name}")
        if m is None:
            raise PiperError(f"{folder}: no tensor for parameter {name} (a checkpoint of "
                             "another model?)")
        if tuple(m.size) != tuple(shape):
            raise PiperError(f"{folder}: {name} has shape {tuple(m.size)}, the model's "
                             f"{tuple(shape)}")

