"""What a long command shows while it runs, and what it ran when it is stopped.

On a terminal (and without ``--json``) each exploration gets a live bar on stderr: schedules done
of its budget, schedules per second, violations so far and the time left; a command made of many
explorations (``check``, ``explore --all``, ``mutants``) also shows which one of how many is
running and the time left for all of them. Elsewhere — a pipe, a CI log — nothing moves: one line
is printed per finished exploration. Either way the :class:`Progress` keeps every finished
exploration's summary, which is what an interrupted command prints before it exits.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from omnisim.explore import ExploreResult

#: How often a worker (of ``--jobs N`` or ``--ray``) tells the campaign's live bar what it has
#: run (seconds).
LIVE_EVERY_S = 0.25

#: Turns a finished exploration's summary into the lines printed for it.
Describe = Callable[[dict[str, Any]], list[str]]


class Progress:
    """The progress of one command: ``total`` explorations of known budgets (``None``: unknown)."""

    def __init__(self, describe: Describe, *, live: bool, total: int | None = None, out: TextIO | None = None) -> None:
        self.describe = describe
        self.live = live
        self.total = total
        self.out = out or sys.stdout
        self.finished: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self._bar: tqdm | None = None
        self._budget_done = 0
        self._budget_total: int | None = None
        #: One bar for the whole campaign stays up while explorations finish (see campaign_bar).
        self._campaign = False

    @classmethod
    def for_command(cls, describe: Describe, *, json_output: bool, total: int | None = None) -> Progress:
        """Live on a terminal, quiet under ``--json`` or when stdout is not a terminal."""
        return cls(describe, live=not json_output and sys.stdout.isatty() and sys.stderr.isatty(), total=total)

    def plan(self, budgets: list[int]) -> None:
        """Announce the budgets of every exploration to come, for the overall time left."""
        self.total = len(budgets)
        self._budget_total = sum(budgets)

    def start(self, label: str, budget: int) -> Callable[[ExploreResult], None]:
        """A bar for one exploration; the returned callback is its ``on_schedule``."""
        self.close_bar()
        if not self.live:
            return _ignore
        position = f"[{len(self.finished) + 1}/{self.total}] " if self.total else ""
        self._bar = tqdm(total=budget, desc=f"{position}{label}", unit="sched", file=sys.stderr, leave=False)
        return self._update

    def _update(self, result: ExploreResult) -> None:
        bar = self._bar
        if bar is None:
            return
        bar.update(result.schedules - bar.n)
        postfix = {"violations": result.violation_count}
        left = self._overall_left(result)
        if left is not None:
            postfix["all left"] = _duration(left)
        bar.set_postfix(postfix, refresh=False)

    def _overall_left(self, current: ExploreResult) -> float | None:
        if self._budget_total is None or len(self.finished) + 1 >= (self.total or 0):
            return None
        done = self._budget_done + current.schedules
        elapsed = time.perf_counter() - self.started
        return elapsed / done * (self._budget_total - done) if done else None

    def campaign_bar(self) -> Callable[[int, Sofar], None] | None:
        """One bar for explorations running side by side (``--jobs N``): schedules of the whole
        campaign's budget, schedules per second, distinct traces and violations so far. The
        returned callback takes an exploration's index and what it has run so far; None when
        nothing is shown live."""
        if not self.live:
            return None
        self.close_bar()
        self._bar = tqdm(total=self._budget_total, desc="explorations", unit="sched", file=sys.stderr, leave=False)
        self._campaign = True
        latest: dict[int, Sofar] = {}

        def update(index: int, sofar: Sofar) -> None:
            bar = self._bar
            if bar is None:
                return
            latest[index] = sofar
            bar.update(sum(s.schedules for s in latest.values()) - bar.n)
            bar.set_postfix(
                {
                    "done": f"{len(self.finished)}/{self.total}",
                    "traces": sum(s.traces for s in latest.values()),
                    "violations": sum(s.violations for s in latest.values()),
                },
                refresh=False,
            )

        return update

    def done(self, summary: dict[str, Any], budget: int | None = None) -> None:
        """One exploration ended (or was interrupted): print its lines and keep its summary."""
        if not self._campaign:
            self.close_bar()
        self.finished.append(summary)
        self._budget_done += budget if budget is not None else summary["schedules"]
        for line in self.describe(summary):
            if self._bar is not None:
                tqdm.write(line, file=self.out)  # above the campaign's bar, which stays
            else:
                print(line, file=self.out, flush=True)

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclass(frozen=True)
class Sofar:
    """What one exploration has run so far, as a worker reports it to the campaign's bar."""

    schedules: int
    traces: int
    violations: int

    @classmethod
    def of(cls, result: ExploreResult) -> Sofar:
        return cls(result.schedules, len(result.traces), result.violation_count)


def _ignore(_: ExploreResult) -> None:
    return None


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
