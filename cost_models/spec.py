"""ClusterSpec: the handful of hardware figures the cost models need (see `cost_models.cluster`)."""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

from piper.errors import PiperError

GiB = 2**30


@dataclass(frozen=True, kw_only=True, slots=True)
class AlphaBeta:
    """A fitted alpha-beta pair: seconds per message step and bytes/s of the link."""

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not is_number(self.latency) or not 0 <= self.latency < math.inf:
            raise PiperError(f"latency must be a finite number >= 0, got {self.latency!r}")
        if not is_number(self.bandwidth) or not self.bandwidth > 0:
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
    matmuls, so it stays well below a plain matmul's. None: `compute_efficiency`. A
    measured `attention_curve` takes its place."""
    attention_curve: tuple[tuple[float, float, float, float], ...] = ()
    """A fused attention kernel's measured rate by key length: (keys, forward, causal
    forward, backward) points, each a fraction of the 16-bit peak on the FLOPs the kernel
    runs (a causal one skips the blocks above the diagonal), interpolated linearly in
    log(keys) and held flat past the ends. Each query tile loads its queries, rescales and
    writes its output once whatever the keys, and a causal mask's diagonal blocks cost a
    whole block for half its work: both weigh most when the keys are few. A causal
    backward runs at the backward rate times the causal forward's share of the plain one
    at that length (no causal backward curve is published). Empty: `attention_efficiency`
    at every length."""
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
    inter_node_contention: float = 0.0
    """The same while the collective crosses nodes with one rank per node (the NICs move
    the data; NCCL's kernels only feed them)."""
    sms: int = 0
    """Streaming multiprocessors: a GEMM's output tiles run in waves of `sms`, and a last
    wave that fills few of them wastes the rest (`cost_models.kernels`). 0: no waves."""
    kernel_overhead_s: float = 0.0
    """Fixed GPU seconds per kernel besides its math and bytes (launch, ramp-up and the
    tail of its last wave), every kernel: what makes many small kernels cost more than
    their FLOPs and bytes say."""
    host_dispatch_s: float = 0.0
    """CPU seconds eager PyTorch spends issuing one op (Python, autograd, dispatcher,
    launch): the device runs a chunk's kernels in order while the host queues them ahead, so
    a chunk takes the longer of its kernels' time and its ops' dispatch (host-bound when
    the kernels are small). 0: never host-bound."""
    sustained_clock: float = 1.0
    """Share of the measured best-shape rates (`compute_efficiency`,
    `attention_efficiency`) that math sustains through a whole training step: power and
    thermal limits lower the clocks on real data (an A100 matmul at 295 TF on zeros,
    257 TF on random data, Horace He)."""
    intra_node_busbw: tuple[tuple[float, float], ...] = ()
    """nccl-tests all-reduce bus bandwidth inside one node by message size: (bytes,
    bytes/s) points, interpolated log-log; below the first point the time stays the first
    point's (the latency floor). Empty: the alpha-beta link above."""
    intra_node_ring_busbw: float | None = None
    """Highest bus bandwidth of NCCL's ring algorithms inside a node: all-gathers,
    reduce-scatters, and all-reduces over <= 4 GPUs, where NVLink SHARP (NVLS) does not
    lift the all-reduce above it. None: no cap below `intra_node_busbw`."""
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
            if not is_number(v) or not v > 0:
                problems.append(f"{f} must be a number > 0, got {v!r}")
        for f in ("intra_node_latency", "inter_node_latency"):
            v = getattr(self, f)
            if not is_number(v) or not 0 <= v < math.inf:
                problems.append(f"{f} must be a finite number >= 0, got {v!r}")
        e = self.compute_efficiency
        if not is_number(e) or not 0 < e <= 1:
            problems.append(f"compute_efficiency must be in (0, 1], got {e!r}")
        a = self.attention_efficiency
        if a is not None and (not is_number(a) or not 0 < a <= 1):
            problems.append(f"attention_efficiency must be in (0, 1], got {a!r}")
        for f in ("memory_bandwidth", "bf16_flops", "elementwise_bandwidth"):
            v = getattr(self, f)
            if v is not None and (not is_number(v) or not v > 0):
                problems.append(f"{f} must be a number > 0, got {v!r}")
        for f in ("matmul_half_flops", "op_overhead_s", "backward_op_overhead_s",
                  "optimizer_tensor_overhead_s", "task_overhead_s", "send_overhead_s",
                  "comm_compute_contention", "inter_node_contention",
                  "kernel_overhead_s", "host_dispatch_s"):
            v = getattr(self, f)
            if not is_number(v) or not 0 <= v < math.inf:
                problems.append(f"{f} must be a finite number >= 0, got {v!r}")
        c = self.cores_per_node
        if c is not None and (not is_number(c) or not 0 < c < math.inf):
            problems.append(f"cores_per_node must be a number > 0, got {c!r}")
        if not isinstance(self.sms, int) or isinstance(self.sms, bool) or self.sms < 0:
            problems.append(f"sms must be an integer >= 0, got {self.sms!r}")
        s = self.sustained_clock
        if not is_number(s) or not 0 < s <= 1:
            problems.append(f"sustained_clock must be in (0, 1], got {s!r}")
        problems += _curve_problems(self.intra_node_busbw)
        problems += _attention_curve_problems(self.attention_curve)
        r = self.intra_node_ring_busbw
        if r is not None and (not is_number(r) or not r > 0):
            problems.append(f"intra_node_ring_busbw must be a number > 0, got {r!r}")
        k = self.runtime_compute_factor
        if not is_number(k) or not 0 < k < math.inf:
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
        rate = self.peak_flops(low_precision) * self.compute_efficiency * self.sustained_clock
        if self.matmul_half_flops <= 0 or flops <= 0:
            return rate
        return rate * flops / (flops + self.matmul_half_flops)

    def matmul_seconds(self, flops: float, nbytes: float, low_precision: bool = False
                       ) -> float:
        """Seconds of one matmul of `flops` whose operands and result are `nbytes`.

        Its math alone takes t_c = flops / `matmul_rate`; streaming its operands alone
        t_m = nbytes / `elementwise_bandwidth` (no memory term where that is None, as on
        profiled CPU specs, whose fitted rate covers it). A kernel that does both at once
        reaches neither bound near the ridge point, so the two combine as
        sqrt(t_c^2 + t_m^2): against XLA's measured H100 bf16 GEMM table
        (`xla/service/gpu/model/matmul_interpolator_data.h`, shapes up to 4096^3) this is
        within about 15% where both terms matter, where max(t_c, t_m) is up to 50% fast and
        t_c + t_m up to 30% slow. A thin matmul (a small hidden size) is thereby slower per
        FLOP than a wide one, as measured.
        """
        compute = flops / self.matmul_rate(flops, low_precision) if flops > 0 else 0.0
        return self._with_bytes(compute, nbytes)

    def attention_seconds(self, flops: float, nbytes: float, keys: float, causal: bool,
                          backward: bool, low_precision: bool = False) -> float:
        """Seconds of a fused attention kernel that runs `flops` (a causal one: the FLOPs
        below the diagonal) over `keys` keys per query, moving `nbytes`: at the
        `attention_curve` rate for its length and mask (forward or `backward`), or
        `attention_efficiency` of the peak, or as any matmul where neither is known; its
        bytes combine as `matmul_seconds` combines them."""
        if flops <= 0:
            return self._with_bytes(0.0, nbytes)
        share = (self._attention_share(keys, causal, backward) if self.attention_curve
                 else self.attention_efficiency)
        if share is None:
            return self.matmul_seconds(flops, nbytes, low_precision)
        rate = self.peak_flops(low_precision) * share * self.sustained_clock
        return self._with_bytes(flops / rate, nbytes)

    def _attention_share(self, keys: float, causal: bool, backward: bool) -> float:
        points = self.attention_curve

        def at(p: tuple[float, float, float, float]) -> float:
            share = p[3] if backward else p[1]
            return share * p[2] / p[1] if causal else share

        i = bisect.bisect_left([p[0] for p in points], keys)
        if i == 0:
            return at(points[0])
        if i == len(points):
            return at(points[-1])
        lo, hi = points[i - 1], points[i]
        w = math.log(keys / lo[0]) / math.log(hi[0] / lo[0])
        return at(lo) + w * (at(hi) - at(lo))

    def _with_bytes(self, compute: float, nbytes: float) -> float:
        bw = self.elementwise_bandwidth
        if not bw or nbytes <= 0:
            return compute
        return math.hypot(compute, nbytes / bw)


    def busbw(self, nbytes: float, ring: bool) -> float:
        """Bus bandwidth (bytes/s) of a collective of `nbytes` inside a node, from
        `intra_node_busbw` (`ring`: capped at `intra_node_ring_busbw`)."""
        points = self.intra_node_busbw
        sizes = [p[0] for p in points]
        i = bisect.bisect_left(sizes, nbytes)
        if i == 0:  # the latency floor: the first point's time, whatever fewer bytes
            bw = points[0][1] * max(nbytes, 1.0) / points[0][0]
        elif i == len(points):
            bw = points[-1][1]
        else:
            (s0, b0), (s1, b1) = points[i - 1], points[i]
            w = math.log(nbytes / s0) / math.log(s1 / s0)
            bw = b0 * (b1 / b0) ** w
        if ring and self.intra_node_ring_busbw is not None:
            bw = min(bw, self.intra_node_ring_busbw)
        return bw


def is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def _attention_curve_problems(points: object) -> list[str]:
    ok = isinstance(points, tuple) and all(
        isinstance(p, tuple) and len(p) == 4 and all(is_number(x) for x in p)
        and p[0] > 0 and all(0 < x <= 1 for x in p[1:]) for p in points)
    if ok and all(a[0] < b[0] for a, b in itertools.pairwise(points)):
        return []
    return [("attention_curve must be (keys, forward, causal forward, backward) points, keys "
             f"> 0 increasing, shares of the peak in (0, 1], got {points!r}")]


def _curve_problems(points: object) -> list[str]:
    ok = isinstance(points, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and all(is_number(x) and x > 0 for x in p)
        for p in points)
    if ok and all(a[0] < b[0] for a, b in itertools.pairwise(points)):
        return []
    return [(f"intra_node_busbw must be (bytes, bytes/s) pairs > 0 in increasing size, got "
             f"{points!r}")]

