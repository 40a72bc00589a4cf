"""``random``: a seeded uniform random walk over the runnable tasks (shuttle's default)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from omnisim.strategies.base import Strategy

if TYPE_CHECKING:
    from omnisim.sim_kernel import SimTask


class RandomStrategy(Strategy):
    name = "random"

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def choose(self, candidates: list[SimTask]) -> SimTask:
        return candidates[self._rng.randrange(len(candidates))]

    def describe(self) -> dict[str, object]:
        return {"strategy": self.name, "seed": self.seed}
