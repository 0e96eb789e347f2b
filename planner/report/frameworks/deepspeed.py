"""A strategy as a DeepSpeed config (`deepspeed.runtime.config.DeepSpeedConfig`'s JSON).

train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x the
data-parallel size, which DeepSpeed checks; zero_optimization.stage with its buckets
(reduce_bucket_size and allgather_bucket_size count elements) and overlap_comm; bf16;
gradient_clipping. A pipeline is
DeepSpeed's `PipelineModule(layers, num_stages=pp)` in the training script (the launch
note says so): its engine runs one schedule (1F1B-like), and only ZeRO stages 0-1 beside
it. DeepSpeed's engine has no tensor parallelism of its own.
"""

from __future__ import annotations

import json

from piper.errors import PiperError
from planner.report.frameworks.layout import Exported, Layout


def deepspeed_config(lay: Layout) -> Exported:
    notes: list[str] = []
    if lay.cp > 1:
        raise PiperError(f"cp {lay.cp}: DeepSpeed's engine has no context parallelism of "
                         "its own (its Ulysses splits attention heads, not the sequence): "
                         "export with --to megatron or --to torchtitan")
    if lay.tp > 1 or lay.ep > 1:
        raise PiperError(f"tp {lay.tp} ep {lay.ep}: DeepSpeed's engine has no tensor or "
                         "expert parallelism of its own (Megatron-DeepSpeed adds it): "
                         "export with --to megatron, or search without tensor parallelism")
    zero = lay.zero
    if lay.pp > 1:
        if zero > 1:
            notes.append(f"zero {zero} with a pipeline: DeepSpeed's pipeline engine runs "
                         "ZeRO 0-1 only; nearest: 1")
            zero = 1
        if lay.schedule != "1f1b":
            notes.append(f"schedule {lay.schedule}: DeepSpeed's pipeline engine runs its own "
                         "1F1B-like TrainSchedule; nearest: that")
        if len(lay.stage_layers) != lay.pp:
            raise PiperError(f"{len(lay.stage_layers)} stages on {lay.pp} pipeline ranks: "
                             "DeepSpeed's PipelineModule puts one stage on each")
        notes.append(f"pipeline: build the model as PipelineModule(layers, num_stages="
                     f"{lay.pp}) with the layer split {list(lay.stage_layers)} (its "
                     "partition_method='type:...' or your own split)")
    if lay.recompute:
        notes.append("recompute: DeepSpeed's activation checkpointing is the model's own "
                     "(deepspeed.checkpointing.checkpoint around each layer); "
                     + ("a selective policy is not expressible: full" if lay.recompute
                        is not True else "full"))
    if lay.comm_stream and zero == 0:
        notes.append("comm stream: DeepSpeed overlaps gradient reduction with the backward "
                     "(overlap_comm) at ZeRO 1-3 only; nearest: ZeRO-0's all-reduce after "
                     "the backward")
    if zero == 3 and not lay.bucket_mb:
        notes.append("zero 3 gathered by stage: DeepSpeed always prefetches in windows of "
                     "stage3_prefetch_bucket_size (5e7 elements unless set); nearest: that")
    overlap = zero == 3 or (lay.comm_stream and zero > 0)
    zero_cfg: dict = {"stage": zero, "overlap_comm": overlap,
                      "contiguous_gradients": True}
    if lay.bucket_mb:  # DeepSpeed counts elements: the fp32 MiB as a gradient count
        size = int(lay.bucket_mb * 2**20 // 4)
        zero_cfg.update(reduce_bucket_size=size, allgather_bucket_size=size)
        if zero == 3:
            zero_cfg["stage3_prefetch_bucket_size"] = size
    config = {
        "train_batch_size": lay.global_batch,
        "train_micro_batch_size_per_gpu": lay.microbatch_size,
        "gradient_accumulation_steps": lay.microbatches,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": lay.precision != "fp32"},
        "zero_optimization": zero_cfg,
    }
    nodes = max(1, lay.gpus // 8)
    notes.append(f"launch: deepspeed --num_nodes {nodes} --num_gpus {min(lay.gpus, 8)} "
                 "train.py --deepspeed --deepspeed_config THIS_FILE")
    return Exported(json.dumps(config, indent=2) + "\n", tuple(notes))
