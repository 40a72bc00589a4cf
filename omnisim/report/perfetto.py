"""A run in the Chrome trace event format, which Perfetto (ui.perfetto.dev) and chrome://tracing
open: one thread per task, an instant per event, a slice for every wait or block."""

from __future__ import annotations

from typing import Any

from omnisim.report.timeline import Event, lanes, preemptions

_WAITS = ("kernel.block", "kernel.wait")


def chrome_trace(events: list[Event], title: str) -> dict[str, Any]:
    """Timestamps are virtual microseconds; events at one virtual instant keep their order
    through a nanosecond step each, so the viewer shows them as the schedule ran them."""
    tids = {task: i + 1 for i, task in enumerate(lanes(events))}
    out: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": title}}]
    out += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": t}} for t, tid in tids.items()]
    stamps = [e.time_us + e.index * 1e-3 for e in events]
    next_of: dict[int, int] = {}
    last: dict[str, int] = {}
    for i, e in enumerate(events):
        if e.task in last:
            next_of[last[e.task]] = i
        last[e.task] = i
    preempted = set(preemptions(events))
    for i, e in enumerate(events):
        base = {"pid": 1, "tid": tids[e.task], "ts": stamps[i], "args": {"index": e.index, **e.attrs}}
        if e.name in _WAITS and i in next_of:
            out.append(
                base | {"ph": "X", "name": f"{e.name} {e.attrs.get('on', '')}", "dur": stamps[next_of[i]] - stamps[i]}
            )
        else:
            out.append(base | {"ph": "i", "s": "t", "name": e.name})
        if e.index in preempted:
            out.append(base | {"ph": "i", "s": "t", "name": "preempted", "cat": "preemption"})
    return {"traceEvents": out, "displayTimeUnit": "ns"}
