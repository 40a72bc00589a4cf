"""A random or PCT find is saved shrunk: fewer deviations and fewer added faults, the same
invariant, the same world, replayable, and the same shrunk run every time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from omnisim import registry
from omnisim.base import UsageError, stop_requested
from omnisim.explore import Interrupted, RunResult, explore, replay, run, run_once, run_once_async
from omnisim.faults import Fault
from omnisim.registry import applied, get_mutant, get_scenario
from omnisim.shrink import _fewer, _Shrinker, _smaller, deviations, fired_faults, shrink
from omnisim.strategies.dfs import DfsStrategy
from omnisim.strategies.random import RandomStrategy
from omnisim.strategies.replay import ReplayStrategy
from omnisim.world import World

registry.load()

#: A mutant whose bug needs one storage error, in a scenario that has none of its own: with
#: ``--faults sampled`` its first find (seed 1) fires three.
NEEDS_A_FAULT = {"scenario": "similar_ids", "mutant": "storage_error_not_rolled_back", "faults": ["sampled"]}


def _find(tmp_path: Path, strategy: str, **kwargs: object) -> dict:
    options = {"scenario": "abort_during_put", "mutant": "cleanup_on_scheduler_thread"} | kwargs
    options = {"budget": 300} | options
    res = explore(strategy=strategy, out_dir=str(tmp_path), **options)  # type: ignore[arg-type]
    assert res.first_violation_after is not None
    return res.violations[-1]


@pytest.mark.parametrize("strategy", ["random", "pct"])
def test_a_find_is_saved_shrunk_and_replays(tmp_path: Path, strategy: str) -> None:
    entry = _find(tmp_path, strategy)
    shrunk = entry["shrunk"]
    assert shrunk["deviations"] < shrunk["deviations_before"]
    assert shrunk["preemptions"] <= shrunk["preemptions_before"]
    assert {v["invariant"] for v in entry["violations"]} >= {"abort-non-blocking"}
    again = replay(entry["artifact"])
    assert again.reproduced
    assert [v.invariant for v in again.run.violations] == [v["invariant"] for v in entry["violations"]]


def test_shrinking_is_deterministic(tmp_path: Path) -> None:
    first = _find(tmp_path / "a", "random")
    second = _find(tmp_path / "b", "random")
    assert first["shrunk"] == second["shrunk"]
    assert Path(first["artifact"]).read_text() == Path(second["artifact"]).read_text()


def test_a_stop_during_the_shrink_keeps_the_find_as_shrunk_so_far(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while a find is shrunk: the find was checked in full, so it is reported and saved
    (the best run the shrink reached), and the exploration reports the stop."""
    failing = _Shrinker.failing
    runs = []

    async def stopped_after_three(self: _Shrinker, *args: object) -> RunResult | None:
        runs.append(1)
        if len(runs) == 3:
            stop_requested.append("SIGINT")
        return await failing(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_Shrinker, "failing", stopped_after_three)
    try:
        with pytest.raises(Interrupted) as stopped:
            explore("abort_during_put", mutant="cleanup_on_scheduler_thread", budget=300, out_dir=str(tmp_path))
    finally:
        stop_requested.clear()
    (entry,) = stopped.value.partial.violations
    assert entry["shrunk"]["runs"] == 2  # (the third was cut short: it proves nothing)
    assert replay(entry["artifact"]).reproduced


def test_a_pct_find_is_repeated_by_its_seed(tmp_path: Path) -> None:
    entry = _find(tmp_path, "pct", shrink_finds=False, seed=5)
    found = json.loads(Path(entry["artifact"]).read_text())
    again = run("abort_during_put", seed=entry["seed"], strategy="pct", mutant="cleanup_on_scheduler_thread")
    assert again.trace_digest == found["trace_digest"] and again.violations


def test_no_shrink_saves_the_find_as_found(tmp_path: Path) -> None:
    entry = _find(tmp_path, "random", shrink_finds=False)
    assert "shrunk" not in entry


def test_every_candidate_is_smaller() -> None:
    prefix = [0, 2, 0, 1, 0, 3]
    for candidate in _smaller(prefix):
        key = (deviations(candidate), sum(candidate), len(candidate))
        assert key < (deviations(prefix), sum(prefix), len(prefix))


def test_fault_candidates_drop_added_faults_only() -> None:
    own = Fault("put_fail", match={"key": "F_0_3"})
    added = [Fault("store_full", match={"key": f"R_{i}_0"}, added=True) for i in range(3)]
    plan = [added[0], own, added[1], added[2]]
    candidates = _fewer(plan)
    assert candidates[0] == [own]
    assert candidates[1:] == [[added[0], own, added[1]], [added[0], own, added[2]], [own, added[1], added[2]]]
    assert _fewer([own]) == [] and _fewer([own, added[0]]) == [[own]]


def test_fired_faults_fire_at_the_same_hits() -> None:
    """Sampled faults re-expressed as fixed ones give the very same run."""
    found = run(NEEDS_A_FAULT["scenario"], seed=1, faults=NEEDS_A_FAULT["faults"])
    fixed = fired_faults(found)
    assert len(fixed) == 3 and all(f.probability is None and f.added for f in fixed)
    scn = get_scenario(NEEDS_A_FAULT["scenario"]).with_faults(NEEDS_A_FAULT["faults"])
    again = run_once(scn, store="memory", strategy=RandomStrategy(1), seed=1, fault_plan=fixed)
    assert again.trace_digest == found.trace_digest
    assert fired_faults(again) == fixed


def test_a_sampled_find_shrinks_to_the_one_fault_it_needs(tmp_path: Path) -> None:
    entry = _find(tmp_path, "random", **NEEDS_A_FAULT)
    assert entry["shrunk"]["faults_before"] > entry["shrunk"]["faults"] == 1
    artifact = json.loads(Path(entry["artifact"]).read_text())
    [fault] = artifact["fault_plan"]
    assert fault["added"] and fault["at"] == "shm.put.locked"
    assert {v["invariant"] for v in entry["violations"]} >= {"no-orphan-lock"}
    again = replay(entry["artifact"], check=True)
    assert again.reproduced and again.nondeterminism is None
    assert [v.invariant for v in again.run.violations] == [v["invariant"] for v in entry["violations"]]
    # Without that one fault, the same schedule of the same world holds.
    scn = get_scenario(NEEDS_A_FAULT["scenario"]).with_faults(NEEDS_A_FAULT["faults"])
    with applied(get_mutant(NEEDS_A_FAULT["mutant"])):
        strategy = ReplayStrategy(artifact["choices"], [tuple(e) for e in artifact["events"]])
        clean = run_once(scn, store="memory", strategy=strategy, seed=artifact["seed"], fault_plan=[])
    assert "no-orphan-lock" not in {v.invariant for v in clean.violations}


@pytest.mark.parametrize(
    ("scenario", "mutant", "faults"),
    [("abort_during_put", "cleanup_on_scheduler_thread", 0), ("failed_put", "storage_error_not_rolled_back", 1)],
)
def test_a_find_without_added_faults_is_shrunk_in_its_schedule_only(
    tmp_path: Path, scenario: str, mutant: str, faults: int
) -> None:
    """No fault at all, or only the scenario's own (what it is about): no run with a fixed plan."""
    seed = _find(tmp_path, "random", scenario=scenario, mutant=mutant, shrink_finds=False)["seed"]
    scn, m = get_scenario(scenario), get_mutant(mutant)
    assert m is not None
    plans: list[list[Fault] | None] = []

    async def schedule(strategy: DfsStrategy, plan: list[Fault] | None, left_out: frozenset[str]) -> RunResult:
        plans.append(plan)
        return await run_once_async(scn, "memory", strategy, seed, mutant, None, plan, left_out=left_out)

    with applied(m):
        found = run_once(scn, store="memory", strategy=RandomStrategy(seed), seed=seed, mutant=mutant)
        shrunk = trio.run(shrink, found, schedule, lambda res: any(v.invariant in m.expect for v in res.violations))
    assert plans and all(plan is None for plan in plans)
    assert shrunk.run.fault_plan is None and (shrunk.faults_before, shrunk.faults) == (faults, faults)


def test_a_malformed_fault_plan_is_a_usage_error(tmp_path: Path) -> None:
    entry = _find(tmp_path, "random", **NEEDS_A_FAULT)
    artifact = json.loads(Path(entry["artifact"]).read_text())
    artifact["fault_plan"][0]["nth"] = 0
    Path(entry["artifact"]).write_text(json.dumps(artifact))
    with pytest.raises(UsageError, match="nth must be a hit number"):
        replay(entry["artifact"])


def test_a_find_is_shrunk_to_fewer_requests_and_replays_without_them(tmp_path: Path) -> None:
    """The resampled client alone shows the trim-after-resampling bug: the other two requests of
    the scenario are left out of the saved run, and its replay leaves them out too."""
    entry = _find(tmp_path, "pct", scenario="pipeline_word_timestamps", mutant="trim_after_resampling", budget=20)
    shrunk = entry["shrunk"]
    assert (shrunk["clients_before"], shrunk["clients"]) == (3, 1)
    artifact = json.loads(Path(entry["artifact"]).read_text())
    assert artifact["left_out"] == ["plain", "timed"]
    again = replay(entry["artifact"])
    assert again.reproduced and again.run.left_out == ["plain", "timed"]
    assert {v.invariant for v in again.run.violations} == {"samples-exactly-once"}
    # Left out, a client submits nothing: no event of the run names its request.
    assert not any('"timed"' in line or '"plain"' in line for line in again.run.trace_lines)


def test_a_malformed_left_out_is_a_usage_error(tmp_path: Path) -> None:
    entry = _find(tmp_path, "random")
    artifact = json.loads(Path(entry["artifact"]).read_text())
    artifact["left_out"] = "plain"
    Path(entry["artifact"]).write_text(json.dumps(artifact))
    with pytest.raises(UsageError, match="'left_out' must be a list of client names"):
        replay(entry["artifact"])


def test_a_smaller_world_that_fails_for_another_reason_is_not_the_find_made_smaller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shrink keeps a candidate only if it fails as the find did: an invariant the find failed,
    and no slip of the scenario's own code that the find did not show. Here leaving out the
    second client makes the scenario's code crash (and the find's invariant still fails): that
    world is another failure, so the shrink leaves out the first client only."""
    from scenarios.pipeline import SHORT, Client, pipeline_scenario, together

    monkeypatch.setattr(registry, "SCENARIOS", dict(registry.SCENARIOS))  # (registered for this test only)

    @pipeline_scenario("shrink_trap", summary="fails always; its own code slips without its second client", issue="-")
    async def shrink_trap(world: World) -> None:
        first, second = Client(world, "first", SHORT, "A"), Client(world, "second", SHORT, "B")
        await together(("A", first.run), ("B", second.run))
        world.probe("health-counts-true", False, "what the find is about")
        assert not second.left_out, "the scenario's own slip"

    text_only = {"modalities": "text", "async_chunk": "on", "shutdown": "idle"}
    entry = explore("shrink_trap", budget=1, out_dir=str(tmp_path), params=text_only).violations[0]
    assert entry["shrunk"]["clients_before"] == 2 and entry["shrunk"]["clients"] == 1
    assert json.loads(Path(entry["artifact"]).read_text())["left_out"] == ["first"]
    assert [v["invariant"] for v in entry["violations"]] == ["health-counts-true"]
