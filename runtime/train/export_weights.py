"""`piper-plan export-weights`: a checkpoint of any strategy as one single-device state
dict in a safetensors file, loadable into the plain model with `load_state_dict(strict=True)`
(every name of a tied weight included)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from piper.errors import PiperError
from piper.loading import load_model
from runtime.train import checkpoint


def export_weights(path: str, out: str) -> int:
    """Write `out`; the number of tensors written."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise PiperError('export-weights writes safetensors: pip install -e ".[train]"'
                         ) from None

    folder = checkpoint.latest(path)
    if folder is None:
        raise PiperError(f"{path}: no complete checkpoint (a folder with {checkpoint.INFO})")
    info = checkpoint.info(folder)
    src, args = info["model"]
    spec = load_model(src, tuple(tuple(a) for a in args),
                      tuple(tuple(o) for o in info.get("options", ())))
    with torch.device("meta"):
        model = spec.build()
    md = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    first = {id(p): n for n, p in model.named_parameters()}
    keys: dict[str, str] = {}  # state-dict name -> checkpoint key
    params = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    for name in model.state_dict():
        keys[name] = (f"model.{first[id(params[name])]}" if name in params
                      else f"buffer.{name}")
    state: dict[str, torch.Tensor] = {}
    for key in dict.fromkeys(keys.values()):
        m = md.get(key)
        if not isinstance(m, TensorStorageMetadata):
            raise PiperError(f"{folder}: no tensor {key} (a checkpoint of another model?)")
        state[key] = torch.empty(m.size, dtype=m.properties.dtype)
    with warnings.catch_warnings():  # that one process reads it is the point, not news
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    tensors = {}
    for name, key in keys.items():  # a tied weight's other names get copies of their own
        t = state[key]
        tensors[name] = t if not any(v is t for v in tensors.values()) else t.clone()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out)
    return len(tensors)
