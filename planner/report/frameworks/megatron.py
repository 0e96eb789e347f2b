"""A strategy as Megatron-LM's `pretrain_gpt.py` arguments (megatron/training/arguments.py).

Degrees: --tensor-model-parallel-size, --pipeline-model-parallel-size (our stage split,
interleaved or not, as --pipeline-model-parallel-layout), --sequence-parallel,
--context-parallel-size, --expert-model-parallel-size. Data parallelism is what is left of
the world. ZeRO-1 is the distributed optimizer (which also reduce-scatters the gradients:
its memory is ZeRO-1's, a full fp32 gradient buffer stays), ZeRO-3 is Megatron's
torch-FSDP2 path. --overlap-grad-reduce (and --overlap-param-gather with the distributed
optimizer) is what a comm stream does; --tp-comm-overlap goes with sequence parallelism.
Recompute: full is --recompute-granularity full (uniform, one layer per checkpoint),
selective is Megatron's own (its core attention).
"""

from __future__ import annotations

import shlex

from piper.errors import PiperError
from planner.report.frameworks.layout import Exported, Layout


def megatron_args(lay: Layout) -> Exported:
    notes: list[str] = []
    m = lay.model
    args: list[str] = []
    if m.family is None or not m.layers:
        notes.append("model: not a GPT or Llama shape Megatron's GPTModel builds: it needs "
                     "a port (model flags left out)")
    else:
        args += ["--num-layers", str(m.layers), "--hidden-size", str(m.dim),
                 "--num-attention-heads", str(m.heads), "--ffn-hidden-size", str(m.ffn),
                 "--seq-length", str(m.seq), "--max-position-embeddings", str(m.seq),
                 "--vocab-size", str(m.vocab)]
        if m.family in ("llama", "qwen3"):
            args += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
                     "rope", "--disable-bias-linear"]
            if m.kv_heads and m.kv_heads != m.heads:
                args += ["--group-query-attention", "--num-query-groups", str(m.kv_heads)]
            if m.family == "qwen3":
                args += ["--qk-layernorm"]
        if m.experts:  # dropless, as piper-plan runs them: grouped GEMMs, all-to-all
            args += ["--num-experts", str(m.experts), "--moe-router-topk", str(m.top_k),
                     "--moe-ffn-hidden-size", str(m.moe_ffn), "--moe-grouped-gemm",
                     "--moe-token-dispatcher-type", "alltoall"]
            if not m.router_renorm:  # softmax over every expert, top-k kept as it is
                args.append("--moe-router-pre-softmax")
        if not m.tied:
            args.append("--untie-embeddings-and-output-weights")
    args += ["--tensor-model-parallel-size", str(lay.tp),
             "--pipeline-model-parallel-size", str(lay.pp),
             "--context-parallel-size", str(lay.cp)]
    if lay.cp > 1:  # Megatron's ring is its p2p form
        args += ["--cp-comm-type", "p2p" if lay.cp_attention == "ring" else "all_gather"]
    if lay.ep > 1 or lay.etp > 1:
        args += ["--expert-model-parallel-size", str(lay.ep),
                 "--expert-tensor-parallel-size", str(lay.etp)]
        if lay.etp == 1 and lay.tp > 1 and not lay.ep_over_tp:
            notes.append("experts: with --expert-tensor-parallel-size 1 Megatron also spreads "
                         "the experts over the tensor-parallel ranks (its expert mesh, EP x "
                         "ETP x EDP = TP x DP); piper-plan holds them whole on each")
    if lay.capacity:  # its default drop policy keeps the highest-gated rows, as piper-plan
        args += ["--moe-expert-capacity-factor", f"{lay.capacity:g}",
                 "--moe-token-drop-policy", "probs"]
        if lay.microbatch_size > 1:
            notes.append(f"capacity: Megatron counts it over the {lay.microbatch_size} "
                         "sequences a rank routes at once, piper-plan over each sequence: "
                         "they drop the same rows at one sequence per microbatch")
    if lay.sp:
        args.append("--sequence-parallel")
    if lay.sp and lay.tp > 1:  # as a Megatron pick is priced (`search --target megatron`)
        args.append("--tp-comm-overlap")
        notes.append("--tp-comm-overlap: Transformer Engine's userbuffers run the "
                     "tensor-parallel collectives beside the GEMMs; where they cannot start "
                     "(no TE, no MPI or NCCL bootstrap), drop the flag: `piper-plan simulate "
                     "--from megatron` prices these arguments without it")
    args += _pipeline(lay, notes)
    args += _data_parallel(lay, notes)
    args += _recompute(lay, notes)
    args += ["--micro-batch-size", str(lay.microbatch_size),
             "--global-batch-size", str(lay.global_batch), "--clip-grad", "1.0"]
    if lay.precision != "fp32":
        args.append("--bf16")
    return Exported(shlex.join(args) + "\n", tuple(notes))


def _pipeline(lay: Layout, notes: list[str]) -> list[str]:
    """The stage split as Megatron's --pipeline-model-parallel-layout ("E" the embedding,
    "t" a layer, "L" the output layer and loss; stages in model order, the virtual stages
    of a rank every pp-th): exact for any split, interleaved too."""
    if lay.pp == 1:
        return []
    if lay.schedule == "dualpipev":
        notes.append("schedule dualpipev: Megatron-LM has no V schedule; nearest: "
                     "interleaved 1F1B over the same stages, placed round-robin")
    elif lay.schedule not in ("1f1b", "interleaved-1f1b"):
        nearest = "interleaved 1F1B" if len(lay.stage_regions) > lay.pp else "1F1B"
        notes.append(f"schedule {lay.schedule}: Megatron-LM runs 1F1B or interleaved 1F1B; "
                     f"nearest: {nearest} with the same stages")
    return ["--pipeline-model-parallel-layout", "|".join(map(_stage, lay.stage_regions))]


def _stage(regions: tuple[str, ...]) -> str:
    layers = sum(1 for r in regions if r.startswith("layer."))
    other = [r for r in regions if r not in ("embed", "head") and not r.startswith("layer.")]
    if other:
        raise PiperError(f"region {other[0]!r} has no place in Megatron's GPT layout (E, t, "
                         "L): export without --to, or name regions embed, layer.N, head")
    return (("E" if "embed" in regions else "") + (f"t*{layers}" if layers else "")
            + ("L" if "head" in regions else ""))


def _data_parallel(lay: Layout, notes: list[str]) -> list[str]:
    out: list[str] = []
    if lay.zero == 3:
        out.append("--use-torch-fsdp2")
        if lay.pp > 1:
            raise PiperError("zero 3 with pipeline parallelism: Megatron-LM's FSDP2 path "
                             "does not run with a pipeline")
        if not lay.units_are_blocks:
            units = f"{lay.bucket_mb:g} MiB" if lay.bucket_mb else "a whole stage"
            notes.append(f"zero 3 units of {units}: Megatron's FSDP2 path wraps each "
                         f"transformer layer ({lay.block_mib:.0f} MiB); nearest: that")
        return out
    if lay.zero:
        if lay.zero == 2:
            notes.append("zero 2: Megatron's distributed optimizer shards the optimizer "
                         "state and reduce-scatters gradients, but keeps a full fp32 "
                         "gradient buffer (ZeRO-1's memory)")
        out.append("--use-distributed-optimizer")
    if lay.comm_stream:
        out.append("--overlap-grad-reduce")
        if lay.zero in (1, 2):
            out.append("--overlap-param-gather")
    if lay.bucket_mb and lay.comm_stream:  # in elements: the fp32 MiB as gradient count
        out += ["--ddp-bucket-size", str(int(lay.bucket_mb * 2**20 // 4))]
    elif lay.bucket_mb:
        notes.append(f"buckets of {lay.bucket_mb:g} MiB: Megatron's DDP buckets only with "
                     "--overlap-grad-reduce; nearest: one bucket after the backward")
    elif lay.comm_stream and lay.dp > 1:
        notes.append("one collective per stage under the backward: Megatron buckets its "
                     "overlapped gradients (max(40M, 1M x dp) parameters unless "
                     "--ddp-bucket-size is given); nearest: that default")
    return out


def _recompute(lay: Layout, notes: list[str]) -> list[str]:
    if lay.recompute is True:
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]
    if not lay.recompute:
        return []
    if lay.recompute == "op":
        notes.append("recompute op: Megatron's fused kernels already keep what op keeps; "
                     "nearest: selective (core attention)")
    return ["--recompute-granularity", "selective"]
