"""Faults the scenarios do not script: ``--faults sampled`` (BUGGIFY), and the two bugs it found
in the adapter's failure paths, kept fixed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import trio

from omnisim import registry
from omnisim.cli import main
from omnisim.explore import explore

registry.load()
logging.getLogger("runtime").setLevel(logging.CRITICAL)


@pytest.mark.parametrize(
    ("scenario", "fault", "never"),
    [
        # The terminal's put raised after creating its segment: nothing retired the generation
        # (a tombstone) and nothing reclaimed that segment or its lock file.
        ("abort_during_put", "put_raise_after_create@key=R_1_2", {"no-tombstones", "no-orphan-shm", "no-orphan-lock"}),
        # The terminal's put failed: the generation stayed registered for good.
        ("abort_during_put", "put_fail@key=R_1_2", {"no-tombstones"}),
        # A reusing generation's first put failed before creating anything: its reclaim then
        # removed the previous generation's chunk under the same key.
        ("id_reuse_after_cancel", "put_fail@key=R_1_0#2", {"exact-key-ownership"}),
    ],
)
def test_a_failed_put_leaves_no_state_and_reclaims_only_its_own_keys(
    scenario: str, fault: str, never: set[str]
) -> None:
    for strategy in ("random", "pct"):
        res = explore(scenario, strategy=strategy, budget=300, faults=[fault], stop_on_violation=False)
        assert not set(res.invariants()) & never, (strategy, res.violations[:1])


def test_sampled_faults_are_drawn_from_the_seed_and_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A sampled stall stops a reader for good holding a key's lock, in a process nothing
    # supervises: its requests hang (liveness) — a find to replay. (The faults the runtime
    # handles fail only the requests they hit, which the invariants allow: see check's plans.)
    args = ["explore", "similar_ids", "--faults", "sampled:stall", "--budget", "50", "--out", str(tmp_path), "--json"]
    assert main(args) == 1
    found = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    artifact = found["violations"][0]["artifact"]
    assert json.loads(Path(artifact).read_text())["faults"] == ["sampled:stall"]
    assert main(["replay", artifact]) == 1  # the same faults fire again: it reproduces


def test_sampled_faults_keep_the_race_scenarios_clean() -> None:
    storage = "sampled:put_fail,store_full,enospc_inodes,foreign_name,put_raise_after_create"
    for scenario in ("abort_during_put", "deserialize_failure", "id_reuse_after_cancel"):
        res = explore(scenario, budget=200, faults=[storage])
        assert res.violations == [], (scenario, res.violations[:1])


@pytest.mark.parametrize("spec", ["sometimes", "sampled:meteor"])
def test_a_bad_sampled_spec_is_a_usage_error(spec: str) -> None:
    assert main(["explore", "abort_during_put", "--faults", spec, "--budget", "1"]) == 2


@pytest.mark.parametrize("scenario", ["writer_crash", "stage_crash"])
def test_a_fault_from_the_command_line_fires_in_a_scenario_that_injects_its_own(scenario: str) -> None:
    """A scenario whose faults depend on its configuration injects them as the world is built;
    that replaced the whole plan, so a ``--fault`` given to it never fired."""
    from omnisim.explore import run

    res = run(scenario, faults=["put_fail"])
    fired = [line for line in res.trace_lines if '"ev":"fault"' in line]
    assert any('"kind":"put_fail"' in line for line in fired), fired


# == faults in a production run ===================================================================


def test_a_soak_with_injected_faults_fails_only_the_struck_requests_and_leaves_nothing() -> None:
    """The real engine (real kernel, /dev/shm, torch) meets the storage and decode failures the
    simulator injects: each request a fault struck fails with one terminal, every other one
    finishes with its solo run's audio, and nothing is left."""
    from omnisim.soak import clean, soak

    faults = ["sampled:put_fail,decode_fail,foreign_name"]
    report = soak(12, 4, processes=False, kill_every=None, seed=1, faults=faults, fault_probability=0.05)
    assert report.faults_fired > 0
    assert report.outcomes["failed: an injected fault"] > 0 and report.outcomes["finished"] > 0
    assert clean(report), report.as_dict()


def test_a_fault_spec_fires_on_the_hit_it_names() -> None:
    from omnisim.faults import FaultingKernel, FaultPlan, faults_of_specs
    from runtime.connectors.stores import StoreFull

    kernel = FaultingKernel(FaultPlan(faults_of_specs(["store_full@key=R_0_1#2"], 0)))

    async def puts() -> list[str]:
        seen = []
        for key in ("R_0_0", "R_0_1", "R_0_1", "R_0_1"):
            try:
                await kernel.point("shm.put.locked", key=key)
                seen.append("ok")
            except StoreFull as e:
                assert e.injected_fault == "store_full"  # type: ignore[attr-defined]
                seen.append("full")
        return seen

    assert trio.run(puts) == ["ok", "ok", "full", "ok"]
    assert [(kind, key) for kind, key, _ in kernel.fired] == [("store_full", "R_0_1")]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--fault", "crash_writer"], "acted out by the simulator's world"),
        (["--faults", "sampled:put_fail,stall"], "stall is acted out"),
        (["--fault", "meteor"], "unknown fault kind"),
        (["--fault", "put_fail", "--processes"], "not with --processes"),
        (["--faults", "sampled", "--fault-probability", "2"], "a probability is 0..1"),
    ],
)
def test_a_soak_refuses_faults_it_cannot_inject(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["soak", "--requests", "1", *argv]) == 2
    assert says in capsys.readouterr().err


def test_several_sampled_specs_draw_once_over_all_their_kinds() -> None:
    """``--faults sampled --faults sampled:put_fail`` is one BUGGIFY plan over the union of the
    kinds, not two plans that each fire the same kinds (found by an outside audit of the CLI)."""
    from omnisim.faults import SAMPLED_KINDS, faults_of_specs

    def drawn(specs: list[str]) -> list[tuple[str, str]]:
        return [(f.kind, repr(f)) for f in faults_of_specs(specs, seed=3)]

    assert "put_fail" in SAMPLED_KINDS
    assert drawn(["sampled", "sampled:put_fail"]) == drawn(["sampled"])
    assert drawn(["sampled:put_fail", "sampled:decode_fail"]) == drawn(["sampled:put_fail,decode_fail"])
    assert drawn(["sampled:put_fail", "sampled:put_fail"]) == drawn(["sampled:put_fail"])
