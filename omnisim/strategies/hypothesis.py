"""``hypothesis``: the schedule is a Hypothesis-drawn list of choices.

Before a run, Hypothesis draws a list of small integers; the i-th decision takes candidate
``choices[i] mod n`` of its *default order* (the task that ran last first, then the rest by id,
as ``dfs`` orders them), and once the list is used up every decision takes the default. So every
runnable task can be chosen (numbers go up to 31; scenarios have at most 13 runnable tasks), and
0 means "no deviation": Hypothesis shrinks the list — shorter, and towards zeros — towards the
schedule with the fewest deviations, and a small number means the same deviation (the k-th other
task, with the running one first) whatever order the tasks were made in. Drawing
everything up front keeps Hypothesis out of the running simulation. Used by
:func:`omnisim.explore.explore` with ``strategy="hypothesis"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hypothesis import strategies as st

from omnisim.faults import SAMPLED_KINDS
from omnisim.strategies.base import Strategy, default_order

if TYPE_CHECKING:
    from omnisim.sim_kernel import SimTask

#: The most decisions a drawn schedule steers (later ones take the first runnable task).
MAX_STEERED = 2000
#: One choice. Its range must cover the most runnable tasks a scenario has (13, in
#: ``pipeline_concurrent_chaos``; with 0..7 tasks past the 8th were never chosen); values this
#: small still take one byte of Hypothesis's buffer each.
CHOICE = st.integers(0, 31)
SCHEDULES = st.lists(CHOICE, max_size=MAX_STEERED)


def schedules() -> st.SearchStrategy[list[int]]:
    """Schedules for ``@given``: run one with :func:`omnisim.explore.run_schedule`."""
    return SCHEDULES


def fault_specs(kinds: tuple[str, ...] = SAMPLED_KINDS, max_faults: int = 2) -> st.SearchStrategy[list[str]]:
    """Fault plans for ``@given``, as ``--fault`` specs: up to ``max_faults`` of ``kinds``, each
    on its first to fifth hit. Hypothesis shrinks them towards fewer faults, hit sooner."""
    one = st.builds(lambda kind, nth: f"{kind}#{nth}", st.sampled_from(kinds), st.integers(1, 5))
    return st.lists(one, max_size=max_faults, unique=True)


class HypothesisStrategy(Strategy):
    name = "hypothesis"

    def __init__(self, choices: list[int]) -> None:
        self._choices = choices
        self._decisions = 0

    def choose(self, candidates: list[SimTask]) -> SimTask:
        i = self._decisions
        self._decisions += 1
        order = default_order(candidates, self.current)
        index = self._choices[i] if i < len(self._choices) else 0
        return order[index % len(order)]
