"""``replay``: follow a recorded choice sequence; if the code changed so that it no longer fits,
follow the recorded order of named events instead, and say where the two parted.

A choice was recorded only where the recorded strategy allowed two tasks or more; a strategy that
holds tasks back (``ordered``) is replayed behind the same gate, so the choices fall on the same
decisions and the tasks it held back are held back again."""

from __future__ import annotations

from typing import TYPE_CHECKING

from invariants.observed import TraceEvent
from omnisim.strategies.base import Strategy

if TYPE_CHECKING:
    from omnisim.sim_kernel import SimTask


class ReplayStrategy(Strategy):
    name = "replay"

    def __init__(self, choices: list[int], events: list[tuple[str, str]], gate: Strategy | None = None) -> None:
        """``gate``: the recorded strategy, rebuilt, whose ``allowed`` holds tasks back."""
        self._gate = gate
        self._choices = choices
        self._events = events  # (task, event name) in recorded order
        self._step = 0
        self._cursor = 0
        self.diverged_at: int | None = None

    def allowed(self, ready: list[SimTask]) -> list[SimTask]:
        return self._gate.allowed(ready) if self._gate is not None else ready

    def choose(self, candidates: list[SimTask]) -> SimTask:
        if self.diverged_at is None and self._step < len(self._choices):
            want = self._choices[self._step]
            self._step += 1
            for task in candidates:
                if task.tid == want:
                    return task
            self.diverged_at = self._step - 1
        elif self.diverged_at is None:
            self.diverged_at = self._step
        return self._by_event_order(candidates)

    def _by_event_order(self, candidates: list[SimTask]) -> SimTask:
        for task_name, event_name in self._events[self._cursor :]:
            for task in candidates:
                if task.name == task_name and task.pending[0] == event_name:
                    return task
        return candidates[0]

    def on_event(self, event: TraceEvent) -> None:
        if self._gate is not None:
            self._gate.on_event(event)
        if self._cursor < len(self._events) and self._events[self._cursor] == (event.task, event.name):
            self._cursor += 1

    def describe(self) -> dict[str, object]:
        return {"strategy": self.name}
