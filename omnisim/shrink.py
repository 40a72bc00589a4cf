"""Shrinking a failing schedule that the random walk or PCT found, so a person reads the few
preemptions the bug needs instead of the hundred the search happened to take.

A schedule is seen the way ``dfs`` sees one (:mod:`omnisim.strategies.dfs`): at every decision,
the index of the task taken in the *default order* (the task that ran last first, then the rest
by id). Index 0 everywhere is the schedule with no deviation at all; each non-zero index is a
deviation, and nearly every preemption is one. The shrinker first re-expresses the failing run in
those terms (replaying its choices, so the first candidate fails exactly as found), then, as
Hypothesis shrinks a choice sequence, tries smaller ones: drop every decision after the last
deviation, drop a deviation, take an earlier candidate, remove a decision so the ones after it move
up. A candidate is kept only if the same world (same seed) still fails an invariant that counts.
Faults and requests are the scenario's (fixed by the seed): they are not shrunk.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnisim.report.timeline import Event, preemptions
from omnisim.strategies.dfs import DfsStrategy

if TYPE_CHECKING:
    from omnisim.explore import RunResult
    from omnisim.sim_kernel import SimTask

#: Runs one schedule of the failing world.
RunSchedule = Callable[[DfsStrategy], Awaitable["RunResult"]]
#: Whether a run still shows the bug (a violation that counts).
StillFails = Callable[["RunResult"], bool]

#: Runs and seconds a shrink may spend.
DEFAULT_SHRINK_RUNS = 300
DEFAULT_SHRINK_SECONDS = 20.0


class _Following(DfsStrategy):
    """Takes the recorded task ids, and records them as indices into the default order."""

    name = "shrink"

    def __init__(self, tids: list[int]) -> None:
        super().__init__([], 0, lenient=True)
        self.tids = tids

    def index(self, order: list[SimTask]) -> int:
        depth = len(self.decisions)
        want = self.tids[depth] if depth < len(self.tids) else None
        return next((i for i, task in enumerate(order) if task.tid == want), 0)


@dataclass
class Shrunk:
    run: RunResult
    prefix: list[int]
    #: Deviations (non-zero indices) of the schedule as found, and as shrunk.
    deviations_before: int
    deviations: int
    #: Preemptions (switches away from a task that could go on) as found, and as shrunk.
    preemptions_before: int
    preemptions: int
    runs: int

    def as_dict(self) -> dict[str, int]:
        return {
            "deviations_before": self.deviations_before,
            "deviations": self.deviations,
            "preemptions_before": self.preemptions_before,
            "preemptions": self.preemptions,
            "runs": self.runs,
        }


def preemptions_of(res: RunResult) -> int:
    events = [Event(i, 0, task, name, {}) for i, (task, name) in enumerate(res.events)]
    return len(preemptions(events))


def deviations(prefix: list[int]) -> int:
    return sum(1 for index in prefix if index)


def _smaller(prefix: list[int]) -> list[list[int]]:
    """Candidates smaller than ``prefix``, most promising first."""
    out = [[], prefix[: len(prefix) // 2]]  # no deviation at all; only the first half's
    positions = [i for i, index in enumerate(prefix) if index]
    for i in reversed(positions):
        out.append([*prefix[:i], 0, *prefix[i + 1 :]])  # drop a deviation
    for i in reversed(positions):
        if prefix[i] > 1:
            out.append([*prefix[:i], 1, *prefix[i + 1 :]])  # an earlier candidate
    for i in reversed(positions):
        out.append(prefix[:i] + prefix[i + 1 :])  # later decisions move up one
    return out


def _key(prefix: list[int]) -> tuple[int, int, int]:
    return deviations(prefix), sum(prefix), len(prefix)


async def shrink(
    found: RunResult,
    run: RunSchedule,
    still_fails: StillFails,
    max_runs: int = DEFAULT_SHRINK_RUNS,
    max_seconds: float = DEFAULT_SHRINK_SECONDS,
) -> Shrunk:
    """The smallest failing schedule within ``max_runs`` runs and ``max_seconds`` (``found``
    itself if it cannot be re-expressed)."""
    deadline = time.perf_counter() + max_seconds
    following = _Following(found.choices)
    best_run = await run(following)
    runs = 1
    if not still_fails(best_run):  # the world is not deterministic: keep what was found
        return Shrunk(found, [], 0, 0, preemptions_of(found), preemptions_of(found), runs)
    best = following.taken()
    before = deviations(best)
    improved = True
    while improved and runs < max_runs:
        improved = False
        for candidate in _smaller(best):
            if runs >= max_runs or time.perf_counter() > deadline:
                break
            strategy = DfsStrategy(candidate, sum(candidate), lenient=True)
            res = await run(strategy)
            runs += 1
            taken = strategy.taken()
            if still_fails(res) and _key(taken) < _key(best):
                best, best_run, improved = taken, res, True
                break
    return Shrunk(best_run, best, before, deviations(best), preemptions_of(found), preemptions_of(best_run), runs)
