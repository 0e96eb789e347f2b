"""`--measure K`: run the K best predicted strategies for real and re-rank them by measured time.

The simulator ranks thousands of points cheaply but is a model; a few real steps of the top
candidates (on the devices at hand: `--device`, `--address`) settle the order where it
matters. Candidates are distinct Programs that fit in memory, best predicted first; each
runs `steps` steps through the same runtime as `piper-plan run` (the Plan is lowered from
the real model), the first step is dropped as warm-up, and the median of the rest is its
measured time. A candidate that fails at runtime stays in the table with its error and is
ranked last: a search should not die because one candidate does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from piper.errors import PiperError
from piper.model_file import ModelSpec
from planner.search.records import TrialRecord

STEPS = 3
"""Per candidate: one warm-up step, then the median of two."""


@dataclass(frozen=True)
class Measurement:
    record: TrialRecord
    step_times_s: tuple[float, ...]
    """Every step's measured time, warm-up included."""
    peak_memory_bytes: tuple[int, ...]
    error: str | None = None

    @property
    def median_s(self) -> float | None:
        timed = self.step_times_s[1:] or self.step_times_s
        return statistics.median(timed) if timed and self.error is None else None

    def json(self) -> dict[str, Any]:
        return {"trial": self.record.number, "summary": self.record.summary,
                "predicted_step_time_s": self.record.predicted["step_time_s"],
                "measured_step_time_s": self.median_s,
                "step_times_s": list(self.step_times_s),
                "peak_memory_bytes": list(self.peak_memory_bytes), "error": self.error}


def candidates(records: Sequence[TrialRecord], k: int) -> list[TrialRecord]:
    """The `k` fastest predicted distinct Programs that fit in memory."""
    seen: set[str] = set()
    out: list[TrialRecord] = []
    for r in sorted(records, key=lambda r: (r.predicted["step_time_s"], r.number)):
        key = r.program.to_json()
        if r.feasible and key not in seen and len(out) < k:
            seen.add(key)
            out.append(r)
    return out


def measure(spec: ModelSpec, records: Sequence[TrialRecord], k: int, *, gpus: int,
            batch_size: int, device: str, seed: int, address: str | None = None,
            steps: int = STEPS, log: Any = None, per_node: int | None = None
            ) -> list[Measurement]:
    """Run the top `k` candidates for real; measured ones fastest first, failures last."""
    from runtime.cluster.join import connect, disconnect
    from runtime.cluster.launcher import RuntimeFailure, check_workers, run
    from runtime.lowering.lower import lower

    check_workers(gpus, device, address)
    # one Ray for every candidate: its start is the slow part
    started = connect(address, ship=[spec.source[0]])
    out: list[Measurement] = []
    try:
        for i, rec in enumerate(candidates(records, k)):
            t0 = time.perf_counter()
            try:
                plan = lower(spec, rec.program, gpus, batch_size)
                res = run(spec, plan, batch_size=batch_size, steps=steps, seed=seed,
                          device=device, address=address, per_node=per_node)
                m = Measurement(rec, tuple(s.time_s for s in res.steps), res.peak_memory_bytes)
            except (RuntimeFailure, PiperError) as e:
                m = Measurement(rec, (), (), f"{type(e).__name__}: {' '.join(str(e).split())}")
            out.append(m)
            if log:
                took = f"{m.median_s * 1e3:.1f} ms" if m.median_s is not None else m.error
                log(f"measured {i + 1}/{k}: trial {rec.number}: {took} "
                    f"({time.perf_counter() - t0:.1f} s)")
    finally:
        if started:
            disconnect()
    return sorted(out, key=lambda m: (m.median_s is None, m.median_s or 0.0))

