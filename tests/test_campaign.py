"""The long campaign: every scenario under PCT at several seeds, on the clean runtime.

A race that needs several ordering constraints at once (issue 7's reused-id get) can hide from
the random walk for thousands of schedules; PCT's change points reach it. Run with ``--long``.
"""

from __future__ import annotations

import logging

import pytest

from omnisim import registry
from omnisim.explore import explore

registry.load()
logging.getLogger("runtime").setLevel(logging.CRITICAL)

SEEDS = (1, 1000, 5000)
BUDGET = 200


@pytest.mark.long
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", sorted(registry.SCENARIOS))
def test_scenario_is_clean_under_pct(scenario: str, seed: int) -> None:
    budget = registry.SCENARIOS[scenario].budget(BUDGET)
    res = explore(scenario, strategy="pct", budget=budget, seed=seed)
    assert res.schedules == budget
    assert res.violations == []
