"""The one interface every scheduling strategy implements."""

from __future__ import annotations

from typing import TYPE_CHECKING

from invariants.observed import TraceEvent

if TYPE_CHECKING:
    from omnisim.sim_kernel import SimTask


def default_order(candidates: list[SimTask], current: SimTask | None) -> list[SimTask]:
    """The candidates, the *default* first: the task that ran last keeps running if it can,
    then the rest by task id. Index 0 is no deviation; every other index is one."""
    running = current if current in candidates else None
    rest = sorted((t for t in candidates if t is not running), key=lambda t: t.tid)
    return [running, *rest] if running is not None else rest


class Strategy:
    """Given the runnable tasks, pick the one that runs next.

    ``allowed`` may hold tasks back (ordering constraints); ``choose`` is only asked when at
    least two tasks are allowed; ``on_event`` sees every trace event as it happens. When
    ``choose`` is asked, ``current`` is the task that ran last: picking another candidate while
    it is one of them *preempts* it.
    """

    name = "base"
    current: SimTask | None = None

    def allowed(self, ready: list[SimTask]) -> list[SimTask]:
        return ready

    def choose(self, candidates: list[SimTask]) -> SimTask:
        raise NotImplementedError

    def on_event(self, event: TraceEvent) -> None:
        return None

    def unsatisfied(self) -> list[str]:
        """Constraints this run did not meet (empty for unconstrained strategies)."""
        return []

    def describe(self) -> dict[str, object]:
        """Parameters that rebuild this strategy (stored in artifacts)."""
        return {"strategy": self.name}
