"""A framework's config read back as piper-plan's shorthand (`simulate --from`): "how fast
is what I run today, and what would be faster?"

Each reader returns the shorthand fields (`pp`, `dp`, `tp`, `sp`, `ep`, `zero`, `schedule`,
`virtual_stages`, `microbatches`, `recompute`, `comm_stream`, `batch_size`; torchtitan's
`unit_per_layer`: its FSDP units are its transformer blocks) and a line for
each setting it read as the nearest piper-plan choice; a setting piper-plan cannot price at
all is a `PiperError`.
"""

from __future__ import annotations

import argparse
import shlex
import tomllib
from pathlib import Path
from typing import Any

from piper.errors import PiperError
from planner.report.frameworks.torchtitan import SCHEDULES

Shorthand = dict[str, Any]


def from_torchtitan(path: str, gpus: int) -> tuple[Shorthand, list[str]]:
    """A torchtitan 0.2 job TOML (its defaults where a key is absent)."""
    try:
        with open(path, "rb") as f:
            cfg = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise PiperError(f"--from torchtitan {path}: {e}") from None
    par, train = cfg.get("parallelism", {}), cfg.get("training", {})
    ac = cfg.get("activation_checkpoint", {})
    notes: list[str] = []
    tp, pp = int(par.get("tensor_parallel_degree", 1)), int(par.get("pipeline_parallel_degree", 1))
    cp, ep = int(par.get("context_parallel_degree", 1)), int(par.get("expert_parallel_degree", 1))
    etp = int(par.get("expert_tensor_parallel_degree", 1))
    replicate = int(par.get("data_parallel_replicate_degree", 1))
    shard = int(par.get("data_parallel_shard_degree", -1))
    if shard == -1:
        shard, rest = divmod(gpus, tp * pp * cp * replicate)
        if rest or shard < 1:
            raise PiperError(f"--from torchtitan {path}: tp {tp} x pp {pp} x cp {cp} x "
                             f"replicate {replicate} does not divide --gpus {gpus}")
    if replicate > 1 and shard > 1:
        notes.append(f"HSDP ({replicate} replicas of {shard}-way FSDP): read as {replicate * shard}"
                     "-way ZeRO-3")
    dp = replicate * shard
    reshard = par.get("fsdp_reshard_after_forward", "default")
    zero = 0 if shard == 1 else (2 if reshard == "never" else 3)
    local = int(train.get("local_batch_size", 8))
    batch = int(train.get("global_batch_size", -1))
    if pp > 1:
        mbs = int(par.get("pipeline_parallel_microbatch_size", 1))
        batch = local * dp if batch == -1 else batch
        microbatches = batch // (dp * mbs)
        names = {v: k for k, v in SCHEDULES.items()}
        given = par.get("pipeline_parallel_schedule", "1F1B")
        if given not in names:
            raise PiperError(f"--from torchtitan {path}: pipeline_parallel_schedule {given!r}: "
                             f"piper-plan runs {', '.join(sorted(names))}")
        schedule = names[given]
        parts = par.get("module_fqns_per_model_part")
        v = len(parts) // pp if parts else (2 if schedule in ("interleaved-1f1b",
                                                               "dualpipev") else 1)
    else:
        batch = local * dp if batch == -1 else batch
        microbatches, schedule, v = batch // (dp * local), "none", 1
    mode = ac.get("mode", "selective")
    option = str(ac.get("selective_ac_option", "2"))
    if mode == "full":
        recompute: bool | str = True
    elif mode == "selective" and option == "op":
        recompute = "op"
    elif mode == "selective":
        notes.append(f"selective AC of every {option}th layer: read as full recompute")
        recompute = True
    else:
        recompute = False
    # FSDP units: torchtitan wraps each transformer block (`unit_per_layer`)
    if cp > 1:
        rotate = par.get("context_parallel_rotate_method", "allgather")
        notes.append(f"context_parallel_rotate_method {rotate!r}: read as "
                     + ("ring attention" if rotate == "alltoall" else "all-gather attention"))
    return ({"pp": pp, "dp": dp, "tp": tp, "sp": tp > 1, "ep": ep, "etp": etp, "cp": cp,
             "cp_attention": "ring" if cp > 1 and par.get(
                 "context_parallel_rotate_method") == "alltoall" else "all_gather",
             "zero": zero, "schedule": schedule, "virtual_stages": v, "microbatches": microbatches,
             "recompute": recompute, "comm_stream": False, "batch_size": batch,
             "unit_per_layer": zero > 0}, notes)


def from_megatron(text: str, gpus: int) -> tuple[Shorthand, list[str]]:
    """Megatron-LM's `pretrain_gpt.py` arguments (a string, or a file holding them); options
    that do not change the parallel layout are left alone."""
    if not text.lstrip().startswith("-") and Path(text).is_file():
        text = Path(text).read_text()
    p = argparse.ArgumentParser(add_help=False)
    for flag, kind in (("--tensor-model-parallel-size", int), ("--pipeline-model-parallel-size",
                       int), ("--context-parallel-size", int),
                       ("--expert-model-parallel-size", int),
                       ("--expert-tensor-parallel-size", int), ("--micro-batch-size", int),
                       ("--global-batch-size", int), ("--num-layers", int),
                       ("--num-layers-per-virtual-pipeline-stage", int),
                       ("--pipeline-model-parallel-layout", str),
                       ("--recompute-granularity", str), ("--cp-comm-type", str),
                       ("--moe-expert-capacity-factor", float), ("--ddp-bucket-size", int)):
        p.add_argument(flag, type=kind)
    for flag in ("--sequence-parallel", "--use-distributed-optimizer", "--use-torch-fsdp2",
                 "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap"):
        p.add_argument(flag, action="store_true")
    try:
        a, _ = p.parse_known_args(shlex.split(text))
    except (SystemExit, ValueError) as e:
        raise PiperError(f"--from megatron: cannot read the arguments ({e})") from None
    tp, pp = a.tensor_model_parallel_size or 1, a.pipeline_model_parallel_size or 1
    cp = a.context_parallel_size or 1
    dp, rest = divmod(gpus, tp * pp * cp)
    if rest or dp < 1:
        raise PiperError(f"--from megatron: tp {tp} x pp {pp} x cp {cp} does not divide "
                         f"--gpus {gpus}")
    if cp > 1 and (a.cp_comm_type or "p2p") not in ("p2p", "all_gather"):
        raise PiperError(f"--from megatron: --cp-comm-type {a.cp_comm_type}: piper-plan runs "
                         "p2p (ring) and all_gather")
    if a.micro_batch_size is None or a.global_batch_size is None:
        raise PiperError("--from megatron: give --micro-batch-size and --global-batch-size")
    microbatches, rest = divmod(a.global_batch_size, dp * a.micro_batch_size)
    if rest:
        raise PiperError(f"--from megatron: global batch {a.global_batch_size} is not a "
                         f"multiple of dp {dp} x micro batch {a.micro_batch_size}")
    schedule, v = ("none", 1) if pp == 1 else ("1f1b", 1)
    if a.pipeline_model_parallel_layout and pp > 1:
        stages = a.pipeline_model_parallel_layout.replace(",", "").count("|") + 1
        v = stages // pp
        schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    elif a.num_layers_per_virtual_pipeline_stage and pp > 1:
        if not a.num_layers:
            raise PiperError("--from megatron: --num-layers-per-virtual-pipeline-stage "
                             "needs --num-layers")
        schedule = "interleaved-1f1b"
        v = a.num_layers // (pp * a.num_layers_per_virtual_pipeline_stage)
    zero = 3 if a.use_torch_fsdp2 else 1 if a.use_distributed_optimizer else 0
    etp = a.expert_tensor_parallel_size or (tp if a.expert_model_parallel_size else 1)
    recompute = {"full": True, "selective": "attention"}.get(a.recompute_granularity or "",
                                                              False)
    return ({"pp": pp, "dp": dp, "tp": tp, "sp": a.sequence_parallel,
             "ep": a.expert_model_parallel_size or 1,
             # Megatron's default expert tensor parallelism is the tensor-parallel degree
             "etp": etp,
             # its expert mesh: with ETP 1 the EP groups span the tensor-parallel ranks
             "ep_over_tp": etp == 1 and tp > 1 and (a.expert_model_parallel_size or 1) > 1,
             "capacity_factor": a.moe_expert_capacity_factor, "cp": cp,
             "cp_attention": "all_gather" if a.cp_comm_type == "all_gather" else "ring",
             "zero": zero, "schedule": schedule,
             "virtual_stages": v, "microbatches": microbatches, "recompute": recompute,
             "comm_stream": a.overlap_grad_reduce and dp > 1 and zero < 3,
             # buckets count gradient elements (fp32 MiB here); only with the overlap
             "bucket_mb": (round(4 * a.ddp_bucket_size / 2**20, 3)
                           if a.ddp_bucket_size and a.overlap_grad_reduce and dp > 1
                           and zero < 3 else None),
             "batch_size": a.global_batch_size, "unit_per_layer": zero == 3,
             # priced as Megatron runs them (`Evaluator`): what its overlaps hide
             "tp_overlap": a.tp_comm_overlap and a.sequence_parallel and tp > 1,
             "param_gather_overlap": (a.overlap_param_gather and a.overlap_grad_reduce
                                      and zero == 1 and dp > 1)}, [])


READERS = {"torchtitan": from_torchtitan, "megatron": from_megatron}
