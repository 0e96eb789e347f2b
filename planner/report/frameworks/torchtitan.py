"""A strategy as a torchtitan job config: the TOML schema of torchtitan 0.2 (its last
release read from TOML; `torchtitan.config.ConfigManager` with `--job.config_file`).

What maps (torchtitan 0.2.2, torchtitan/config/job_config.py): data_parallel_replicate_degree
(DDP), data_parallel_shard_degree with fsdp_reshard_after_forward (FSDP2: "always" is ZeRO-3,
"never" keeps the gathered parameters to the backward, ZeRO-2's memory), tensor, pipeline
and expert degrees, pipeline_parallel_schedule (torch.distributed.pipelining's names),
module_fqns_per_model_part (our stage split, in torchtitan's module names),
[activation_checkpoint], and the batch: local_batch_size is per data-parallel rank and
step at pp > 1 (split into pipeline_parallel_microbatch_size microbatches), and one
accumulation microbatch at pp = 1, where global_batch_size sets the accumulation steps.
"""

from __future__ import annotations

from typing import Any

from piper.errors import PiperError
from planner.report.frameworks.layout import Exported, Layout

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
             "zb1p": "InterleavedZeroBubble", "dualpipev": "DualPipeV"}
"""Our schedules -> torch.distributed.pipelining's (torchtitan takes them by name)."""
MODELS = {"llama": "llama3", "qwen3": "qwen3"}
"""Model families torchtitan 0.2 defines (torchtitan/models)."""
FLAVORS = {("llama3", 256, 6): "debugmodel", ("llama3", 4096, 32): "8B",
           ("llama3", 8192, 80): "70B", ("llama3", 16384, 126): "405B",
           ("qwen3", 1024, 28): "0.6B", ("qwen3", 2048, 28): "1.7B",
           ("qwen3", 2560, 36): "4B", ("qwen3", 4096, 36): "8B", ("qwen3", 5120, 40): "14B",
           ("qwen3", 5120, 64): "32B"}
"""(model, dim, layers) -> flavor, from torchtitan 0.2.2's models/*/__init__.py."""
MOE_FLAVORS = {("qwen3", 2048, 48): "30B-A3B", ("qwen3", 4096, 94): "235B-A22B"}
"""The same for its mixture-of-experts flavors (Qwen3-MoE)."""


def torchtitan_config(lay: Layout) -> Exported:
    notes: list[str] = []
    name = MODELS.get(lay.model.family or "")
    if lay.model.experts and name != "qwen3":  # Mixtral: torchtitan's llama3 has no experts
        name = None
    if name is None:
        notes.append("model: torchtitan defines no model of this family (it has llama3, "
                     "qwen3, llama4, deepseek_v3): the model needs a port; llama3 written "
                     "as a placeholder")
        name = "llama3"
    flavor = (MOE_FLAVORS if lay.model.experts else FLAVORS).get(
        (name, lay.model.dim, lay.model.layers))
    if flavor is None:
        notes.append(f"model: no {name} flavor has dim {lay.model.dim} and "
                     f"{lay.model.layers} layers: add one to its model args (debugmodel "
                     "written)")
        flavor = "debugmodel"
    if lay.zero == 1:
        notes.append("zero 1: torchtitan has no ZeRO-1; nearest: FSDP without resharding "
                     "after forward (ZeRO-2's memory)")
    replicate, shard = (lay.dp, 1) if lay.zero == 0 else (1, lay.dp)
    reshard = "always" if lay.zero == 3 else "never" if lay.zero else "default"
    if lay.tp > 1 and not lay.sp:
        notes.append("sp: torchtitan's tensor parallelism always runs sequence parallelism "
                     "(its norms are sequence-sharded)")
    if lay.comm_stream and lay.zero == 0:
        notes.append("comm stream: DDP overlaps its bucketed all-reduces with the backward "
                     "on its own; nothing to set")
    if lay.capacity:
        notes.append(f"capacity factor {lay.capacity:g}: torchtitan's experts are dropless; "
                     "nothing drops there")
    if lay.bucket_mb and lay.zero and not lay.units_are_blocks:
        notes.append(f"buckets of {lay.bucket_mb:g} MiB: torchtitan wraps one FSDP unit per "
                     f"transformer block ({lay.block_mib:.0f} MiB) instead")
    parallelism: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
        "fsdp_reshard_after_forward": reshard, "tensor_parallel_degree": lay.tp,
        "pipeline_parallel_degree": lay.pp, "context_parallel_degree": lay.cp,
        "expert_parallel_degree": lay.ep, "expert_tensor_parallel_degree": lay.etp}
    if lay.cp > 1:  # torch's ring of K/V shards ("alltoall") or all of them gathered
        parallelism["context_parallel_rotate_method"] = (
            "alltoall" if lay.cp_attention == "ring" else "allgather")
        if lay.zero == 0:
            notes.append("cp: torchtitan shards parameters with FSDP over the "
                         "context-parallel ranks (piper-plan sums their gradients as DDP)")
    if lay.pp > 1:
        schedule = SCHEDULES[lay.schedule]
        if lay.schedule == "zb1p":
            notes.append("schedule zb1p: torch's InterleavedZeroBubble (ZB-1P's splitting of "
                         "the backward, looped over the rank's stages)")
        parallelism.update(pipeline_parallel_schedule=schedule,
                           pipeline_parallel_microbatch_size=lay.microbatch_size,
                           module_fqns_per_model_part=[_fqns(rs) for rs in lay.stage_regions])
    mode, option = _checkpointing(lay.recompute, notes)
    local = lay.local_batch if lay.pp > 1 else lay.microbatch_size
    training = {"local_batch_size": local, "global_batch_size": lay.global_batch,
                "seq_len": lay.model.seq or 2048, "max_norm": 1.0,
                "mixed_precision_param": "float32" if lay.precision == "fp32" else "bfloat16",
                "mixed_precision_reduce": "float32"}
    sections = {
        "job": {"dump_folder": "./outputs",
                "description": f"piper-plan: {lay.gpus} devices, dp {lay.dp} pp {lay.pp} "
                               f"tp {lay.tp}" + (f" cp {lay.cp}" if lay.cp > 1 else "")},
        "model": {"name": name, "flavor": flavor},
        "training": training,
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": mode, "selective_ac_option": option},
    }
    nodes = max(1, lay.gpus // 8)
    head = [f"# torchtitan job config written by piper-plan ({lay.gpus} devices)",
            (f"# launch: torchrun --nnodes {nodes} --nproc_per_node {min(lay.gpus, 8)} "
             "-m torchtitan.train --job.config_file THIS_FILE"),
            *(f"# note: {n}" for n in notes), ""]
    return Exported("\n".join(head) + toml(sections), tuple(notes))


def _checkpointing(recompute: bool | str, notes: list[str]) -> tuple[str, str]:
    if recompute is True:
        return "full", "2"
    if not recompute:
        return "none", "2"
    if recompute == "attention":
        notes.append("recompute attention: torchtitan's selective AC has no attention-only "
                     "policy; nearest: per-op (op)")
    else:
        notes.append("recompute op: torchtitan's per-op policy also recomputes every other "
                     "matmul (less memory, more time than piper-plan priced)")
    return "selective", "op"


def _fqns(regions: tuple[str, ...]) -> list[str]:
    """Our regions in torchtitan's module names (its llama3 and qwen3 Transformer)."""
    out: list[str] = []
    for r in regions:
        if r == "embed":
            out.append("tok_embeddings")
        elif r.startswith("layer."):
            out.append("layers." + r.removeprefix("layer."))
        elif r == "head":
            out += ["norm", "output"]
        else:
            raise PiperError(f"region {r!r} has no torchtitan module to name: export the "
                             "strategy without --to, or name regions embed, layer.N, head")
    return out


def toml(sections: dict[str, dict[str, Any]]) -> str:
    """TOML text of two-level `sections` (strings, numbers, booleans, lists of them)."""
    lines = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {v!r}")
