"""Shrinking a failing run that the random walk or PCT found, so a person reads the few
preemptions and the few faults the bug needs instead of the hundred the search happened to take.

A schedule is seen the way ``dfs`` sees one (:mod:`omnisim.strategies.dfs`): at every decision,
the index of the task taken in the *default order* (the task that ran last first, then the rest
by id). Index 0 everywhere is the schedule with no deviation at all; each non-zero index is a
deviation, and nearly every preemption is one. The shrinker first re-expresses the failing run in
those terms (replaying its choices, so the first candidate fails exactly as found), then, as
Hypothesis shrinks a choice sequence, tries smaller ones: drop every decision after the last
deviation, drop a deviation, take an earlier candidate, remove a decision so the ones after it move
up. A candidate is kept only if the same world (same seed) still fails as found: an invariant the
find failed, and no slip of the world's own code (a crash raised outside the runtime) that the find
did not show — a smaller world that fails for another reason is another failure.

Then the faults, if one that the command line added (``--fault``, ``--faults sampled``) fired.
Every fault that fired in the shrunk run, the scenario's own too, is re-expressed as a fixed one:
its kind, the point it fired at, that hit's attributes and which matching hit it was
(:func:`fired_faults`), so a fault that fired with a probability fires there for certain, and the
plan's faults that never fired are gone. That plan replaces the world's (the artifact records it,
and replay uses it instead of drawing again); the shrinker drops added faults while the run still
fails, then shrinks the schedule again, in turn until neither gets smaller. The scenario's own
faults are never dropped: they are what it is about, and without them its world fails for other
reasons (``failed_put`` without its full store leaves a chunk nobody reads). A find with no added
fault is shrunk in its schedule only, as before.

Then the requests. A scenario's clients (:class:`scenarios.pipeline.Client`: the requests of the
pipeline, stage-crash and hostile-request scenarios) are each a whole request the run may leave
out: a left-out client submits nothing and nothing checks it, and a helper that waits on it (an
abort once it is submitted) does nothing either. The shrinker leaves out one client at a time,
the last made first, keeping each one whose run still fails: before the schedule (every later run
is then of a smaller world, and quicker) and again after the faults, each time followed by the
schedule again. The artifact records the clients left out (``left_out``) and replay leaves them
out too. The other scenarios' requests are fixed parts of their world (an edge's producer and
consumer, a race's two generations): they are not shrunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omnisim.base import stop_requested
from omnisim.faults import Fault
from omnisim.report.timeline import Event, preemptions
from omnisim.strategies.dfs import Bound, DfsStrategy

if TYPE_CHECKING:
    from omnisim.explore import RunResult
    from omnisim.sim_kernel import SimTask
    from runtime.kernel import Attr

#: Runs one schedule of the failing world, with exactly the faults given (None: the world's own),
#: leaving out the clients named.
RunSchedule = Callable[[DfsStrategy, "list[Fault] | None", frozenset[str]], Awaitable["RunResult"]]
#: Whether a run still shows the bug (a violation that counts).
StillFails = Callable[["RunResult"], bool]
#: The next candidates from a shrinker's best run: schedules, each with its faults and the
#: clients it leaves out.
Candidates = Callable[["_Best"], "list[tuple[list[int], list[Fault] | None, frozenset[str]]]"]

#: Runs and seconds a shrink may spend.
DEFAULT_SHRINK_RUNS = 300
DEFAULT_SHRINK_SECONDS = 20.0


class _Following(DfsStrategy):
    """Takes the recorded task ids, and records them as indices into the default order."""

    name = "shrink"

    def __init__(self, tids: list[int]) -> None:
        super().__init__([], Bound(0), lenient=True)
        self.tids = tids

    def index(self, order: list[SimTask]) -> int:
        depth = len(self.decisions)
        want = self.tids[depth] if depth < len(self.tids) else None
        return next((i for i, task in enumerate(order) if task.tid == want), 0)


@dataclass
class Shrunk:
    #: The shrunk run; its ``fault_plan`` is the fixed faults it needs (None: no fault fired).
    run: RunResult
    prefix: list[int]
    #: Deviations (non-zero indices) of the schedule as found, and as shrunk.
    deviations_before: int
    deviations: int
    #: Preemptions (switches away from a task that could go on) as found, and as shrunk.
    preemptions_before: int
    preemptions: int
    #: Faults that fired as found, and as shrunk.
    faults_before: int
    faults: int
    runs: int
    #: Clients (requests a shrinker may leave out) as found, and as shrunk.
    clients_before: int = 0
    clients: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "deviations_before": self.deviations_before,
            "deviations": self.deviations,
            "preemptions_before": self.preemptions_before,
            "preemptions": self.preemptions,
            "faults_before": self.faults_before,
            "faults": self.faults,
            "clients_before": self.clients_before,
            "clients": self.clients,
            "runs": self.runs,
        }


def preemptions_of(res: RunResult) -> int:
    events = [Event(i, 0, task, name, {}) for i, (task, name) in enumerate(res.events)]
    return len(preemptions(events))


def faults_of(res: RunResult) -> int:
    """How many faults fired in ``res``."""
    return sum(1 for _, name in res.events if name == "fault")


def deviations(prefix: list[int]) -> int:
    return sum(1 for index in prefix if index)


def fired_faults(res: RunResult) -> list[Fault]:
    """Every fault that fired in ``res``, in order, as the fixed fault that fires at the very same
    hit: its kind, the point and that hit's attributes, and the how-manieth hit it was of those
    alike (and whether it was :attr:`~omnisim.faults.Fault.added`). Hits where an earlier fault
    fired are not counted, because a plan stops at the first fault that fires and the later ones
    never see that hit; so with the same schedule these faults fire exactly where the originals
    did, whatever plan those came from."""
    fired = [i - 1 for i, (_, name) in enumerate(res.events) if name == "fault"]  # after its point
    taken = set(fired)
    faults: list[Fault] = []
    for at, original in zip(fired, res.fired, strict=True):
        point = res.events[at][1]
        match = {name: str(value) for name, value in _attrs(res, at).items()}
        hit = 1 + sum(1 for i in range(at) if i not in taken and res.events[i][1] == point and _matches(res, i, match))
        faults.append(Fault(original.kind, match=match, nth=hit, at=point, added=original.added))
    return faults


def _attrs(res: RunResult, i: int) -> dict[str, Attr]:
    return dict(json.loads(res.trace_lines[i])["a"])


def _matches(res: RunResult, i: int, match: dict[str, str]) -> bool:
    """Whether event ``i`` is a hit of a fault that matches ``match`` (the test of
    :meth:`~omnisim.faults.FaultPlan.fire`)."""
    attrs = _attrs(res, i)
    return all(str(attrs.get(name)) == value for name, value in match.items())


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


def _fewer(faults: list[Fault]) -> list[list[Fault]]:
    """Plans with fewer :attr:`~omnisim.faults.Fault.added` faults than ``faults`` (the scenario's
    own stay), most promising first: none added at all, then each without one (the last first:
    dropping it changes the least of the run)."""
    droppable = [i for i, fault in enumerate(faults) if fault.added]
    out = [[fault for fault in faults if not fault.added]] if len(droppable) > 1 else []
    out.extend(faults[:i] + faults[i + 1 :] for i in reversed(droppable))
    return out


def _without_one(clients: list[str], left_out: frozenset[str]) -> list[frozenset[str]]:
    """Each way to leave out one more of ``clients``, the last made first (the scenario's first
    clients are usually its premise; the later ones its company)."""
    return [left_out | {name} for name in reversed(clients) if name not in left_out]


def clients_in(res: RunResult) -> int:
    """How many of the scenario's clients ``res`` ran."""
    return len(res.clients) - len(res.left_out)


def _key(prefix: list[int]) -> tuple[int, int, int]:
    return deviations(prefix), sum(prefix), len(prefix)


@dataclass
class _Best:
    """The smallest failing run so far: its schedule, and its faults as a fixed plan (None: the
    world's own plan, before the faults are fixed)."""

    prefix: list[int]
    run: RunResult
    faults: list[Fault] | None = None
    left_out: frozenset[str] = frozenset()

    def take(self, strategy: DfsStrategy, res: RunResult) -> None:
        self.prefix, self.run, self.left_out = strategy.taken(), res, frozenset(res.left_out)
        if self.faults is not None:
            self.faults = fired_faults(res)  # a fault the new run did not fire is not needed


class _Shrinker:
    """Runs candidates of one failing world within a budget of runs and seconds."""

    def __init__(self, run: RunSchedule, still_fails: StillFails, max_runs: int, max_seconds: float) -> None:
        self._run = run
        self._still_fails = still_fails
        self._max_runs = max_runs
        self._deadline = time.perf_counter() + max_seconds
        self.runs = 0

    def spent(self) -> bool:
        """Out of runs or time, or stopped (Ctrl-C): the shrink ends with the best so far."""
        return bool(stop_requested) or self.runs >= self._max_runs or time.perf_counter() > self._deadline

    async def failing(
        self, strategy: DfsStrategy, faults: list[Fault] | None, left_out: frozenset[str]
    ) -> RunResult | None:
        """The run of ``strategy`` with ``faults``, leaving out ``left_out``, if it still fails."""
        res = await self._run(strategy, faults, left_out)
        if stop_requested:
            # The run was cut short, and fails for that alone: it proves nothing, and the shrink
            # ends with the best run so far, which did run to its end.
            return None
        self.runs += 1
        return res if self._still_fails(res) else None

    async def _descend(self, best: _Best, candidates: Candidates, smaller: Callable[[DfsStrategy], bool]) -> bool:
        """Take the first of ``candidates(best)`` that still fails and whose schedule as taken is
        ``smaller``, and go on from there until none is; whether one was."""
        shrank, improved = False, True
        while improved and not self.spent():
            improved = False
            for prefix, faults, left_out in candidates(best):
                if self.spent():
                    break
                strategy = DfsStrategy(prefix, Bound(sum(prefix)), lenient=True)
                res = await self.failing(strategy, faults, left_out)
                if res is not None and smaller(strategy):
                    best.take(strategy, res)
                    shrank = improved = True
                    break
        return shrank

    async def schedule(self, best: _Best) -> bool:
        """Take smaller schedules (with ``best``'s faults) until none is; whether one was."""
        return await self._descend(
            best,
            lambda b: [(prefix, b.faults, b.left_out) for prefix in _smaller(b.prefix)],
            lambda strategy: _key(strategy.taken()) < _key(best.prefix),
        )

    async def fix_faults(self, best: _Best) -> bool:
        """Replace the world's plan with the faults that fired, fixed; whether an added one fired
        (there is something to drop) and the run with them still fails."""
        faults = fired_faults(best.run)
        if not any(fault.added for fault in faults) or self.spent():
            return False
        strategy = DfsStrategy(best.prefix, Bound(sum(best.prefix)), lenient=True)
        res = await self.failing(strategy, faults, best.left_out)
        if res is None:  # the faults did not come out the same: keep the world's own plan
            return False
        best.faults = faults
        best.take(strategy, res)
        return True

    async def faults(self, best: _Best) -> bool:
        """Drop added faults (keeping ``best``'s schedule) until none can go; whether one could.
        Any schedule will do: a run with fewer faults is smaller, whatever its schedule."""
        assert best.faults is not None
        return await self._descend(
            best, lambda b: [(b.prefix, plan, b.left_out) for plan in _fewer(b.faults or [])], lambda strategy: True
        )

    async def clients(self, best: _Best) -> bool:
        """Leave out clients (keeping ``best``'s schedule as far as it still fits) until none
        can go; whether one could. A run with fewer requests is smaller, whatever its schedule."""
        return await self._descend(
            best,
            lambda b: [(b.prefix, b.faults, left_out) for left_out in _without_one(b.run.clients, b.left_out)],
            lambda strategy: True,
        )


async def shrink(
    found: RunResult,
    run: RunSchedule,
    still_fails: StillFails,
    max_runs: int = DEFAULT_SHRINK_RUNS,
    max_seconds: float = DEFAULT_SHRINK_SECONDS,
) -> Shrunk:
    """The smallest failing schedule, and then the fewest faults, within ``max_runs`` runs and
    ``max_seconds`` (``found`` itself if it cannot be re-expressed)."""
    shrinker = _Shrinker(run, still_fails, max_runs, max_seconds)
    following = _Following(found.choices)
    left_out = frozenset(found.left_out)
    first = await shrinker.failing(following, None, left_out)
    preempted, faulted, clients = preemptions_of(found), faults_of(found), clients_in(found)
    if first is None:  # the world is not deterministic: keep what was found
        return Shrunk(found, [], 0, 0, preempted, preempted, faulted, faulted, shrinker.runs, clients, clients)
    best = _Best(following.taken(), first, left_out=left_out)
    deviated = deviations(best.prefix)
    # Fewer requests first: every later run is of a smaller world, and quicker.
    await shrinker.clients(best)
    await shrinker.schedule(best)
    if await shrinker.fix_faults(best):
        # Each pass ends where it can do no more; the other may then find more to do.
        await shrinker.faults(best)
        while await shrinker.schedule(best) and await shrinker.faults(best):
            pass
    if await shrinker.clients(best):
        await shrinker.schedule(best)
    return Shrunk(
        best.run,
        best.prefix,
        deviated,
        deviations(best.prefix),
        preempted,
        preemptions_of(best.run),
        faulted,
        faults_of(best.run),
        shrinker.runs,
        clients,
        clients_in(best.run),
    )
