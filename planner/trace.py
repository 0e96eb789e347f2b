"""Chrome / Perfetto trace (`traceEvents`) from timeline spans, with send -> recv flow arrows."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from piper.dag import Kind
from runtime.dryrun import Span


def chrome_trace(spans: Iterable[Span]) -> dict:
    events: list[dict] = []
    sends: dict[int, Span] = {}
    recvs: list[Span] = []
    for s in spans:
        events.append({"name": s.task.name, "ph": "X", "pid": s.rank, "tid": s.stream,
                       "ts": s.start * 1e6, "dur": max(s.end - s.start, 0.0) * 1e6,
                       "cat": s.task.kind.name})
        if s.task.kind is Kind.SEND:
            sends[s.task.tag] = s
        elif s.task.kind is Kind.RECV:
            recvs.append(s)
    for i, r in enumerate(recvs):
        s = sends.get(r.task.tag)
        if s is None:
            continue
        events.append({"name": "p2p", "ph": "s", "id": i, "pid": s.rank, "tid": s.stream,
                       "ts": s.start * 1e6, "cat": "flow"})
        events.append({"name": "p2p", "ph": "f", "bp": "e", "id": i, "pid": r.rank,
                       "tid": r.stream, "ts": r.end * 1e6, "cat": "flow"})
    for rank in sorted({e["pid"] for e in events}):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(spans: Iterable[Span], path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(spans)))
