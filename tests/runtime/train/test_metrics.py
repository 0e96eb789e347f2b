"""Training metrics: steps numbered from 1 in TensorBoard and metrics.jsonl alike, and a
resumed run's log cut back to its checkpoint (no step twice)."""

from __future__ import annotations

import json

import pytest

from runtime.train.metrics import MetricsLog

pytest.importorskip("tensorboard")


def _row(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "time_s": 0.1,
            "tokens_per_s": 10.0, "mfu": None, "peak_memory_bytes": [1]}


def test_a_resumed_log_keeps_each_step_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(str(tmp_path), 1)
    for k in range(1, 6):  # trained to step 5, checkpointed at 3, killed
        log.write(_row(k, 10.0 - k))
    log.close()
    log = MetricsLog(str(tmp_path), 1, after=3)  # resumed from step 3
    for k in (4, 5, 6):
        log.write(_row(k, 20.0 - k))
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [9.0, 8.0, 7.0, 16.0, 15.0, 14.0]
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in events] == [9.0, 8.0, 7.0, 16.0, 15.0, 14.0]
