"""Chrome / Perfetto trace (`traceEvents`) from timeline spans, with send -> recv flow arrows.

One process per rank, one thread per logical stream, one complete ("X") slice per task.
Each message is a flow from its SEND slice to its RECV slice, written in the trace format's
"v2" form: both slices carry the flow's `bind_id`, the SEND with `flow_out`, the RECV with
`flow_in`. Unlike "s"/"f" flow events, which viewers bind to whatever slice sits at their
timestamp, this cannot attach to the wrong slice when a simulated SEND takes no time and
a RECV starts at the same instant on the same stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from piper.dag import Kind
from runtime.lowering.dryrun import Span


def chrome_trace(spans: Iterable[Span]) -> dict:
    events: list[dict] = []
    sends: dict[int, list[dict]] = {}
    recvs: list[tuple[int, dict]] = []
    for s in spans:
        event = {"name": s.task.name, "ph": "X", "pid": s.rank, "tid": s.stream,
                 "ts": s.start * 1e6, "dur": max(s.end - s.start, 0.0) * 1e6,
                 "cat": s.task.kind.name}
        events.append(event)
        if s.task.kind is Kind.SEND:
            sends.setdefault(s.task.tag, []).append(event)
        elif s.task.kind is Kind.RECV:
            recvs.append((s.task.tag, event))
    flows = 0
    for tag, recv in recvs:
        senders = sends.get(tag)
        if not senders:  # a measured trace may hold one side of a message only
            continue
        # a measured tensor-parallel trace repeats a tag once per TP rank: pair them in order
        send = senders.pop(0)
        bind = f"0x{flows:x}"
        send.update(bind_id=bind, flow_out=True)
        recv.update(bind_id=bind, flow_in=True)
        flows += 1
    for rank in sorted({e["pid"] for e in events}):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(spans: Iterable[Span], path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(spans)))
