"""``pct``: probabilistic concurrency testing (Burckhardt et al., ASPLOS 2010), as in shuttle.

Every task gets a random priority when it is first seen, and the highest-priority runnable task
always runs. ``depth − 1`` change points are drawn among the first ``max_steps`` decisions; at
each one, the task about to run drops below every initial priority. A bug that needs ``d``
ordering constraints to show is then found with probability at least ``1 / (n · k^(d−1))`` per
run (``n`` tasks, ``k`` steps), instead of the much smaller chance of a uniform random walk that
must get many consecutive choices right.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from omnisim.strategies.base import Strategy

if TYPE_CHECKING:
    from omnisim.sim_kernel import SimTask

DEFAULT_DEPTH = 3
#: Where change points are drawn: roughly the number of decisions of a mid-sized scenario.
DEFAULT_MAX_STEPS = 400


class PctStrategy(Strategy):
    name = "pct"

    def __init__(self, seed: int, depth: int = DEFAULT_DEPTH, max_steps: int = DEFAULT_MAX_STEPS) -> None:
        if depth < 1 or max_steps < 1:
            raise ValueError(f"pct needs depth >= 1 and max_steps >= 1; got {depth}, {max_steps}")
        self.seed = seed
        self.depth = depth
        self.max_steps = max_steps
        self._rng = random.Random(seed)
        self._priority: dict[int, float] = {}
        points = self._rng.sample(range(1, max_steps + 1), min(depth - 1, max_steps))
        #: Decision number -> the (low) priority the running task drops to there.
        self._change_points = {step: -(i + 1.0) for i, step in enumerate(sorted(points))}
        self._decisions = 0

    def choose(self, candidates: list[SimTask]) -> SimTask:
        self._decisions += 1
        for task in candidates:
            if task.tid not in self._priority:
                self._priority[task.tid] = self._rng.random()  # initial priorities lie in [0, 1)
        pick = max(candidates, key=lambda t: self._priority[t.tid])
        lowered = self._change_points.get(self._decisions)
        if lowered is not None:
            self._priority[pick.tid] = lowered  # later change points go lower still
            pick = max(candidates, key=lambda t: self._priority[t.tid])
        return pick

    def describe(self) -> dict[str, object]:
        return {"strategy": self.name, "seed": self.seed, "depth": self.depth, "max_steps": self.max_steps}
