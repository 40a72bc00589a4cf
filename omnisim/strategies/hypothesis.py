"""``hypothesis``: the schedule is a Hypothesis-drawn list of choices.

Before a run, Hypothesis draws a list of small integers; the i-th decision picks runnable task
number ``choices[i] mod (runnable tasks)``, and once the list is used up the first runnable task
runs. Hypothesis then owns the schedule as data: once one fails it *shrinks* the list — shorter,
and towards zeros, i.e. towards running the first runnable task — so the schedule it reports is
close to the simplest one that still fails. Drawing everything up front keeps Hypothesis out of
the running simulation. Used by :func:`omnisim.explore.explore` with ``strategy="hypothesis"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hypothesis import strategies as st

from omnisim.strategies.base import Strategy

if TYPE_CHECKING:
    from omnisim.sim_kernel import SimTask

#: The most decisions a drawn schedule steers (later ones take the first runnable task).
MAX_STEERED = 2000
#: One choice. Its range must cover the most runnable tasks a scenario has (13, in
#: ``pipeline_concurrent_chaos``; with 0..7 tasks past the 8th were never chosen); values this
#: small still take one byte of Hypothesis's buffer each.
CHOICE = st.integers(0, 31)
SCHEDULES = st.lists(CHOICE, max_size=MAX_STEERED)


class HypothesisStrategy(Strategy):
    name = "hypothesis"

    def __init__(self, choices: list[int]) -> None:
        self._choices = choices
        self._decisions = 0

    def choose(self, candidates: list[SimTask]) -> SimTask:
        i = self._decisions
        self._decisions += 1
        return candidates[self._choices[i] % len(candidates) if i < len(self._choices) else 0]
