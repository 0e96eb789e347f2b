"""Does the simulator reproduce published GPU training runs? (issue 18)

    python benchmarks/published_runs.py [--source mpt ...] [--json out.json]

Each row is a run someone published with its exact configuration (../shared/published/
gpu_runs.md; MosaicML's table vendored as benchmarks/data/mpt_runs.csv): model dims, GPU
type and count, tp/pp/dp, schedule and virtual stages, microbatch and global batch,
recompute, bf16 mixed precision. The script builds a model of that shape (`examples/gpt.py`
for GPT/MPT shapes, `examples/llama.py` for Llama's GQA/SwiGLU), the strategy through the
same shorthand `piper-plan simulate` takes, simulates it on the catalog cluster, and
compares the predicted step time with the published one, converted to seconds per step in
the source's own convention (its FLOP formula, its tokens/s). Reported: per row predicted /
published, MAPE per source and overall, Kendall's tau of tokens/s per GPU inside each group
of >= 3 rows sharing a model and cluster, the error against pipeline depth, and whether the
predicted peak memory fits the device.

Rows whose run used something piper-plan cannot express yet (sequence parallelism,
torch.compile, FP8) are simulated with the nearest expressible
strategy and marked `~` with what differs; they are reported apart from the exact rows.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scipy import stats

from cost_models import ClusterSpec, load_cluster
from cost_models.accuracy import ALL, MOE
from cost_models.accuracy import PATH as ACCURACY_PATH
from piper.hf import is_hf_model
from piper.loading import load_model
from piper.model_file import load_model_file
from piper.pyfile import import_user_file
from planner.search.evaluate import Evaluator
from planner.search.strategy import shorthand_program

GPT = str(ROOT / "examples" / "gpt.py")
HF_CONFIGS = ROOT / "benchmarks" / "data" / "hf"
"""Published Hugging Face config.json files of models the MoE rows train."""
LLAMA = str(ROOT / "examples" / "llama.py")
MPT_CSV = ROOT / "benchmarks" / "data" / "mpt_runs.csv"
GiB = 2**30
SEQ_HF = 4096
"""Sequence length of the rows that train a Hugging Face config (every MoE row's)."""


@dataclass(frozen=True)
class Run:
    source: str
    label: str
    model: str
    """examples file: GPT or LLAMA."""
    args: tuple[tuple[str, object], ...]
    """--model-arg pairs (size and dims)."""
    cluster: str
    gpus: int
    tp: int
    pp: int
    dp: int
    mbs: int
    gbs: int
    published_s: float
    """Seconds per step, from the source's figures in its own convention."""
    zero: int = 0
    schedule: str = "1f1b"
    v: int = 1
    recompute: bool | str = False
    """False, True (full) or a selective policy (`piper.Recompute`: attention, op)."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1 and a token-wise model: the Llama example)."""
    unit_mb: float | None = None
    """ZeRO-3 units (FSDP's wrapping): MiB of fp32 parameters each; None: a stage whole."""
    approx: str = ""
    """What the run used that the simulated strategy does not (empty: exact)."""
    assumed: str = ""
    """What the source does not state, and the value taken."""
    oom: bool = False
    """The source reports the configuration out of memory."""
    tp_overlap: bool = False
    """Tensor-parallel collectives overlapped with the GEMMs (Megatron's --tp-comm-overlap,
    torchtitan's async TP), priced by `Evaluator.tp_overlap`."""
    cp: int = 1
    """Context-parallel degree (each of cp ranks holds 1/cp of every sequence)."""
    cp_attention: str = "all_gather"
    """How its attention exchanges keys and values (torchtitan's default at the time and
    Llama 3's: all-gather)."""
    ep: int = 1
    """Expert-parallel degree: each group of ep data-parallel replicas splits the experts."""
    ep_over_tp: bool = False
    """The EP groups span the tensor-parallel ranks too (Megatron's expert mesh)."""
    ep_overlap: bool = False
    """Expert all-to-alls hidden behind another microbatch's math (Megatron's
    --overlap-moe-expert-parallel-comm), priced by `Evaluator.ep_overlap`."""
    moe: bool = False
    """A mixture-of-experts model: its error is reported apart (`accuracy.json`'s
    "<cluster> moe" figures, which `search` prints for models with experts)."""
    dp_overlap: bool = True
    """Gradient reduction overlapped with the backward, as the run did (Megatron's
    --overlap-grad-reduce, DDP's buckets, FSDP's units); False: after it, on the compute
    stream (Megatron-LM as MegaScale's baseline ran it: "DP overlap" is one of MegaScale's
    own additions)."""

    @property
    def microbatches(self) -> int:
        return self.gbs // (self.dp * self.mbs)

    @property
    def group(self) -> tuple:
        """Rows comparable by rank: one model on one cluster, in one source."""
        return (self.source, self.model, self.args, self.cluster)


def _gpt(dim: int, layers: int, heads: int, vocab: int, seq: int, tie: bool = False
         ) -> tuple[tuple[str, object], ...]:
    return (("size", "1b"), ("dim", dim), ("layers", layers), ("heads", heads),
            ("vocab", vocab), ("seq", seq), ("tie", tie))


def megatron_flops(batch: int, seq: int, layers: int, h: int, vocab: int) -> float:
    """Megatron's model FLOPs per step (GPT, MLP 4h, no recompute, no causal halving)."""
    return 72 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (12 * layers * h))


def megatron_h100() -> list[Run]:
    """Megatron-LM README, Megatron-Core r0.8.0 weak scaling on H100 (section 1c)."""
    rows = [  # heads, hidden, layers, tp, pp, dp, gbs, TFLOP/s per GPU
        ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
        ("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9),
        ("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1),
        ("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6),
        ("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7),
        ("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5),
        ("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8),
        ("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
        ("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9),
    ]
    out = []
    for name, heads, h, layers, tp, pp, dp, gbs, tflops in rows:
        gpus = tp * pp * dp
        step = megatron_flops(gbs, 4096, layers, h, 131072) / (gpus * tflops * 1e12)
        out.append(Run(
            "megatron-h100", f"GPT {name} tp{tp} pp{pp} dp{dp}", GPT,
            _gpt(h, layers, heads, 131072, 4096), "h100-80gb", gpus, tp, pp, dp, 1, gbs,
            step, zero=1, schedule="1f1b", sp=True, tp_overlap=True,
            assumed="mbs 1, no recompute, distributed optimizer, 1F1B (vp not stated)"))
    return out


def korthikanti() -> list[Run]:
    """Korthikanti et al. 2205.05198, Tables 3 and 5: A100, no DP (section 2)."""
    rows = [  # name, heads, hidden, layers, tp, pp, gbs, mbs, full recompute s, present s
        ("22B", 64, 6144, 48, 8, 1, 4, 4, 1.42, 1.10),
        ("175B", 96, 12288, 96, 8, 8, 64, 1, 18.13, 13.75),
        ("530B", 128, 20480, 105, 8, 35, 280, 1, 49.05, 37.83),
        ("1T", 160, 25600, 128, 8, 64, 512, 1, 94.42, 71.49),
    ]
    out = []
    for name, heads, h, layers, tp, pp, gbs, mbs, full, present in rows:
        v = 3 if name in ("175B", "530B") else 1
        sched = "interleaved-1f1b" if v > 1 else "1f1b"
        common = {"model": GPT, "args": _gpt(h, layers, heads, 51200, 2048),
                  "cluster": "a100-80gb", "gpus": tp * pp, "tp": tp, "pp": pp, "dp": 1,
                  "mbs": mbs, "gbs": gbs, "schedule": sched, "v": v}
        out.append(Run("korthikanti", f"GPT {name} tp{tp} pp{pp} full recompute",
                       published_s=full, recompute=True, **common))
        out.append(Run("korthikanti", f"GPT {name} tp{tp} pp{pp} SP+selective",
                       published_s=present, sp=True, recompute="attention", **common))
    return out


def megascale() -> list[Run]:
    """MegaScale Table 2, the Megatron-LM baseline rows: 175B, tp8 pp8, vp 6 (section 5)."""
    rows = [(768, 256, 40.0), (768, 512, 21.2), (768, 768, 15.2), (768, 1024, 11.9),
            (6144, 3072, 29.02), (6144, 6144, 14.78), (6144, 8192, 12.24),
            (6144, 12288, 8.57)]
    return [Run("megascale", f"GPT 175B Megatron-LM {gpus} GPUs gbs{gbs}", GPT,
                _gpt(12288, 96, 128, 64000, 2048), "a100-80gb", gpus, 8, 8, gpus // 64, 1,
                gbs, step, zero=1, schedule="interleaved-1f1b", v=6, sp=True, dp_overlap=False,
                recompute="attention",
                assumed="mbs 1, A100-80GB (the paper says Ampere), ZeRO-2-style DP as "
                        "distributed optimizer (zero 1)")
            for gbs, gpus, step in rows]


_LLAMA3 = {"8b": "llama3-8b", "70b": "llama3-70b", "405b": "405b"}


def _llama(size: str, **dims: int) -> tuple[tuple[str, object], ...]:
    return (("size", size), *sorted(dims.items()))


def torchtitan() -> list[Run]:
    """torchtitan benchmarks (section 3): bf16 rows only (Float8 is not modelled)."""
    out = []

    def row(label: str, size: tuple, cluster: str, gpus: int, fsdp: int, tp: int, pp: int,
            local_bs: int, seq: int, tps: float, recompute: bool | str, approx: str = "",
            assumed: str = "", schedule: str = "1f1b", v: int = 1, cp: int = 1,
            tp_overlap: bool = False) -> None:
        gbs = local_bs * fsdp
        step = gbs * seq / (gpus * tps)
        size = (*size, ("repeat_kv", True))  # its model copies key/value heads (repeat_kv)
        c = llama_config(size)
        layer = 2 * c.dim ** 2 + 2 * c.dim * (c.dim // c.heads * c.kv_heads) + 3 * c.dim * c.ffn
        out.append(Run("torchtitan", label, LLAMA, size, cluster, gpus, tp, pp, fsdp,
                       local_bs if pp == 1 else 1, gbs, step, zero=3, schedule=schedule,
                       v=v, recompute=recompute, approx=approx, assumed=assumed,
                       unit_mb=4 * layer / tp / 2**20, sp=tp > 1,  # its TP plan's norms: SP
                       cp=cp, tp_overlap=tp_overlap))

    seq8k = "seq 8192 (toml default)"
    # torchtitan's `op` policy also recomputes every other matmul; `op` here recomputes none
    SAC = "per-op SAC recomputes half the matmuls too (simulated as recompute op)"
    row("Llama 3.1 8B FSDP8 bs2 selective-op AC", _llama("llama3-8b"), "h100-96gb-500w", 8,
        8, 1, 1, 2, 8192, 5762, "op", approx=SAC,
        assumed=seq8k)
    row("Llama 3.1 8B FSDP128 bs2 selective-op AC", _llama("llama3-8b"), "h100-96gb-500w",
        128, 128, 1, 1, 2, 8192, 5605, "op", approx=SAC,
        assumed=seq8k)
    row("Llama 3 70B FSDP32 TP8 bs16 full AC (asyncTP file, vanilla TP)",
        _llama("llama3-70b"), "h100-96gb-500w", 256, 32, 8, 1, 16, 8192, 597.3, True,
        approx="torch.compile", assumed=seq8k + "; tokens/s per GPU")
    row("Llama 3 8B FSDP8 TP8 bs12 per-op SAC (asyncTP file, vanilla TP)",
        _llama("llama3-8b"), "h100-96gb-500w", 64, 8, 8, 1, 12, 8192, 4378, "op",
        approx="torch.compile; " + SAC,
        assumed=seq8k + "; tokens/s per GPU")
    row("Llama 3.1 405B FSDP16 TP8 bs2 full AC", _llama("405b"), "h100-96gb-500w", 128, 16,
        8, 1, 2, 8192, 109, True, approx="torch.compile", assumed=seq8k)
    a100 = "a100-80gb"
    row("Llama 3 8B FSDP64 bs1 selective-op AC (A100)", _llama("llama3-8b"), a100, 64, 64, 1,
        1, 1, 8192, 2973, "op", approx=SAC, assumed=seq8k)
    row("Llama 3 70B FSDP64 bs1 full AC (A100)", _llama("llama3-70b"), a100, 64, 64, 1, 1, 1,
        8192, 331, True, assumed=seq8k)
    l2_13 = _llama("7b", dim=5120, layers=40, heads=40, kv_heads=40, ffn=13824)
    row("Llama 2 13B FSDP64 bs2 no AC (A100)", l2_13, a100, 64, 64, 1, 1, 2, 4096, 2162, False)
    row("Llama 2 70B FSDP64 bs2 full AC (A100)", _llama("70b"), a100, 64, 64, 1, 1, 2, 4096,
        353, True)
    row("Llama 2 70B FSDP64 bs1 selective-op AC (A100)", _llama("70b"), a100, 64, 64, 1, 1, 1,
        4096, 355, "op", approx=SAC)
    # long context (table T2): FSDP x CP on one host, full AC; Float8 linears (a small
    # share of the step at these lengths) and torch.compile are not modelled
    f8 = "Float8 linears, torch.compile"
    for fsdp, cp, seq, tps in ((8, 1, 32768, 3890), (4, 2, 65536, 2540),
                               (2, 4, 131072, 1071), (1, 8, 262144, 548)):
        row(f"Llama 3.1 8B FSDP{fsdp} CP{cp} bs1 seq{seq // 1024}K full AC",
            _llama("llama3-8b", seq=seq), "h100-96gb-500w", 8, fsdp, 1, 1, 1, seq, tps, True,
            approx=f8, assumed="all-gather CP (the default rotate method then)", cp=cp)
    # table T6: Llama 3.1 405B on 512 GPUs, TP8 (async) PP8 1F1B, FSDP x CP
    for fsdp, cp, seq, tps in ((8, 1, 32768, 76), (4, 2, 65536, 47), (2, 4, 131072, 31),
                               (1, 8, 262144, 16)):
        row(f"Llama 3.1 405B FSDP{fsdp} TP8 PP8 CP{cp} bs8 seq{seq // 1024}K full AC",
            _llama("405b", seq=seq), "h100-96gb-500w", 512, fsdp, 8, 8, 8, seq, tps, True,
            approx=f8, cp=cp, tp_overlap=True,
            assumed="all-gather CP; 8 microbatches of 1 (the stage count, torchtitan's "
                    "default)")
    return out


def llama3_paper() -> list[Run]:
    """The Llama 3 paper, Table 4 rows 1-2: 405B, tp8 pp16, 8K sequences (section 4)."""
    out = []
    for gpus, dp, per_dp, tflops in ((8192, 64, 32, 430), (16384, 128, 16, 400)):
        gbs = dp * per_dp
        n = _LLAMA_405B_PARAMS
        flops = gbs * 8192 * (6 * n + 12 * 126 * 16384 * 8192)  # PaLM: 6N + 12·L·H·Q·T
        out.append(Run("llama3", f"Llama 3 405B tp8 pp16 dp{dp} ({gpus} GPUs)", LLAMA,
                       _llama("405b"), "h100-80gb", gpus, 8, 16, dp, 1, gbs,
                       flops / (gpus * tflops * 1e12), zero=2, schedule="interleaved-1f1b",
                       v=4, sp=True,
                       assumed="mbs 1, vp 4 (not stated), FSDP without reshard as zero 2"))
    # row 3: 131K tokens with 16-way all-gather CP; dp 8 (printed 4, which fits neither the
    # GPU count nor the tokens per batch); PaLM's FLOPs at 131K (the run's document mask
    # skips some of the attention they count)
    gbs, seq = 8 * 16, 131072
    flops = gbs * seq * (6 * _LLAMA_405B_PARAMS + 12 * 126 * 16384 * seq)
    out.append(Run("llama3", "Llama 3 405B tp8 cp16 pp16 dp8 seq131K (16384 GPUs)", LLAMA,
                   _llama("405b", seq=seq), "h100-80gb", 16384, 8, 16, 8, 1, gbs,
                   flops / (16384 * 380 * 1e12), zero=2, schedule="interleaved-1f1b", v=4,
                   sp=True, cp=16, approx="document mask (causal simulated)",
                   assumed="dp 8 (printed 4), mbs 1, vp 4, no recompute (not stated)"))
    return out


def llama_config(args: tuple[tuple[str, object], ...]) -> Any:
    """`examples/llama.py`'s config for --model-arg pairs (a size and dims over it)."""
    module = import_user_file(LLAMA, "model file")
    d = dict(args)
    return dataclasses.replace(module.CONFIGS[d.pop("size")], **d)


def llama_params(c: Any) -> int:
    """Parameters of a Llama (untied embedding and output, no biases, two norms a layer)."""
    kv = c.dim // c.heads * c.kv_heads
    layer = 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.ffn + 2 * c.dim
    return 2 * c.vocab * c.dim + c.layers * layer + c.dim


_LLAMA_405B_PARAMS = llama_params(llama_config((("size", "405b"),)))  # 405.9e9


def mpt() -> list[Run]:
    """MosaicML llm-foundry (section 7): every BF16 row of mpt_runs.csv."""
    clusters = {"a100_40gb": "a100-40gb", "a100_80gb": "a100-80gb", "h100_80gb": "h100-80gb"}
    out = []
    with MPT_CSV.open() as f:
        for r in csv.DictReader(f):
            if "fp8" in r["Precision"]:
                continue
            gpus, seq = int(r["# GPUs"]), int(r["SeqLen (T)"])
            gbs, mbs = int(r["GlobalBatchSize"]), int(r["MicroBatchSize"])
            if gbs % (gpus * mbs):  # a ragged last microbatch: not expressible
                continue
            step = gbs * seq / (gpus * float(r["Throughput (T/s/GPU)"]))
            zero = 3 if r["Sharding Strategy"] == "FULL_SHARD" else 2
            ckpt = r["Activation Checkpointing"] == "True"
            out.append(Run(
                "mpt", f"MPT {r['Model']} {r['GPU']} {gpus} GPUs seq{seq} mbs{mbs} x"
                       f"{gbs // (gpus * mbs)}{' ckpt' if ckpt else ''}", GPT,
                _gpt(int(r["d_model"]), int(r["n_layers"]), int(r["n_heads"]),
                     int(r["vocab"]), seq, tie=True),
                clusters[r["GPU"]], gpus, 1, 1, gpus, mbs, gbs, step, zero=zero,
                recompute=ckpt, assumed="ALiBi as learned positions",
                unit_mb=4 * 12 * int(r["d_model"]) ** 2 / 2**20))
    return out


def bridge_moe() -> list[Run]:
    """Megatron-Bridge's MoE runs on DGX-H100, Qwen3-MoE as published in transformers'
    config of each model, routing force-balanced ("token-dropless"):

    - the performance summary (section 6b): tokens/s per GPU -> seconds per step. The
      recipes of those containers (`scripts/performance/configs/qwen/`, Megatron-Bridge
      c3e43e6 and c4cc63b) say: no recompute, DeepEP's dispatcher, EP all-to-alls
      overlapped (`moe_a2a_overlap`);
    - a controlled A/B of EP overlap on Qwen3-30B-A3B (`skills/nemo-mbridge-perf-expert-
      parallel-overlap/SKILL.md`, Megatron-Bridge 067f987): 16 H100s, BF16, EP16, TP1 PP1,
      MBS1 GBS1024, sequence 4096, NCCL's all-to-all (the `alltoall` dispatcher), CUDA
      graphs and permute fusion off; steady-state step time, without and with overlap."""
    summary = [  # model, container, gpus, gbs, mbs, tp, pp, vp, ep, tokens/s per GPU
        ("qwen3_30b_a3b", "26.02", 16, 1024, 1, 1, 2, 12, 8, 5113),
        ("qwen3_30b_a3b", "25.11", 16, 512, 2, 1, 2, 24, 8, 5275),
        ("qwen3_235b_a22b", "26.02", 256, 8192, 1, 2, 8, 4, 32, 1633),
        ("qwen3_235b_a22b", "25.11", 256, 2048, 1, 2, 8, 4, 32, 1575),
    ]
    out = []
    seq = 4096
    for model, container, gpus, gbs, mbs, tp, pp, vp, ep, tps in summary:
        dp = gpus // (tp * pp)
        # Megatron's expert mesh: with expert tensor parallelism 1 (Megatron-Bridge's MoE
        # recipes) the EP groups span the tensor-parallel ranks
        over = tp > 1
        out.append(Run("bridge-moe", f"{model} {container} tp{tp} pp{pp} vp{vp} ep{ep} "
                       f"mbs{mbs} ({gpus} GPUs)", str(HF_CONFIGS / f"{model}.json"),
                       (), "h100-80gb", gpus, tp, pp, dp, mbs, gbs,
                       gbs * seq / (gpus * tps), schedule="interleaved-1f1b", v=vp,
                       ep=ep, ep_over_tp=over, moe=True, ep_overlap=True, zero=1,
                       approx="FP8 GEMMs simulated in bf16; DeepEP's dispatcher priced as "
                              "NCCL's all-to-all", sp=tp > 1,
                       assumed="expert tensor parallelism 1; sequence parallelism with tp "
                               "(Megatron requires it for MoE with tp); the distributed "
                               "optimizer (Megatron-Bridge's default)"))
    for overlap, step in ((False, 41.25), (True, 31.31)):
        out.append(Run("bridge-moe", f"qwen3_30b_a3b alltoall ep16 mbs1 "
                       f"{'EP overlap' if overlap else 'in line'} (16 GPUs)",
                       str(HF_CONFIGS / "qwen3_30b_a3b.json"), (), "h100-80gb", 16, 1, 1, 16,
                       1, 1024, step, ep=16, moe=True, ep_overlap=overlap, zero=1,
                       assumed="no recompute and the distributed optimizer (the recipe's "
                               "and Megatron-Bridge's defaults)"))
    return out


SOURCES = {"megatron-h100": megatron_h100, "korthikanti": korthikanti,
           "megascale": megascale, "torchtitan": torchtitan, "llama3": llama3_paper,
           "mpt": mpt, "bridge-moe": bridge_moe}


@dataclass
class Result:
    run: Run
    predicted_s: float
    peak_bytes: int
    device_bytes: int
    seconds: float
    params: int = 0
    """The model's parameters (as captured)."""

    @property
    def error(self) -> float:
        return self.predicted_s / self.run.published_s - 1

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.device_bytes


@dataclass
class Evaluators:
    """One capture per model shape, shared by every row of that shape."""

    cache: dict = field(default_factory=dict)

    def get(self, run: Run, adjust: Callable[[ClusterSpec], ClusterSpec] | None = None
            ) -> Evaluator:
        """The row's model on its cluster (`adjust`ed: a what-if of its figures)."""
        spec_key = (run.model, run.args)
        cluster = load_cluster(run.cluster)
        cluster = adjust(cluster) if adjust else cluster
        if spec_key not in self.cache:
            spec = (load_model(run.model, run.args, (("seq_len", SEQ_HF),))
                    if is_hf_model(run.model) else load_model_file(run.model, run.args))
            self.cache[spec_key] = Evaluator(spec, run.gpus, run.gbs, cluster,
                                             precision="bf16-mixed")
        ev = self.cache[spec_key].on(cluster, run.gpus, run.gbs)
        ev.tp_overlap, ev.ep_overlap = run.tp_overlap, run.ep_overlap
        return ev


def simulate(run: Run, evaluators: Evaluators,
             adjust: Callable[[ClusterSpec], ClusterSpec] | None = None) -> Result:
    t = time.perf_counter()
    ev = evaluators.get(run, adjust)
    args = argparse.Namespace(
        pp=run.pp, dp=run.dp, tp=run.tp, ep=run.ep, ep_over_tp=run.ep_over_tp,
        zero=run.zero, schedule=run.schedule,
        virtual_stages=run.v if run.v > 1 else None, microbatches=run.microbatches,
        recompute=run.recompute, bucket_mb=run.unit_mb,
        comm_stream=run.dp * run.cp > 1 and run.zero < 3 and run.dp_overlap,
        sp=run.sp and run.tp > 1, cp=run.cp, cp_attention=run.cp_attention)
    program = shorthand_program(args, run.gpus, ev.graph.names, ev.region_costs(),
                                ev.graph.expert_regions)
    result = ev.evaluate(program)
    p = result.prediction
    return Result(run, p.step_time_s, p.max_memory_bytes, ev.cluster.memory_bytes,
                  time.perf_counter() - t, sum(ev.costs.params))


SIZES = (("< 1B", 1e9), ("1-10B", 1e10), ("10-100B", 1e11), (">= 100B", float("inf")))
"""Model-size buckets the error is reported in (parameters)."""


def mape(results: list[Result]) -> float:
    return 100 * statistics.fmean(abs(r.error) for r in results) if results else float("nan")


def report(results: list[Result]) -> dict:
    print(f"{'source':<14} {'run':<64} {'GPUs':>6} {'pp':>3} {'published':>10} "
          f"{'predicted':>10} {'error':>7}  memory")
    for r in results:
        mark = "~" if r.run.approx else " "
        mem = f"{r.peak_bytes / GiB:6.1f}/{r.device_bytes / GiB:.0f} GiB" + (
            "" if r.fits else " DOES NOT FIT")
        print(f"{r.run.source:<14}{mark}{r.run.label[:64]:<64} {r.run.gpus:>6} {r.run.pp:>3} "
              f"{r.run.published_s:>9.3f}s {r.predicted_s:>9.3f}s {100 * r.error:>+6.1f}%  "
              f"{mem}")
    summary: dict = {"sources": {}, "groups": [], "by_pp": {}}
    print("\nMAPE (exact rows | rows with an approximation | all):")
    by_source: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_source[r.run.source].append(r)
    for source, rs in [*by_source.items(), ("overall", results)]:
        exact = [r for r in rs if not r.run.approx]
        approx = [r for r in rs if r.run.approx]
        bias = 100 * statistics.fmean(r.error for r in rs)
        print(f"  {source:<14} {mape(exact):6.1f}% ({len(exact):3d} rows) | "
              f"{mape(approx):6.1f}% ({len(approx):3d}) | {mape(rs):6.1f}% ({len(rs):3d}); "
              f"mean signed error {bias:+.1f}%")
        summary["sources"][source] = {"exact": mape(exact), "exact_rows": len(exact),
                                      "approx": mape(approx), "approx_rows": len(approx),
                                      "all": mape(rs), "rows": len(rs), "bias": bias}
    print("\nKendall tau of tokens/s per GPU, groups of >= 3 rows (one model, one cluster):")
    groups: dict[tuple, list[Result]] = defaultdict(list)
    for r in results:
        groups[r.run.group].append(r)
    for rs in groups.values():
        if len(rs) < 3:
            continue
        pub = [r.run.gbs / (r.run.gpus * r.run.published_s) for r in rs]
        pred = [r.run.gbs / (r.run.gpus * r.predicted_s) for r in rs]
        tau = stats.kendalltau(pub, pred).statistic
        name = f"{rs[0].run.source} {rs[0].run.label.split(' ')[0:3]} {rs[0].run.cluster}"
        print(f"  tau {tau:+.2f}  {len(rs):3d} rows  {name}")
        summary["groups"].append({"group": name, "rows": len(rs), "tau": tau})
    print("\nError against pipeline depth (all rows):")
    by_pp: dict[int, list[Result]] = defaultdict(list)
    for r in results:
        by_pp[r.run.pp].append(r)
    for pp in sorted(by_pp):
        rs = by_pp[pp]
        bias = 100 * statistics.fmean(r.error for r in rs)
        print(f"  pp={pp:<3} MAPE {mape(rs):5.1f}%  mean signed {bias:+6.1f}%  ({len(rs)} rows)")
        summary["by_pp"][pp] = {"mape": mape(rs), "bias": bias, "rows": len(rs)}
    print("\nError against model size (all rows):")
    by_size: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_size[next(name for name, top in SIZES if r.params < top)].append(r)
    for name, _ in SIZES:
        rs = by_size.get(name)
        if rs:
            bias = 100 * statistics.fmean(r.error for r in rs)
            print(f"  {name:<10} MAPE {mape(rs):5.1f}%  mean signed {bias:+6.1f}%  "
                  f"({len(rs)} rows)")
            summary.setdefault("by_size", {})[name] = {"mape": mape(rs), "bias": bias,
                                                       "rows": len(rs)}
    unfit = [r for r in results if not r.fits]
    print(f"\nMemory: {len(results) - len(unfit)} of {len(results)} published runs predicted "
          "to fit the device" + (": not " + "; ".join(r.run.label for r in unfit)
                                 if unfit else ""))
    return summary


def write_accuracy(path: Path, results: list[Result]) -> None:
    """Per catalog cluster (and over all rows): runs, MAPE and mean signed error; MoE
    models' rows apart, under "<cluster> moe"."""
    groups: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        kind = MOE if r.run.moe else ""
        groups[r.run.cluster + kind].append(r)
        groups[ALL + kind].append(r)
    clusters = {name: {"runs": len(rs), "mape_pct": round(mape(rs), 2),
                       "signed_pct": round(100 * statistics.fmean(r.error for r in rs), 2),
                       "sources": sorted({r.run.source for r in rs})}
                for name, rs in sorted(groups.items())}
    path.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d"),
                                "command": "python benchmarks/published_runs.py --accuracy",
                                "clusters": clusters}, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", action="append", choices=sorted(SOURCES),
                   help="only these sources (repeatable; default all)")
    p.add_argument("--json", type=Path, help="write every row and the summary here")
    p.add_argument("--accuracy", type=Path, nargs="?", const=ACCURACY_PATH,
                   help="write the error per catalog cluster, which `search` prints "
                        f"(default: {ACCURACY_PATH.relative_to(ROOT)})")
    args = p.parse_args()
    runs = [r for name in (args.source or SOURCES) for r in SOURCES[name]()]
    evaluators = Evaluators()
    results = []
    start = time.perf_counter()
    for run in runs:
        results.append(simulate(run, evaluators))
    summary = report(results)
    print(f"\n{len(results)} rows simulated in {time.perf_counter() - start:.0f} s")
    if args.accuracy:
        write_accuracy(args.accuracy, results)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": [
            {**dataclasses.asdict(r.run), "predicted_s": r.predicted_s,
             "peak_bytes": r.peak_bytes, "error": r.error} for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
