"""``dfs``: every schedule of one world, depth first, within a bound on how far each may stray
from the default schedule — a search that ends, and then says so.

The *default* choice keeps running the task that ran last, or, when it blocked or finished, runs
the lowest-numbered runnable task. Each decision orders its candidates default first, and a
:class:`Bound` says what taking the k-th costs:

- ``delays`` (the default): k (delay bounding, Emmi, Qadeer and Rakamarić 2011). Preempting a
  running task costs at least one, and so does any switch the default would not make; reaching a
  task far down the order costs more. ``abort_during_put`` within 2 delays: 636 schedules.
- ``preemptions``: 1, whichever task it takes: every switch the default would not make counts
  once, as CHESS counts a preemption. CHESS leaves the choice at a blocking point free, which
  multiplies out (about 50,000 schedules of ``abort_during_put`` within 2 did not finish); here
  such a choice counts too, and 2 of them are 2,360 schedules, among which are bugs that 2 delays
  cannot reach (``cleanup_waits_for_io`` needs 4 delays, and one preemption to the right task).

Most concurrency bugs need very few such deviations.

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
class Bound:
    """How far a schedule may stray from the default one: at most ``limit``, a decision that takes
    its k-th candidate (the default is the 0th) counting k (``delays``) or 1 (``preemptions``)."""

    limit: int = 2
    kind: str = "delays"

    def __post_init__(self) -> None:
        if self.kind not in ("delays", "preemptions"):
            raise ValueError(f"a dfs bound counts delays or preemptions, not {self.kind!r}")

    def cost(self, index: int) -> int:
        """What taking a decision's ``index``-th candidate costs."""
        return index if self.kind == "delays" else min(index, 1)


@dataclass(frozen=True)
class Decision:
    """One decision of an execution: its candidates (task ids, the default first) and which
    one was taken."""

    order: tuple[int, ...]
    chosen: int
    #: What the execution strayed before this decision (the cost of every choice it made).
    spent_before: int


class DfsStrategy(Strategy):
    """One execution of the search: the choices of ``prefix`` first, then the default ones."""

    name = "dfs"

    def __init__(self, prefix: list[int], bound: Bound, *, lenient: bool = False) -> None:
        """``lenient``: a prefix index past a decision's candidates takes the default instead of
        failing (a shrinker's edited prefix may no longer fit the decisions it changed)."""
        self.prefix = prefix
        self.bound = bound
        self.lenient = lenient
        self.decisions: list[Decision] = []

    def choose(self, candidates: list[SimTask]) -> SimTask:
        order = default_order(candidates, self.current)
        index = self.index(order)
        last = self.decisions[-1] if self.decisions else None
        before = last.spent_before + self.bound.cost(last.chosen) if last is not None else 0
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
        return {"strategy": self.name, self.bound.kind: self.bound.limit, "prefix": self.prefix}


class DfsSearch:
    """Which schedule comes next, until every one within ``bound`` has run."""

    def __init__(self, bound: Bound) -> None:
        self.bound = bound
        self._last: list[Decision] | None = None

    def next_execution(self) -> DfsStrategy | None:
        """The next schedule to run; None once the bounded space is exhausted."""
        if self._last is None:
            return DfsStrategy([], self.bound)
        for depth in range(len(self._last) - 1, -1, -1):
            decision = self._last[depth]
            # Indices only grow along a decision's candidates, and their cost never falls.
            following = decision.chosen + 1
            affordable = decision.spent_before + self.bound.cost(following) <= self.bound.limit
            if following < len(decision.order) and affordable:
                prefix = [d.chosen for d in self._last[:depth]] + [following]
                return DfsStrategy(prefix, self.bound)
        return None

    def record(self, execution: DfsStrategy) -> None:
        """What the execution just run decided (the search branches off it next)."""
        self._last = execution.decisions
