"""ClusterSpec: the handful of hardware figures the cost models need, and a built-in catalog.

    piper-plan clusters                      # lists CATALOG
    piper-plan search MODEL.py --gpus 16 --cluster h200
    piper-plan search MODEL.py --gpus 16 --cluster my_cluster.toml

A spec file is flat TOML with the field names of `ClusterSpec`; `to_toml` writes one, and
`piper-plan profile` writes one measured on the machine it runs on. Fitted collectives are
inline tables: `all_reduce = { latency = 4.1e-05, bandwidth = 1.9e9 }`.

`flops` is the peak dense rate of the math PyTorch runs *by default* for fp32 tensors:
`torch.get_float32_matmul_precision()` is "highest", so CUDA matmuls use IEEE fp32 on the
CUDA cores, not TF32 tensor cores (8x faster on A100, 7x on H100). The runtime trains in fp32
to reproduce single-device losses to rtol 1e-4, which TF32 would not, so the fp32 figure is
what a measured run reaches. A cluster that enables TF32 can say so in its own spec file.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import fields
from pathlib import Path

from cost_models.catalog import CATALOG
from cost_models.spec import COLLECTIVE_FIELDS, AlphaBeta, ClusterSpec, GiB, is_number
from piper.errors import PiperError

__all__ = [
    "CATALOG",
    "COLLECTIVE_FIELDS",
    "AlphaBeta",
    "ClusterSpec",
    "GiB",
    "load_cluster",
    "to_toml",
]



def load_cluster(name_or_path: str) -> ClusterSpec:
    """A catalog entry by name, or a spec from a TOML file; PiperError names what is wrong."""
    if name_or_path in CATALOG:
        return CATALOG[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise PiperError(f"unknown cluster {name_or_path!r}: not a catalog name or a file; "
                         f"known: {_known()}")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise PiperError(f"cluster file {path}: cannot read it as TOML: {e}; "
                         f"or use a known cluster: {_known()}") from None
    return _from_dict(data, path)


def _from_dict(data: dict, path: Path) -> ClusterSpec:
    names = [f.name for f in fields(ClusterSpec)]
    unknown = sorted(set(data) - set(names))
    optional = {f.name for f in fields(ClusterSpec) if f.name not in _REQUIRED}
    missing = [n for n in names if n not in data and n not in optional]
    if unknown or missing:
        raise PiperError(f"cluster file {path}: missing {missing}, unknown {unknown}; "
                         f"fields are {names}; or use a known cluster: {_known()}")
    for f in ("name", "device", "source"):
        if f in data and not isinstance(data[f], str):
            raise PiperError(f"cluster file {path}: {f} must be a string, got {data[f]!r}")
    data = {"name": path.stem, "device": "", "source": str(path)} | data
    for f in fields(ClusterSpec):
        # TOML spells 1e9 as an integer as often as a float; both mean the same figure
        if f.type in ("float", "float | None") and is_number(data.get(f.name)):
            data[f.name] = float(data[f.name])
    for f in COLLECTIVE_FIELDS:
        if f in data:
            data[f] = _alpha_beta(data[f], f, path)
    # [[bytes, bytes/s], ...] and [[keys, forward, causal forward, backward], ...]
    for f in ("intra_node_busbw", "attention_curve"):
        if isinstance(data.get(f), list):
            data[f] = tuple(
                tuple(float(x) if is_number(x) else x for x in p) if isinstance(p, list) else p
                for p in data[f])
    try:
        return ClusterSpec(**data)
    except PiperError as e:
        raise PiperError(f"cluster file {path}: {e}") from None


_REQUIRED = ("gpus_per_node", "memory_bytes", "flops", "compute_efficiency",
             "intra_node_bandwidth", "intra_node_latency", "inter_node_bandwidth",
             "inter_node_latency")


def _alpha_beta(v: object, name: str, path: Path) -> AlphaBeta:
    if not isinstance(v, dict) or set(v) != {"latency", "bandwidth"}:
        raise PiperError(f"cluster file {path}: {name} must be a table "
                         f"{{ latency = SECONDS, bandwidth = BYTES_PER_S }}, got {v!r}")
    try:
        return AlphaBeta(**{k: float(x) if is_number(x) else x for k, x in v.items()})
    except PiperError as e:
        raise PiperError(f"cluster file {path}: {name}: {e}") from None


def to_toml(spec: ClusterSpec) -> str:
    """The spec as flat TOML that `load_cluster` reads back to an equal spec."""
    lines = []
    for f in fields(ClusterSpec):
        v = getattr(spec, f.name)
        if v is None:
            continue
        lines.append(f"{f.name} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: object) -> str:
    if isinstance(v, tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, AlphaBeta):
        return (f"{{ latency = {_toml_value(v.latency)}, "
                f"bandwidth = {_toml_value(v.bandwidth)} }}")
    if isinstance(v, str):
        # TOML basic strings share JSON's escapes except \/ and \uXXXX surrogates; spell them out
        out = ['"']
        for ch in v:
            if ch in '"\\':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04x}")
            else:
                out.append(ch)
        return "".join(out) + '"'
    if isinstance(v, float):
        return "inf" if v == math.inf else repr(v)
    return str(v)


def _known() -> str:
    return ", ".join(CATALOG)


def device_peak_flops(device: str, low_precision: bool) -> float | None:
    """Peak dense FLOP/s of one worker's device for the precision: the catalog entry of the
    local GPU's model (None if the catalog does not know it); on CPU the `cpu` entry."""
    if device == "cpu":
        return CATALOG["cpu"].peak_flops(low_precision)
    import torch

    name = torch.cuda.get_device_name(0).upper()
    for spec in CATALOG.values():
        model = spec.device.split()[1].split("-")[0].upper() if spec.device.startswith(
            "NVIDIA") else None
        if model and model in name:
            return spec.peak_flops(low_precision)
    return None
