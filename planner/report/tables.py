"""Human-readable reports: the results table, strategy headers and summary text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from piper.schedules import NO_PIPELINE

if TYPE_CHECKING:  # simulate prints with this module and must not need Optuna
    from planner.search.measure import Measurement
    from planner.search.records import TrialRecord

GIB = 1024**3


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= 0.1 * GIB else f"{n / 1024**2:.1f} MiB"


def cp_text(s: dict[str, Any]) -> str:
    """` cp=N` when a strategy splits sequences (nothing otherwise: older summaries have no
    cp)."""
    return f" cp={s['cp']}" if s.get("cp", 1) > 1 else ""


def summary_line(s: dict[str, Any]) -> str:
    """A strategy in one line; a schedule is named only where there is one to name."""
    schedule = (f"schedule={s['schedule']} v={s['virtual_stages']} "
                if s["schedule"] != NO_PIPELINE else "")
    return (f"dp={s['dp']} pp={s['pp']} tp={s['tp']}{' sp' if s.get('sp') else ''} "
            f"ep={s['ep']}{' etp=' + str(s['etp']) if s.get('etp', 1) > 1 else ''}"
            f"{' over-tp' if s.get('ep_over_tp') else ''}"
            f"{' capacity=' + format(s['capacity'], 'g') if s.get('capacity') else ''}"
            f"{cp_text(s)} zero={s['zero']} {schedule}mb={s['microbatches']}"
            + (" recompute" if s["recompute"] is True
               else f" recompute={s['recompute']}" if s["recompute"] else "")
            + (" comm-stream" if s.get("comm_stream") else "")
            + (f" bucket={s['bucket_mb']:g}MiB" if s.get("bucket_mb") else ""))


def unused(s: dict[str, Any]) -> list[str]:
    """The degrees of freedom a strategy leaves alone, and what that rules out."""
    out = []
    if s["pp"] == 1:
        out.append("no pipeline (pp=1: one stage, no pipeline schedule)")
    if s["dp"] == 1 and s.get("cp", 1) == 1:
        out.append("no data parallelism (dp=1: no ZeRO, buckets or comm stream)")
    if s["tp"] == 1:
        out.append("no tensor parallelism (tp=1: no sequence parallelism)")
    return out


def predicted_line(p: dict[str, Any]) -> str:
    return (f"step {p['step_time_s'] * 1e3:.2f} ms, {p['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {p['mfu'] * 100:.1f}%, peak memory {fmt_bytes(max(p['peak_memory_bytes']))}"
            " (max rank)")


def results_table(records: Sequence[TrialRecord], top: int = 10) -> str:
    """Best `top` distinct strategies by predicted step time, feasible first (`+`: rc
    full activation recompute, rc:attn or rc:op a selective policy, cs gradient collectives
    on a comm stream, sp sequence parallelism, bN all-reduce buckets of N MiB)."""
    ranked = sorted(records, key=lambda r: (not r.feasible, r.predicted["step_time_s"], r.number))
    seen: set[str] = set()
    rows = []
    for r in ranked:
        key = summary_line(r.summary)
        if key not in seen and len(rows) < top:
            seen.add(key)
            rows.append(r)
    head = (f"{'#':>4} {'dp':>4} {'pp':>3} {'tp':>2} {'ep':>2} {'cp':>2} {'zero':>4} {'mb':>4} "
            f"{'schedule':<16} {'+':<13} {'step ms':>10} {'tokens/s':>12} {'MFU':>6} "
            f"{'peak mem':>11} fits")
    lines = [head, "-" * len(head)]
    for r in rows:
        s, p = r.summary, r.predicted
        lines.append(f"{r.number:>4} {s['dp']:>4} {s['pp']:>3} {s['tp']:>2} {s['ep']:>2} "
                     f"{s.get('cp', 1):>2} {s['zero']:>4} {s['microbatches']:>4} "
                     f"{s['schedule']:<16} {_options(s):<13} "
                     f"{p['step_time_s'] * 1e3:>10.2f} "
                     f"{p['tokens_per_s']:>12,.0f} {p['mfu'] * 100:>5.1f}% "
                     f"{fmt_bytes(max(p['peak_memory_bytes'])):>11} "
                     f"{'yes' if r.feasible else 'no'}")
    return "\n".join(lines)


def _options(s: dict[str, Any]) -> str:
    """Short flags for the choices beside the degrees (`results_table`)."""
    rc = s.get("recompute")
    flags = [f for f, on in (("rc" if rc in (True, None, False) else f"rc:{rc[:4]}", rc),
                             ("cs", s.get("comm_stream")), ("sp", s.get("sp"))) if on]
    if s.get("bucket_mb"):
        flags.append(f"b{s['bucket_mb']:g}")
    return ",".join(flags) or "-"


def pareto(records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """Feasible trials not beaten on both step time and peak memory by another."""
    pts = [r for r in records if r.feasible]

    def key(r: TrialRecord) -> tuple[float, float]:
        return r.predicted["step_time_s"], max(r.predicted["peak_memory_bytes"])

    def beats(o: TrialRecord, r: TrialRecord) -> bool:  # no worse on both, better on one
        (ot, om), (rt, rm) = key(o), key(r)
        return ot <= rt and om <= rm and (ot, om) != (rt, rm)

    front = [r for r in pts if not any(beats(o, r) for o in pts)]
    unique = {key(r): r for r in sorted(front, key=lambda r: -r.number)}
    return sorted(unique.values(), key=key)


def measured_table(measured: Sequence[Measurement]) -> str:
    """Predicted against measured, in measured order."""
    head = (f"{'rank':>4} {'trial':>5}  {'predicted ms':>12} {'measured ms':>12} "
            f"{'meas/pred':>9}  strategy")
    lines = [head, "-" * len(head)]
    for i, m in enumerate(measured, 1):
        pred = m.record.predicted["step_time_s"]
        meas = m.median_s
        cells = (f"{meas * 1e3:>12.2f} {meas / pred:>9.2f}" if meas is not None and pred > 0
                 else f"{'failed':>12} {'':>9}")
        lines.append(f"{i:>4} {m.record.number:>5}  {pred * 1e3:>12.3f} {cells}  "
                     f"{summary_line(m.record.summary)}"
                     + (f"  ({m.error})" if m.error else ""))
    return "\n".join(lines)

