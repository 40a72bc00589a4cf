"""Every scenario holds its invariants on the correct runtime; every mutant is caught."""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import left_behind, shm_names

from omnisim import registry
from omnisim.explore import explore, replay
from scenarios import RACE_TABLE

registry.load()
logging.getLogger("runtime").setLevel(logging.CRITICAL)

CLEAN_BUDGET = {"memory": 200, "posix": 40}
MUTANT_BUDGET = 2000


def _quiet_worker() -> None:
    registry.load()
    logging.getLogger("runtime").setLevel(logging.CRITICAL)


def _clean_exploration(scenario: str, store: str, budget: int) -> tuple[int, list[dict[str, Any]]]:
    res = explore(scenario, budget=budget, store=store)
    return res.schedules, res.violations


@pytest.fixture(scope="module")
def clean_explorations() -> Iterator[dict[tuple[str, str], Future[tuple[int, list[dict[str, Any]]]]]]:
    """Every scenario's clean exploration on every store, two at a time in worker processes (an
    exploration is one thread; the machine has two cores), in the order the tests ask for them."""
    before = shm_names()
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"), initializer=_quiet_worker) as pool:
        yield {
            (scenario, store): pool.submit(
                _clean_exploration, scenario, store, registry.SCENARIOS[scenario].budget(CLEAN_BUDGET[store])
            )
            for scenario in sorted(registry.SCENARIOS)
            for store in sorted(CLEAN_BUDGET)
            if registry.SCENARIOS[scenario].unavailable(store) is None
        }
    assert left_behind(before) == []


def test_the_race_table_is_registered() -> None:
    assert set(registry.SCENARIOS) >= set(RACE_TABLE)
    assert len(registry.MUTANTS) >= 15


@pytest.mark.parametrize("store", sorted(CLEAN_BUDGET))
@pytest.mark.parametrize("scenario", sorted(registry.SCENARIOS))
def test_scenario_is_clean_under_random_schedules(
    scenario: str, store: str, clean_explorations: dict[tuple[str, str], Future[tuple[int, list[dict[str, Any]]]]]
) -> None:
    why = registry.SCENARIOS[scenario].unavailable(store)
    if why is not None:
        pytest.skip(why)
    schedules, violations = clean_explorations[scenario, store].result()
    assert schedules == registry.SCENARIOS[scenario].budget(CLEAN_BUDGET[store])
    assert violations == []


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
        strategies = ["pct", "random"] + (["ordered"] if registry.SCENARIOS[scenario].constraints else [])
        for strategy in strategies:
            res = explore(scenario, strategy=strategy, budget=MUTANT_BUDGET, mutant=mutant, store=m.store or "memory")
            if res.first_violation_after is not None:  # by an invariant it declares
                assert set(res.invariants()) & set(m.expect)
                return
            tried.append(f"{scenario}/{strategy}: {res.schedules} schedules, tripped {res.invariants()}")
    pytest.fail(f"{mutant} was not detected ({'; '.join(tried)})")


def test_pct_finds_a_deep_race() -> None:
    """mapping_outside_lock needs a receiver cleanup to land between a poll's lock sections: the
    random walk does not find it in 2,000 schedules, PCT's change points do (164 from seed 0)."""
    pct = explore("stale_receiver_entry", strategy="pct", budget=400, mutant="mapping_outside_lock")
    assert pct.violations


def test_a_get_in_flight_across_an_id_reuse_leaves_the_new_chunk() -> None:
    """Issue 7: an old generation's receiver parked at ``shm.get.begin`` while R is aborted and
    reused must not consume the new generation's chunk (PCT found it at schedule 98)."""
    res = explore("id_reuse_after_cancel", strategy="pct", budget=200, seed=1)
    assert res.schedules == 200
    assert res.violations == []
    bug = explore("id_reuse_after_cancel", strategy="pct", budget=200, seed=1, mutant="consume_without_claim")
    found = {v["invariant"] for entry in bug.violations for v in entry["violations"]}
    assert "no-stale-consume" in found


def test_pipeline_scenarios_walk_their_configurations() -> None:
    scn = registry.SCENARIOS["pipeline_requests"]
    configs = scn.configurations()
    assert len(configs) == 12
    assert {c["modalities"] for c in configs} == {"text", "audio", "text+audio"}
    assert {c["async_chunk"] for c in configs} == {"on", "off"}
    assert {c["shutdown"] for c in configs} == {"idle", "in_flight"}
    # Successive seeds walk through every configuration; a fixed parameter holds.
    assert [scn.params_for(seed) for seed in range(12)] == configs
    assert {scn.params_for(seed, {"async_chunk": "off"})["async_chunk"] for seed in range(12)} == {"off"}


@pytest.mark.parametrize(
    "params",
    [
        {"modalities": "text", "async_chunk": "on", "shutdown": "idle"},
        {"modalities": "audio", "async_chunk": "off", "shutdown": "idle"},
        {"modalities": "text+audio", "async_chunk": "off", "shutdown": "in_flight"},
    ],
    ids=lambda p: "-".join(p.values()),
)
def test_a_pipeline_configuration_is_clean(params: dict[str, str]) -> None:
    res = explore("pipeline_concurrent_chaos", budget=6, params=params, stop_on_violation=False)
    assert res.violations == []


def test_dfs_exhausts_a_small_scenario_and_its_finds_replay(tmp_path: Path) -> None:
    """Issue 11: a search that ends. Every schedule of abort_during_put's world within 2 delays
    (636 of them) holds; on parked_sender_terminal the search finds finish_before_force_terminal
    (schedule 309), and the artifact replays to the same trace."""
    clean = explore("abort_during_put", strategy="dfs", delays=2, budget=5000)
    assert clean.exhausted and clean.schedules == 636 and clean.violations == []
    found = explore(
        "parked_sender_terminal",
        strategy="dfs",
        delays=2,
        budget=5000,
        mutant="finish_before_force_terminal",
        out_dir=str(tmp_path),
    )
    assert found.first_violation_after is not None and not found.exhausted
    assert "liveness" in found.invariants()
    assert replay(found.violations[0]["artifact"]).reproduced


def test_a_preemption_bound_reaches_what_the_same_delay_bound_cannot() -> None:
    """cleanup_waits_for_io needs the abort to run while the put is in flight: one switch to a task
    far down the order, which costs 4 delays but 1 preemption. Within 2 delays every schedule
    holds; within 2 preemptions (a larger space: each non-default choice costs 1) one fails."""
    delays = explore("abort_during_put", strategy="dfs", delays=2, budget=5000, mutant="cleanup_waits_for_io")
    assert delays.exhausted and delays.first_violation_after is None
    preemptions = explore("abort_during_put", strategy="dfs", preemptions=2, budget=5000, mutant="cleanup_waits_for_io")
    assert preemptions.first_violation_after is not None
    assert "abort-non-blocking" in preemptions.invariants()
