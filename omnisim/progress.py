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
from typing import Any, TextIO

from tqdm import tqdm

from omnisim.explore import ExploreResult

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

    def done(self, summary: dict[str, Any], budget: int | None = None) -> None:
        """One exploration ended (or was interrupted): print its lines and keep its summary."""
        self.close_bar()
        self.finished.append(summary)
        self._budget_done += budget if budget is not None else summary["schedules"]
        for line in self.describe(summary):
            print(line, file=self.out, flush=True)

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _ignore(_: ExploreResult) -> None:
    return None


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
