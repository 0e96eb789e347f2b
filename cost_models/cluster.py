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

import dataclasses
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from piper.errors import PiperError

GiB = 2**30


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphaBeta:
    """A fitted alpha-beta pair: seconds per message step and bytes/s of the link."""

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not _number(self.latency) or not 0 <= self.latency < math.inf:
            raise PiperError(f"latency must be a finite number >= 0, got {self.latency!r}")
        if not _number(self.bandwidth) or not self.bandwidth > 0:
            raise PiperError(f"bandwidth must be a number > 0, got {self.bandwidth!r}")


COLLECTIVE_FIELDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
"""Optional per-kind alpha-beta figures fitted inside one node; they replace the generic
intra-node link for that kind (inter-node traffic keeps the inter-node figures)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """A homogeneous cluster: `gpus_per_node` devices per node, identical links per device."""

    name: str
    device: str
    gpus_per_node: int
    memory_bytes: int
    """Device memory usable for training, per device."""
    flops: float
    """Peak dense FLOP/s per device for PyTorch-default fp32 math (see module docstring)."""
    compute_efficiency: float
    """Fraction of the peak a large, well-shaped matmul reaches (on GPUs: the measured
    maximum achievable matmul FLOP/s over the datasheet peak). Smaller or thinner matmuls
    reach less (`matmul_half_flops`, `matmul_seconds`); ops without matmul math are priced
    by the bytes they move."""
    intra_node_bandwidth: float
    """Bytes/s per direction per device over the node's fabric (NVLink on GPUs)."""
    intra_node_latency: float
    """Seconds of fixed cost per message inside a node (alpha of the alpha-beta model)."""
    inter_node_bandwidth: float
    """Bytes/s per direction per device across nodes (its share of the NICs)."""
    inter_node_latency: float
    memory_bandwidth: float | None = None
    """Device memory bytes/s; prices the optimizer step. None: the step is not priced."""
    elementwise_bandwidth: float | None = None
    """Bytes/s ops without matmul math (norms, activations, residual adds, casts) stream
    their inputs and outputs at: on GPUs they are bound by memory bandwidth. None: they
    cost `op_overhead_s` alone (a profiled CPU spec folds their time into that)."""
    source: str = ""
    """Where the figures come from, so a reader can check them."""
    bf16_flops: float | None = None
    """Peak dense FLOP/s for 16-bit float matmuls (tensor cores); None: same as `flops`."""
    attention_efficiency: float | None = None
    """Fraction of the peak a fused attention kernel (flash attention, SDPA) reaches on its
    executed FLOPs, forward and backward: its softmax and online rescaling sit between two
    matmuls, so it stays well below a plain matmul's. None: `compute_efficiency`."""
    matmul_half_flops: float = 0.0
    """FLOPs of one matmul at which it reaches half of `compute_efficiency`: small matmuls
    do not fill the device. 0: efficiency does not depend on size."""
    op_overhead_s: float = 0.0
    """Fixed seconds per forward op besides its math (dispatch; launch when host-bound)."""
    backward_op_overhead_s: float = 0.0
    """The same per forward op, for its backward (autograd's engine runs a node per op)."""
    optimizer_tensor_overhead_s: float = 0.0
    """Fixed seconds per parameter tensor in an optimizer step (AdamW runs ops per tensor)."""
    task_overhead_s: float = 0.0
    """Fixed seconds the runtime spends per task of a Plan (bookkeeping between tasks)."""
    runtime_compute_factor: float = 1.0
    """How much longer compute tasks take inside a real training step than the profile's
    probes time them, beyond what core sharing explains (many short tasks woken and put to
    sleep, the runtime's own threads): fitted by `piper-plan profile` from a short real run;
    1 for the catalog's GPUs."""
    send_overhead_s: float = 0.0
    """Seconds a rank is busy posting one message (LogP's sender overhead o); the message
    then travels for alpha + n / beta."""
    cores_per_node: float | None = None
    """CPU ranks share a node's cores: k ranks computing at once each run at
    min(1, cores / k) of their speed. A measured spec holds the cores the ranks effectively
    got (one rank's time alone over N ranks' time at once, times N), which folds in other
    load on the machine. None: every rank owns its device (GPUs)."""
    comm_compute_contention: float = 0.0
    """Fraction by which compute slows while a collective of its rank runs on another stream
    (communication kernels and copies take a share of the device)."""
    all_reduce: AlphaBeta | None = None
    all_gather: AlphaBeta | None = None
    reduce_scatter: AlphaBeta | None = None
    p2p: AlphaBeta | None = None

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            problems.append(f"gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < 1:
            problems.append(f"memory_bytes must be an integer >= 1, got {self.memory_bytes!r}")
        for f in ("flops", "intra_node_bandwidth", "inter_node_bandwidth"):
            v = getattr(self, f)
            if not _number(v) or not v > 0:
                problems.append(f"{f} must be a number > 0, got {v!r}")
        for f in ("intra_node_latency", "inter_node_latency"):
            v = getattr(self, f)
            if not _number(v) or not 0 <= v < math.inf:
                problems.append(f"{f} must be a finite number >= 0, got {v!r}")
        e = self.compute_efficiency
        if not _number(e) or not 0 < e <= 1:
            problems.append(f"compute_efficiency must be in (0, 1], got {e!r}")
        a = self.attention_efficiency
        if a is not None and (not _number(a) or not 0 < a <= 1):
            problems.append(f"attention_efficiency must be in (0, 1], got {a!r}")
        for f in ("memory_bandwidth", "bf16_flops", "elementwise_bandwidth"):
            v = getattr(self, f)
            if v is not None and (not _number(v) or not v > 0):
                problems.append(f"{f} must be a number > 0, got {v!r}")
        for f in ("matmul_half_flops", "op_overhead_s", "backward_op_overhead_s",
                  "optimizer_tensor_overhead_s", "task_overhead_s", "send_overhead_s",
                  "comm_compute_contention"):
            v = getattr(self, f)
            if not _number(v) or not 0 <= v < math.inf:
                problems.append(f"{f} must be a finite number >= 0, got {v!r}")
        c = self.cores_per_node
        if c is not None and (not _number(c) or not 0 < c < math.inf):
            problems.append(f"cores_per_node must be a number > 0, got {c!r}")
        k = self.runtime_compute_factor
        if not _number(k) or not 0 < k < math.inf:
            problems.append(f"runtime_compute_factor must be a number > 0, got {k!r}")
        for f in COLLECTIVE_FIELDS:
            if getattr(self, f) is not None and not isinstance(getattr(self, f), AlphaBeta):
                problems.append(f"{f} must be an AlphaBeta, got {getattr(self, f)!r}")
        if problems:
            raise PiperError(f"cluster {self.name!r}: " + "; ".join(problems))

    def node_of(self, rank: int) -> int:
        """Ranks fill nodes in order, as launchers place them."""
        return rank // self.gpus_per_node

    @property
    def effective_flops(self) -> float:
        return self.flops * self.compute_efficiency

    def peak_flops(self, low_precision: bool = False) -> float:
        """Peak dense FLOP/s for fp32 (`flops`) or 16-bit float math (`bf16_flops`)."""
        return (self.bf16_flops or self.flops) if low_precision else self.flops

    def matmul_rate(self, flops: float, low_precision: bool = False) -> float:
        """Achieved FLOP/s of one matmul of `flops`: peak x efficiency x f / (f + half).

        The saturating curve is the same as a fixed cost per matmul (half / achieved peak
        seconds) plus its FLOPs at the achieved peak, which is what a size sweep measures.
        """
        rate = self.peak_flops(low_precision) * self.compute_efficiency
        if self.matmul_half_flops <= 0 or flops <= 0:
            return rate
        return rate * flops / (flops + self.matmul_half_flops)

    def matmul_seconds(self, flops: float, nbytes: float, low_precision: bool = False,
                       attention: bool = False) -> float:
        """Seconds of one matmul of `flops` whose operands and result are `nbytes`.

        Its math alone takes t_c = flops / `matmul_rate` (a fused attention: at
        `attention_efficiency` of the peak); streaming its operands alone
        t_m = nbytes / `elementwise_bandwidth` (no memory term where that is None, as on
        profiled CPU specs, whose fitted rate covers it). A kernel that does both at once
        reaches neither bound near the ridge point, so the two combine as
        sqrt(t_c^2 + t_m^2): against XLA's measured H100 bf16 GEMM table
        (`xla/service/gpu/model/matmul_interpolator_data.h`, shapes up to 4096^3) this is
        within about 15% where both terms matter, where max(t_c, t_m) is up to 50% fast and
        t_c + t_m up to 30% slow. A thin matmul (a small hidden size) is thereby slower per
        FLOP than a wide one, as measured.
        """
        if flops <= 0:
            compute = 0.0
        elif attention and self.attention_efficiency is not None:
            compute = flops / (self.peak_flops(low_precision) * self.attention_efficiency)
        else:
            compute = flops / self.matmul_rate(flops, low_precision)
        bw = self.elementwise_bandwidth
        if not bw or nbytes <= 0:
            return compute
        return math.hypot(compute, nbytes / bw)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


# Where catalog figures come from. Peak rates, memory sizes and bandwidths, and link rates are
# vendor datasheet numbers; everything else is an assumption and is labelled as one. A
# measured spec (`piper-plan profile`) is the way to replace assumptions with figures.
_NVIDIA = "NVIDIA datasheet"
ELEMENTWISE_SHARE = 0.8
"""Share of the HBM bandwidth memory-bound kernels (norms, activations, adds) stream at."""
_ASSUMED = ("assumed, not measured: elementwise_bandwidth 0.8 of the HBM bandwidth "
            "(memory-bound kernels), latencies (typical NCCL small-message figures); "
            "profile to replace them")
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
H100_FLASH = 0.35
"""FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608): FlashAttention-2, the kernel
PyTorch's SDPA flash backend runs (and torchtitan and llm-foundry with it), reaches 35% of
the H100's peak (FlashAttention-3 itself 75% forward, in FP16)."""
_FLASH = "attention_efficiency: FlashAttention-2 as measured by its papers"

_H100 = ClusterSpec(
        name="h100-80gb", device="NVIDIA H100-SXM5-80GB", gpus_per_node=8,
        memory_bytes=80 * GiB, flops=67e12, compute_efficiency=H100_MAMF,
        attention_efficiency=H100_FLASH, intra_node_bandwidth=450e9, intra_node_latency=5e-6,
        inter_node_bandwidth=50e9, inter_node_latency=1e-5, memory_bandwidth=3.35e12,
        elementwise_bandwidth=ELEMENTWISE_SHARE * 3.35e12,
        bf16_flops=989e12,
        source=f"{_NVIDIA} H100 SXM (FP32 67 TF; TF32 dense 495 TF; BF16 dense 989 TF; "
               "HBM3 3.35 TB/s; NVLink4 900 GB/s bidirectional); DGX H100 datasheet: "
               f"one 400 Gb/s NDR HCA per GPU; {_MAMF}: H100 SXM 794.5 TF; {_FLASH} (35% "
               "on H100, FlashAttention-3 paper); " + _ASSUMED)



def _a100_source(memory: str) -> str:
    return (f"{_NVIDIA} A100 SXM (FP32 19.5 TF; TF32 dense 156 TF; BF16 dense 312 TF; "
            f"{memory}; NVLink3 600 GB/s bidirectional); DGX A100 datasheet: one 200 Gb/s "
            f"HDR HCA per GPU; {_MAMF}: A100 SXM 271.2 TF; {_FLASH} (50-73% on A100, the "
            "backward at the low end); " + _ASSUMED)


_A100_40 = ClusterSpec(
        name="a100-40gb", device="NVIDIA A100-SXM4-40GB", gpus_per_node=8,
        memory_bytes=40 * GiB, flops=19.5e12, compute_efficiency=A100_MAMF,
        attention_efficiency=A100_FLASH, intra_node_bandwidth=300e9, intra_node_latency=5e-6,
        inter_node_bandwidth=25e9, inter_node_latency=1e-5, memory_bandwidth=1555e9,
        elementwise_bandwidth=ELEMENTWISE_SHARE * 1555e9,
        bf16_flops=312e12, source=_a100_source("HBM2 1555 GB/s"))

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
                   "part, so the power cap's lower clocks are not modelled; " + _ASSUMED),
        ClusterSpec(
            name="h200", device="NVIDIA H200-SXM-141GB", gpus_per_node=8,
            # 141 GB datasheet; nvidia-smi shows ~140 GiB, so round down to that
            memory_bytes=140 * GiB, flops=67e12, compute_efficiency=H100_MAMF,
            attention_efficiency=H100_FLASH,
            intra_node_bandwidth=450e9, intra_node_latency=5e-6,
            inter_node_bandwidth=50e9, inter_node_latency=1e-5, memory_bandwidth=4.8e12,
            elementwise_bandwidth=ELEMENTWISE_SHARE * 4.8e12,
            bf16_flops=989e12,
            source=f"{_NVIDIA} H200 SXM (FP32 67 TF; TF32 dense 495 TF; BF16 dense 989 TF; "
                   "HBM3e 4.8 TB/s; NVLink4 900 GB/s bidirectional); DGX H200 datasheet: "
                   f"one 400 Gb/s NDR HCA per GPU; {_MAMF}: the H100 SXM's 794.5 TF (the "
                   f"same die and clocks; the table's GH200 is a 900 W part); {_FLASH} (the "
                   "H100's 35%); " + _ASSUMED),
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
        if f.type in ("float", "float | None") and _number(data.get(f.name)):
            data[f.name] = float(data[f.name])
    for f in COLLECTIVE_FIELDS:
        if f in data:
            data[f] = _alpha_beta(data[f], f, path)
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
        return AlphaBeta(**{k: float(x) if _number(x) else x for k, x in v.items()})
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
