"""``dfs``: every schedule of one world, depth first, within a bound on how far each may stray
from the default schedule — a search that ends, and then says so.

The *default* choice keeps running the task that ran last, or, when it blocked or finished, runs
the lowest-numbered runnable task. Each decision orders its candidates default first, and taking
the k-th costs k (delay bounding, Emmi, Qadeer and Rakamarić 2011): preempting a running task
costs at least one, and so does any switch the default would not make. CHESS's preemption bound
leaves the switches at blocking points free, which multiplies out (about 50,000 schedules of
``abort_during_put`` within 2 preemptions did not finish); with delays, a bound of 2 on its 36
decisions is about 700 schedules. Most concurrency bugs need very few such deviations.

The search lives across executions, as shuttle's schedulers do: :class:`DfsSearch` hands out
the next schedule as a *prefix* (the choice to take at each of the first decisions; after the
prefix every decision takes the non-preempting choice), and learns from each execution's
decisions where it can branch next. One world with one seed runs every time, so a prefix
replays the same decisions. Not yet: sleep sets or DPOR (independent steps are still tried in
both orders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnisim.strategies.base import Strategy, default_order

if TYPE_CHECKING:
    from omnisim.sim_kernel import SimTask


@dataclass(frozen=True)
class Decision:
    """One decision of an execution: its candidates (task ids, the default first) and which
    one was taken."""

    order: tuple[int, ...]
    chosen: int
    #: What the execution strayed before this decision (the sum of the indices it took).
    delays_before: int

    def delays_with(self, index: int) -> int:
        return self.delays_before + index


class DfsStrategy(Strategy):
    """One execution of the search: the choices of ``prefix`` first, then the default ones."""

    name = "dfs"

    def __init__(self, prefix: list[int], delays: int, *, lenient: bool = False) -> None:
        """``lenient``: a prefix index past a decision's candidates takes the default instead of
        failing (a shrinker's edited prefix may no longer fit the decisions it changed)."""
        self.prefix = prefix
        self.delays = delays
        self.lenient = lenient
        self.decisions: list[Decision] = []

    def choose(self, candidates: list[SimTask]) -> SimTask:
        order = default_order(candidates, self.current)
        index = self.index(order)
        before = self.decisions[-1].delays_with(self.decisions[-1].chosen) if self.decisions else 0
        self.decisions.append(Decision(tuple(t.tid for t in order), index, before))
        return order[index]

    def index(self, order: list[SimTask]) -> int:
        """Which of ``order`` (the default first) this decision takes."""
        depth = len(self.decisions)
        index = self.prefix[depth] if depth < len(self.prefix) else 0
        if index < len(order):
            return index
        if self.lenient:
            return 0
        raise RuntimeError(
            f"dfs: decision {depth} has {len(order)} candidates where an earlier run of the same "
            "schedule had more: the world is not deterministic"
        )

    def taken(self) -> list[int]:
        """The execution as a prefix: every decision's index, trailing defaults dropped."""
        taken = [d.chosen for d in self.decisions]
        while taken and taken[-1] == 0:
            taken.pop()
        return taken

    def describe(self) -> dict[str, object]:
        return {"strategy": self.name, "delays": self.delays, "prefix": self.prefix}


class DfsSearch:
    """Which schedule comes next, until every one within ``delays`` has run."""

    def __init__(self, delays: int) -> None:
        self.delays = delays
        self._last: list[Decision] | None = None

    def next_execution(self) -> DfsStrategy | None:
        """The next schedule to run; None once the bounded space is exhausted."""
        if self._last is None:
            return DfsStrategy([], self.delays)
        for depth in range(len(self._last) - 1, -1, -1):
            decision = self._last[depth]
            # Indices only grow along a decision's candidates, and so does their cost.
            if decision.chosen + 1 < len(decision.order) and decision.delays_with(decision.chosen + 1) <= self.delays:
                prefix = [d.chosen for d in self._last[:depth]] + [decision.chosen + 1]
                return DfsStrategy(prefix, self.delays)
        return None

    def record(self, execution: DfsStrategy) -> None:
        """What the execution just run decided (the search branches off it next)."""
        self._last = execution.decisions
