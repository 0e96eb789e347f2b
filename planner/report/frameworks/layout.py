"""A found strategy as the frameworks' configs see it: degrees, batch arithmetic, the stage
split in layers, and the model's shape and family (to pick the target's own model).

Everything here comes from a search's record (the Program and its summary) and the model
file or Hugging Face config the study names; the writers (`torchtitan`, `megatron`,
`deepspeed`) only format it, and say what their target cannot express.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from piper.directives import Place, ShardSequence
from piper.model_file import ModelSpec
from piper.program import Program


@dataclass(frozen=True)
class ModelShape:
    """What a target's own model definition needs: `family` (llama, qwen3, gpt, or None:
    not one the targets define) and its dims (0: unknown)."""

    family: str | None = None
    layers: int = 0
    dim: int = 0
    heads: int = 0
    kv_heads: int = 0
    ffn: int = 0
    vocab: int = 0
    seq: int = 0
    tied: bool = False
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    top_k: int = 0
    moe_ffn: int = 0
    """Each expert's hidden size."""
    router_renorm: bool = True
    """The top-k gate weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's
    norm_topk_prob); False: the softmax over all experts, kept as it is."""

    @property
    def layer_mib(self) -> float:
        """MiB of one transformer block's fp32 parameters (0: unknown)."""
        if self.family in ("llama", "qwen3"):
            kv = self.dim // self.heads * self.kv_heads if self.heads else 0
            n = 2 * self.dim ** 2 + 2 * self.dim * kv + 3 * self.dim * self.ffn
        elif self.family == "gpt":
            n = 4 * self.dim ** 2 + 2 * self.dim * self.ffn
        else:
            return 0.0
        return 4 * n / 2**20


@dataclass(frozen=True)
class Layout:
    """A strategy in the terms every framework uses."""

    gpus: int
    dp: int
    pp: int
    tp: int
    sp: bool
    ep: int
    zero: int
    schedule: str
    virtual_stages: int
    microbatches: int
    """Microbatches per data-parallel replica per step (gradient accumulation at pp=1)."""
    global_batch: int
    recompute: bool | str
    comm_stream: bool
    bucket_mb: float | None
    precision: str
    stage_layers: tuple[int, ...]
    """Transformer layers per stage, in stage order (chunks of a device interleaved)."""
    stage_regions: tuple[tuple[str, ...], ...]
    model: ModelShape
    cp: int = 1
    cp_attention: str = "ring"  # how context-parallel attention exchanges keys and values
    etp: int = 1  # expert tensor parallelism: 1 or tp
    ep_over_tp: bool = False  # EP groups over the tensor-parallel ranks too (Megatron's mesh)
    capacity: float = 0.0  # expert capacity factor per sequence; 0: dropless

    @property
    def microbatch_size(self) -> int:
        return self.global_batch // (self.dp * self.microbatches)

    @property
    def local_batch(self) -> int:
        """Samples per data-parallel replica per step."""
        return self.global_batch // self.dp

    @property
    def block_mib(self) -> float:
        """MiB of one transformer block's parameters on a rank (split tp ways): the FSDP
        unit torchtitan and Megatron's FSDP2 path wrap."""
        return self.model.layer_mib / self.tp

    @property
    def units_are_blocks(self) -> bool:
        """The strategy's buckets are one transformer block each (within 5%)."""
        block = self.block_mib
        return bool(self.bucket_mb) and abs(self.bucket_mb - block) <= 0.05 * block


def layout(program: Program, summary: dict[str, Any], global_batch: int, gpus: int,
           spec: ModelSpec | None, precision: str = "bf16-mixed") -> Layout:
    """`program` (with its `summary`) as a Layout; `spec`: the model, for its shape."""
    places = sorted((d for d in program.directives if isinstance(d, Place)),
                    key=lambda d: d.stage)
    regions = tuple(tuple(p.regions) for p in places)
    layers = tuple(sum(1 for r in rs if _LAYER.fullmatch(r)) for rs in regions)
    return Layout(
        gpus=gpus, dp=summary["dp"], pp=summary["pp"], tp=summary["tp"],
        sp=bool(summary.get("sp")), ep=summary.get("ep", 1), zero=summary["zero"],
        schedule=summary["schedule"], virtual_stages=summary.get("virtual_stages", 1),
        microbatches=summary["microbatches"], global_batch=global_batch,
        recompute=summary.get("recompute", False),
        comm_stream=bool(summary.get("comm_stream")), bucket_mb=summary.get("bucket_mb"),
        precision=precision, stage_layers=layers, stage_regions=regions,
        model=model_shape(spec) if spec is not None else ModelShape(),
        cp=summary.get("cp", 1), etp=summary.get("etp", 1),
        ep_over_tp=bool(summary.get("ep_over_tp")), capacity=summary.get("capacity", 0.0),
        cp_attention=next((d.attention for d in program.directives
                           if isinstance(d, ShardSequence)), "ring"))


_LAYER = re.compile(r"layer\.\d+")
_FAMILIES = {"llama": "llama", "qwen3": "qwen3", "qwen2": "qwen3", "mistral": "llama",
             "gpt2": "gpt", "mixtral": "llama", "qwen3_moe": "qwen3"}
"""Hugging Face model types -> the family whose layers a target builds (the MoE ones with
their experts: `ModelShape.experts`)."""


def _experts(config: Any) -> dict[str, Any]:
    """A Hugging Face MoE config's routed experts in `ModelShape`'s terms (none: dense)."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    if not experts or config.model_type not in _FAMILIES:
        return {}
    return {"experts": int(experts), "top_k": int(config.num_experts_per_tok),
            "moe_ffn": int(getattr(config, "moe_intermediate_size", None)
                           or config.intermediate_size),
            "router_renorm": bool(getattr(config, "norm_topk_prob", True))}


def model_shape(spec: ModelSpec) -> ModelShape:
    """The model's family and dims: a Hugging Face config's fields, or the config dataclass
    a model file's blocks keep (`examples/llama.py`, `examples/gpt.py`); unknown otherwise."""
    with torch.device("meta"):
        model = spec.build()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "model_type"):
        return ModelShape(
            family=_FAMILIES.get(config.model_type), layers=config.num_hidden_layers,
            dim=config.hidden_size, heads=config.num_attention_heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            ffn=getattr(config, "intermediate_size", 0) or 4 * config.hidden_size,
            vocab=config.vocab_size, seq=int(dict(spec.options).get("seq_len", 0)),
            tied=bool(getattr(config, "tie_word_embeddings", False)), **_experts(config))
    c = next((m.c for m in model.modules() if dataclasses.is_dataclass(getattr(m, "c", None))),
             None)
    if c is None or not hasattr(c, "dim"):
        return ModelShape()
    heads = getattr(c, "heads", 0)
    family = ("qwen3" if getattr(c, "qk_norm", False) else "llama") if hasattr(
        c, "kv_heads") else "gpt"
    return ModelShape(family=family, layers=c.layers, dim=c.dim, heads=heads,
                      kv_heads=getattr(c, "kv_heads", heads), ffn=getattr(c, "ffn", 4 * c.dim),
                      vocab=c.vocab, seq=c.seq, tied=bool(getattr(c, "tie", False)))


@dataclass(frozen=True)
class Exported:
    """A target's file, and a line for each choice it could not express as found (with the
    nearest one it took)."""

    text: str
    notes: tuple[str, ...] = ()
