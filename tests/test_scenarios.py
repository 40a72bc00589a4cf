"""Every scenario holds its invariants on the correct runtime; every mutant is caught."""

from __future__ import annotations

import logging

import pytest

from omnisim import registry
from omnisim.explore import explore
from scenarios import RACE_TABLE

registry.load()
logging.getLogger("runtime").setLevel(logging.CRITICAL)

CLEAN_BUDGET = {"memory": 200, "posix": 40}
MUTANT_BUDGET = 2000


def test_the_race_table_is_registered() -> None:
    assert set(registry.SCENARIOS) >= set(RACE_TABLE)
    assert len(registry.MUTANTS) >= 15


@pytest.mark.parametrize("store", sorted(CLEAN_BUDGET))
@pytest.mark.parametrize("scenario", sorted(registry.SCENARIOS))
def test_scenario_is_clean_under_random_schedules(scenario: str, store: str) -> None:
    budget = registry.SCENARIOS[scenario].budget(CLEAN_BUDGET[store])
    res = explore(scenario, budget=budget, store=store)
    assert res.schedules == budget
    assert res.violations == []


@pytest.mark.parametrize("scenario", sorted(n for n in RACE_TABLE if registry.SCENARIOS[n].constraints))
def test_scenario_is_clean_and_its_ordering_is_reachable(scenario: str) -> None:
    res = explore(scenario, strategy="ordered", budget=40, stop_on_violation=False)
    assert res.violations == []
    assert res.unsatisfied_runs < res.schedules, "the ordering was never met"


@pytest.mark.parametrize("mutant", sorted(registry.MUTANTS))
def test_mutant_is_detected(mutant: str) -> None:
    m = registry.MUTANTS[mutant]
    tried = []
    for scenario in m.scenarios:
        strategies = ["random"] + (["ordered"] if registry.SCENARIOS[scenario].constraints else [])
        for strategy in strategies:
            res = explore(scenario, strategy=strategy, budget=MUTANT_BUDGET, mutant=mutant)
            if res.violations:
                return
            tried.append(f"{scenario}/{strategy}: {res.schedules} schedules")
    pytest.fail(f"{mutant} was not detected ({'; '.join(tried)})")


def test_pct_finds_a_deep_race() -> None:
    """mapping_outside_lock needs a receiver cleanup to land between a poll's lock sections: the
    random walk took 271 schedules to find it (``omnisim mutants``), PCT's change points 11."""
    pct = explore("stale_receiver_entry", strategy="pct", budget=60, mutant="mapping_outside_lock")
    assert pct.violations
