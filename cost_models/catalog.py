"""The built-in cluster catalog: published figures per GPU, each with its source."""

from __future__ import annotations

import dataclasses

from cost_models.spec import ClusterSpec, GiB

# Where catalog figures come from. Peak rates, memory sizes and bandwidths, and link rates are
# vendor datasheet numbers; kernel rates, NCCL curves and contention are published
# measurements or published models' figures (../shared/published/kernels_and_collectives.md
# quotes them); the few coefficients nothing publishes are fitted per GPU generation on the
# published training runs (`FITTED`, `benchmarks/calibrate_gpus.py`), never per row.
_NVIDIA = "NVIDIA datasheet"
ELEMENTWISE_SHARE = 0.9
"""Share of the HBM bandwidth a large memory-bound kernel (norm, activation, add) streams
at: Calculon's HBM efficiency at >= 100 MB (calculon-ai/calculon `systems/a100_80g.json`);
smaller kernels lose their fixed cost besides (`ClusterSpec.kernel_overhead_s`)."""
_ASSUMED = ("assumed, not measured: elementwise_bandwidth 0.9 of the HBM bandwidth "
            "(Calculon's efficiency at >= 100 MB); NVLink p2p latency assumed")
_MAMF = ("compute_efficiency: the maximum achievable bf16 matmul FLOP/s measured with "
         "mamf-finder.py (stas00/ml-engineering, compute/accelerator/README.md, 'Maximum "
         "Achievable Matmul FLOPS comparison table')")
A100_MAMF = 271.2e12 / 312e12
"""A100 SXM: 271.2 of 312 TFLOP/s (86.9%), torch 2.6.0+cu126."""
H100_MAMF = 794.5e12 / 989e12
"""H100 SXM: 794.5 of 989 TFLOP/s (80.3%), torch 2.7.0+cu126."""
A100_FLASH = 0.5
"""FlashAttention-2 (Dao 2023, arXiv 2307.08691) reaches 50-73% of the A100's peak; its
backward, 2.5 of the 3.5 forward-equivalents a training step runs, sits at the low end."""
_FA2_H100 = ((512, 309, 191, 214), (1024, 350, 260, 260), (2048, 362, 298, 291),
             (4096, 368, 319, 310), (8192, 370, 333, 318), (16384, 370, 335, 322))
H100_FLASH_CURVE = tuple((keys, *(tf / 989 for tf in rates)) for keys, *rates in _FA2_H100)
"""FlashAttention-2, the kernel PyTorch's SDPA flash backend runs (and torchtitan and
llm-foundry with it), on an H100 SXM5 at head dim 128, as the FlashAttention-3 paper
measured it (Shah et al. 2024, arXiv 2407.08608, figures 5 and 6; batch x length = 16K
tokens): forward 309 to 370 TFLOP/s from 512 to 16K keys, causal forward 191 to 335,
backward 214 to 322 (FlashAttention-3 itself reaches 75% of the peak forward, in FP16)."""
_FLASH = ("attention_efficiency: FlashAttention-2 as measured by its papers (on H100 by key "
          "length and mask, the FlashAttention-3 paper's figures 5-6)")

MB = 2**20
A100_NVLINK_BUSBW = ((32 * 1024, 1.75 * 32 * 1024 / 43.8e-6), (1 * MB, 18.0e9),
                     (4 * MB, 1.75 * 4 * MB / 101e-6), (16 * MB, 106e9), (256 * MB, 194e9),
                     (1024 * MB, 229e9), (16384 * MB, 234.9e9))
"""nccl-tests all-reduce busbw, 8 A100 on NVLink3 (ml-engineering): 43.8 us at 32 KB and a
92-101 us floor to ~4 MB, 18 GB/s at 1 MB, 106 at 16 MB, 194 at 256 MB, 229 at 1 GB, 234.9
at 16 GB."""
A100_RING_BUSBW = 235e9
"""NCCL's tuning model caps A100 NVLink bus bandwidth near 235 GB/s (`src/graph/tuning.cc`)."""
H100_NVLINK_BUSBW = ((1 * MB, 39.9e9), (16 * MB, 219.9e9), (256 * MB, 436.2e9),
                     (1024 * MB, 463.6e9), (16384 * MB, 482.3e9))
"""nccl-tests-style all-reduce busbw, 8 H100/H200 on NVLink4 with NVLS (ml-engineering,
`network/README.md`, NCCL 2.27): 39.9 GB/s at 1 MiB ... 482.3 at 16 GiB."""
H100_RING_BUSBW = 362e9
"""The same machine with NVLS off, 16 GiB: all-reduce 367.2, all-gather 361.4,
reduce-scatter 362.9 GB/s (ml-engineering): the ring algorithms' ceiling."""
HDR_PER_GPU = 0.9 * 25e9
"""200 Gb/s HDR InfiniBand per A100 at Calculon's 0.9 network efficiency."""
NDR_PER_GPU = 47e9
"""400 Gb/s NDR per H100: 46-48 GB/s measured per NIC (nccl-tests issues 290/196)."""
NVLINK_CONTENTION, IB_CONTENTION = 0.15, 0.02
"""Compute lost while NVLink collectives run beside it (15%) and while InfiniBand ones do
(2%): Calculon's `processor_usage`; Lee et al. 2025 (arXiv 2507.03114) measured 18.9% on
average on A100 and H100."""
_LINKS = ("intra_node_busbw: nccl-tests curves (ml-engineering); ring ceiling: NCCL tuning "
          "model / NVLS-off runs; inter_node_bandwidth: achieved per-NIC rates; contention "
          "15% NVLink / 2% IB (Calculon processor_usage)")

KERNEL_OVERHEAD_S = 3e-6
"""Launch cost of an eager kernel: a small all-reduce on H800 took 3.5 us, 0.5 us when
replayed from a CUDA graph (NVIDIA/nccl issue 1984), so about 3 us is the launch."""
HOST_DISPATCH_S = 10e-6
"""CPU time eager PyTorch spends issuing one op: Python, pybind11, autograd, the ATen
dispatcher, the backend and cudaLaunchKernel at about 1-5 us each, "~5-25 us of CPU-side
work per op" (a secondary source, jiahuanglin.xyz "From PyTorch op to kernel launch";
../shared/published/kernels_and_collectives.md quotes the same range): the middle of it."""
FITTED: dict[str, dict[str, float]] = {
    "a100": {"sustained_clock": 0.797},
    "h100": {"sustained_clock": 0.777},
}
"""The coefficient no source publishes, fitted per GPU generation by least squares on the
exact published runs of `benchmarks/published_runs.py` (`benchmarks/calibrate_gpus.py`
refits it and reports the leave-one-source-out error); every catalog GPU of a generation
shares it."""
FITTED_ON = ("sustained_clock fitted per GPU generation on the published runs of "
             "benchmarks/published_runs.py (calibrate_gpus.py); kernel_overhead_s 3 us "
             "(NVIDIA/nccl issue 1984: eager launch vs CUDA graph); host_dispatch_s 10 us "
             "(eager PyTorch's 5-25 us per op, secondary)")


def _generation(gen: str, **published: object) -> dict[str, object]:
    """The published figures of a GPU generation with its fitted coefficient."""
    return {**published, "kernel_overhead_s": KERNEL_OVERHEAD_S,
            "host_dispatch_s": HOST_DISPATCH_S, **FITTED[gen]}


_A100_GEN = _generation(
    "a100", sms=108, compute_efficiency=A100_MAMF, attention_efficiency=A100_FLASH,
    intra_node_bandwidth=300e9, intra_node_latency=5e-6, inter_node_bandwidth=HDR_PER_GPU,
    inter_node_latency=1e-5, intra_node_busbw=A100_NVLINK_BUSBW,
    intra_node_ring_busbw=A100_RING_BUSBW, comm_compute_contention=NVLINK_CONTENTION,
    inter_node_contention=IB_CONTENTION, flops=19.5e12, bf16_flops=312e12)
_H100_GEN = _generation(
    "h100", sms=132, compute_efficiency=H100_MAMF, attention_curve=H100_FLASH_CURVE,
    intra_node_bandwidth=450e9, intra_node_latency=5e-6, inter_node_bandwidth=NDR_PER_GPU,
    inter_node_latency=1e-5, intra_node_busbw=H100_NVLINK_BUSBW,
    intra_node_ring_busbw=H100_RING_BUSBW, comm_compute_contention=NVLINK_CONTENTION,
    inter_node_contention=IB_CONTENTION, flops=67e12, bf16_flops=989e12)

_H100 = ClusterSpec(
        name="h100-80gb", device="NVIDIA H100-SXM5-80GB", gpus_per_node=8,
        memory_bytes=80 * GiB, memory_bandwidth=3.35e12,
        elementwise_bandwidth=ELEMENTWISE_SHARE * 3.35e12, **_H100_GEN,
        source=f"{_NVIDIA} H100 SXM (FP32 67 TF; TF32 dense 495 TF; BF16 dense 989 TF; "
               "HBM3 3.35 TB/s; NVLink4 900 GB/s bidirectional; 132 SMs); DGX H100 "
               f"datasheet: one 400 Gb/s NDR HCA per GPU; {_MAMF}: H100 SXM 794.5 TF; "
               f"{_FLASH} (31-37% of the peak on H100, FlashAttention-3 paper); {_LINKS}; {FITTED_ON}; "
               + _ASSUMED)


def _a100_source(memory: str) -> str:
    return (f"{_NVIDIA} A100 SXM (FP32 19.5 TF; TF32 dense 156 TF; BF16 dense 312 TF; "
            f"{memory}; NVLink3 600 GB/s bidirectional; 108 SMs); DGX A100 datasheet: one "
            f"200 Gb/s HDR HCA per GPU; {_MAMF}: A100 SXM 271.2 TF; {_FLASH} (50-73% on "
            f"A100, the backward at the low end); {_LINKS}; {FITTED_ON}; " + _ASSUMED)


_A100_40 = ClusterSpec(
        name="a100-40gb", device="NVIDIA A100-SXM4-40GB", gpus_per_node=8,
        memory_bytes=40 * GiB, memory_bandwidth=1555e9,
        elementwise_bandwidth=ELEMENTWISE_SHARE * 1555e9, **_A100_GEN,
        source=_a100_source("HBM2 1555 GB/s"))

CATALOG: dict[str, ClusterSpec] = {
    s.name: s for s in (
        _A100_40,
        # the 80 GB part: the same chip with HBM2e, faster and twice the size
        dataclasses.replace(
            _A100_40, name="a100-80gb", device="NVIDIA A100-SXM4-80GB",
            memory_bytes=80 * GiB, memory_bandwidth=2039e9,
            elementwise_bandwidth=ELEMENTWISE_SHARE * 2039e9,
            source=_a100_source("HBM2e 2039 GB/s")),
        _H100,
        # Meta's Grand Teton H100s that torchtitan's published benchmarks ran on: the H100
        # SXM's figures (none are published for this part) with its memory
        dataclasses.replace(
            _H100, name="h100-96gb-500w", device="NVIDIA H100 96GB HBM2e (500 W cap)",
            memory_bytes=96 * GiB,
            source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton, 8 H100 "
                   "per host on NVLink, 96 GB HBM2e, 500 W power limit, 400 Gb/s RDMA per GPU; "
                   "MFU there is computed against the SXM part's 989 TF); peak rates, NVLink "
                   f"and memory bandwidth as the H100 SXM ({_NVIDIA}), and its matmul and "
                   f"attention efficiency ({_MAMF}; {_FLASH}): none is published for this "
                   f"part; its lower clocks are in neither figure; {_LINKS}; {FITTED_ON}; "
                   + _ASSUMED),
        ClusterSpec(
            name="h200", device="NVIDIA H200-SXM-141GB", gpus_per_node=8,
            # 141 GB datasheet; nvidia-smi shows ~140 GiB, so round down to that
            memory_bytes=140 * GiB, memory_bandwidth=4.8e12,
            elementwise_bandwidth=ELEMENTWISE_SHARE * 4.8e12, **_H100_GEN,
            source=f"{_NVIDIA} H200 SXM (FP32 67 TF; TF32 dense 495 TF; BF16 dense 989 TF; "
                   "HBM3e 4.8 TB/s; NVLink4 900 GB/s bidirectional); DGX H200 datasheet: "
                   f"one 400 Gb/s NDR HCA per GPU; {_MAMF}: the H100 SXM's 794.5 TF (the "
                   f"same die and clocks; the table's GH200 is a 900 W part); {_FLASH} (the "
                   f"H100's 35%); {_LINKS}; {FITTED_ON}; " + _ASSUMED),
        ClusterSpec(
            # Ranks are processes sharing a few cores and talking through gloo; every rank is
            # on one "node" so the planner never prices a network it does not have.
            name="cpu", device="CPU (gloo)", gpus_per_node=1024,
            memory_bytes=24 * GiB, flops=50e9, compute_efficiency=0.3,
            intra_node_bandwidth=2e9, intra_node_latency=5e-5,
            inter_node_bandwidth=1.25e9, inter_node_latency=1e-4, memory_bandwidth=10e9,
            source="assumed, not measured: rough figures for a small x86 VM (~50 GFLOP/s fp32 "
                   "AVX2 per process, gloo over loopback ~2 GB/s, 10 GbE between machines); "
                   "run `piper-plan profile` to measure this machine instead"),
    )
}
