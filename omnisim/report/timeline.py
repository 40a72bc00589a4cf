"""A failing run drawn as a timeline: one lane per task, its events in order, and the
preemptions, the switches away from a task that could have gone on, that made it fail."""

from __future__ import annotations

import io
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from invariants.dataplane import FAULT_OF_A_SCENARIO
from omnisim.base import UsageError

#: A task that emitted one of these stopped by itself: switching away from it is no preemption.
_STOPS = ("kernel.block", "kernel.wait", "kernel.crash", "kernel.killed", "process.killed", "process.paused")


@dataclass(frozen=True)
class Event:
    index: int
    time_us: int
    task: str
    name: str
    attrs: dict[str, Any]


def read_trace(artifact_path: str) -> list[Event]:
    """The events of an artifact's run, from the ``.trace.jsonl`` saved beside it; a trace that
    is missing or not one the simulator wrote is a :class:`UsageError` naming it."""
    path = Path(artifact_path)
    trace = path.with_name(path.name.removesuffix(".json") + ".trace.jsonl")
    events = []
    try:
        with trace.open(encoding="utf-8") as f:
            for line in f:
                e = json.loads(line)
                events.append(Event(int(e["i"]), int(e["t"]), str(e["task"]), str(e["ev"]), dict(e["a"])))
    except FileNotFoundError:
        raise UsageError(f"the artifact's trace is missing: {trace}") from None
    except OSError as e:
        raise UsageError(f"cannot read the artifact's trace {trace}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError) as e:  # (JSON and UTF-8 errors are ValueErrors)
        where = f"line {len(events) + 1}: {type(e).__name__}"
        raise UsageError(f"{trace} is not a trace the simulator wrote ({where})") from None
    return events


def preemptions(events: list[Event]) -> list[int]:
    """The indices of events after which the scheduler switched away from a task that was neither
    blocked nor finished: it had more to do, and another task went first."""
    last_of = {e.task: e.index for e in events}
    out = []
    for before, after in itertools.pairwise(events):
        if after.task != before.task and before.name not in _STOPS and last_of[before.task] > before.index:
            out.append(before.index)
    return out


def lanes(events: list[Event]) -> list[str]:
    """Tasks in the order they first appear."""
    return list(dict.fromkeys(e.task for e in events))


def _colour(name: str) -> str:
    if (
        name in ("fault", "kernel.crash", "probe.failed")
        or name.startswith(FAULT_OF_A_SCENARIO)
        or name.endswith(".failed")
    ):
        return "#d62728"
    if name in _STOPS:
        return "#7f7f7f"
    return "#1f77b4" if "." in name else "#2ca02c"


def draw(events: list[Event], title: str) -> bytes:
    """The timeline as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = lanes(events)
    row = {task: i for i, task in enumerate(names)}
    width = min(40.0, max(8.0, len(events) / 25))
    fig, ax = plt.subplots(figsize=(width, 1.2 + 0.35 * len(names)), dpi=80)
    try:
        for index in preemptions(events):
            ax.axvspan(index + 0.1, index + 0.9, color="#ff7f0e", alpha=0.35, linewidth=0)
        ax.scatter(
            [e.index for e in events],
            [row[e.task] for e in events],
            c=[_colour(e.name) for e in events],
            s=14,
            marker="s",
        )
        for task, i in row.items():
            mine = [e.index for e in events if e.task == task]
            ax.hlines(i, mine[0], mine[-1], color="#cccccc", linewidth=0.8, zorder=0)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("event (in the order the schedule ran them); orange: a preemption")
        ax.set_xlim(-1, len(events))
        ax.set_title(title, fontsize=10, loc="left")
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return out.getvalue()
    finally:
        plt.close(fig)
