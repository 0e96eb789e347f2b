"""From measurements to a ClusterSpec: what `piper-plan profile` writes.

    spec, report = calibrate(measurements, model_costs(capture(model, 1)), name="mybox")

The fitted figures are properties of the machine and the runtime, not of the model that was
timed: a matmul curve (achieved FLOP/s by size), per-op overheads forward and backward, an
optimizer step's cost per tensor and per byte, and alpha-beta per collective kind. The model
only supplies chunks to time; its op records (`ModelCosts.ops`) say what each chunk ran.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import socket
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from cost_models import fit
from cost_models.analytical import UPDATE_BYTES_PER_PARAM, ModelCosts
from cost_models.cluster import AlphaBeta, ClusterSpec
from cost_models.fit import CommSample, OverheadSample
from cost_models.probes import SEND_POST, ComputeTimings
from cost_models.simulator import simulate
from piper.errors import PiperError
from runtime.lowering.dryrun import Span
from runtime.lowering.plan import Plan


@dataclass(frozen=True)
class Measurements:
    """Everything one profile run measured on one node of `ranks` ranks."""

    device: str
    """"cpu" or "cuda"."""
    device_name: str
    ranks: int
    memory_bytes: int
    """Memory one rank may use."""
    cores: float | None
    """Cores the CPU ranks effectively share, measured (None on GPUs)."""
    comm: tuple[CommSample, ...]
    """One sample per round: the slowest rank's seconds per op."""
    compute: ComputeTimings
    run: RunSample | None = None
    """A short real run of the runtime; None: not measured."""


@dataclass(frozen=True)
class RunSample:
    """A short real training run: its Plan, microbatch size and the measured timeline of
    its last step, to price what only the runtime adds to the probes' figures."""

    plan: Plan
    microbatch_size: int
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class FitReport:
    """How well each fitted form explains its own timings: mean absolute % error."""

    errors: tuple[tuple[str, float], ...]

    def line(self) -> str:
        return ", ".join(f"{k} {v:.0f}%" for k, v in self.errors)


def calibrate(m: Measurements, costs: ModelCosts, *, name: str) -> tuple[ClusterSpec, FitReport]:
    """Fit every figure `m` measures into a ClusterSpec; PiperError if a fit has no data."""
    errors: list[tuple[str, float]] = []
    fp32 = [s for s in m.compute.matmuls if not s.low_precision]
    curve = fit.fit_matmul_curve(fp32)
    errors.append(("matmul", _mape([(s.seconds, (s.flops + curve.half) / curve.rate)
                                    for s in fp32])))
    low = [s for s in m.compute.matmuls if s.low_precision]
    bf16 = fit.fit_matmul_curve(low).rate if low else None
    per_tensor, bandwidth = fit.fit_optimizer(m.compute.optimizer, UPDATE_BYTES_PER_PARAM)
    errors.append(("optimizer", _mape([
        (s.seconds, s.tensors * per_tensor + (s.params * UPDATE_BYTES_PER_PARAM / bandwidth
                                              if bandwidth else 0.0))
        for s in m.compute.optimizer])))
    links = _links(m.comm, errors)
    p2p = links.pop(fit.P2P, None)
    if p2p is None:
        raise PiperError("profile: no point-to-point timings to fit (needs --gpus >= 2)")
    base = ClusterSpec(
        name=name, device=m.device_name, gpus_per_node=m.ranks, memory_bytes=m.memory_bytes,
        flops=curve.rate, compute_efficiency=1.0, matmul_half_flops=curve.half,
        bf16_flops=bf16, intra_node_latency=p2p.latency, intra_node_bandwidth=p2p.bandwidth,
        inter_node_latency=p2p.latency, inter_node_bandwidth=p2p.bandwidth,
        memory_bandwidth=bandwidth, optimizer_tensor_overhead_s=per_tensor,
        cores_per_node=m.cores, p2p=p2p, **links,
        source=_source(m))
    fwd, bwd = _op_overheads(m.compute, costs, base)
    # the mean, not the median: a step pays every slow post too
    posts = [s.seconds for s in m.comm if s.kind == SEND_POST]
    spec = dataclasses.replace(base, op_overhead_s=fwd, backward_op_overhead_s=bwd,
                               send_overhead_s=statistics.mean(posts) if posts else 0.0)
    if m.run is not None:
        spec = _in_run(spec, m.run, costs)
    errors.append(("chunks", _mape(
        [(t.forward_s, f) for t, (f, _) in _predicted_chunks(m.compute, costs, spec)]
        + [(t.backward_s, b) for t, (_, b) in _predicted_chunks(m.compute, costs, spec)])))
    return spec, FitReport(tuple(errors))


def _in_run(spec: ClusterSpec, run: RunSample, costs: ModelCosts) -> ClusterSpec:
    """What a real step adds to the probes' figures: the executor's time between tasks
    (the mean gap; a step pays every slow one), then how much longer its compute tasks ran
    than the simulator, with those figures, predicts for the same Plan."""
    gaps = task_gaps(run.spans)
    spec = dataclasses.replace(spec, task_overhead_s=statistics.mean(gaps) if gaps else 0.0)
    predicted = simulate(run.plan, costs, spec, run.microbatch_size).spans
    measured, modelled = _compute_s(run.spans), _compute_s(predicted)
    if measured <= 0 or modelled <= 0:
        return spec
    # measured spans hold the work alone (their gaps are the overhead); simulated spans
    # add the overhead to each task, which the factor must not scale
    n = sum(1 for s in predicted if s.task.kind.is_compute)
    factor = measured / max(modelled - n * spec.task_overhead_s, 1e-12)
    return dataclasses.replace(spec, runtime_compute_factor=factor)


def task_gaps(spans: Sequence[Span]) -> list[float]:
    """Seconds between one task's end and the next one's start on the same rank and stream:
    the executor's bookkeeping per task (events, progress, memory ledger, thread hand-offs),
    which probes that time the work alone leave out."""
    lanes: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for sp in spans:
        lanes.setdefault((sp.rank, sp.stream), []).append((sp.start, sp.end))
    out = []
    for lane in lanes.values():
        lane.sort()
        out += [b[0] - a[1] for a, b in itertools.pairwise(lane) if b[0] >= a[1]]
    return out


def _compute_s(spans: Sequence[Span]) -> float:
    return sum(s.end - s.start for s in spans if s.task.kind.is_compute)


def _links(samples: Sequence[CommSample], errors: list[tuple[str, float]]
           ) -> dict[str, AlphaBeta]:
    out = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter", fit.P2P):
        mine = fit.median_by(s for s in samples if s.kind == kind)
        if len({s.nbytes for s in mine}) < 2:
            continue
        ab = fit.fit_alpha_beta(mine)
        out[kind] = ab
        errors.append((kind, _mape([(s.seconds, _ring(s, ab)) for s in mine])))
    return out


def _ring(s: CommSample, ab: AlphaBeta) -> float:
    steps, volume = fit.steps_and_volume(s.kind, s.ranks)
    return steps * ab.latency + volume * s.nbytes / ab.bandwidth


def _predicted_chunks(t: ComputeTimings, costs: ModelCosts, spec: ClusterSpec) -> list:
    return [(c, costs.chunk_seconds([c.region], c.samples, spec)) for c in t.chunks]


def _op_overheads(t: ComputeTimings, costs: ModelCosts, spec: ClusterSpec
                  ) -> tuple[float, float]:
    """Seconds per non-matmul op, forward and backward: what is left of each chunk's time
    once its matmuls are priced by the fitted curve, over its count of other ops."""
    if not costs.ops:
        raise PiperError("profile: the model's op records are missing; cannot fit overheads")
    fwd, bwd = [], []
    for c, (f, b) in _predicted_chunks(t, costs, spec):  # overheads are 0 in `spec` here
        ops = sum(g.count for g in costs.ops[costs.regions.index(c.region)] if not g.flops)
        fwd.append(OverheadSample(ops, c.forward_s - f))
        bwd.append(OverheadSample(ops, c.backward_s - b))
    return fit.fit_per_op(fwd), fit.fit_per_op(bwd)


def _mape(pairs: Sequence[tuple[float, float]]) -> float:
    kept = [(a, p) for a, p in pairs if a > 0]
    return 100 * sum(abs(p - a) / a for a, p in kept) / max(1, len(kept))


def _source(m: Measurements) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cores = f", {m.cores:.2f} cores effectively shared" if m.cores else ""
    return (f"measured by `piper-plan profile` on {socket.gethostname()} ({m.device_name}, "
            f"{m.ranks} ranks{cores}) at {when}: flops is the fitted fp32 matmul rate of one "
            "rank (so compute_efficiency is 1); collectives and p2p fitted with alpha-beta "
            "over message sizes; task_overhead_s and runtime_compute_factor from a short "
            "real run; inter-node figures were not measured (one node) and copy the "
            "intra-node p2p figures")
