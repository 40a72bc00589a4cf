"""``omnisim mutate``: the operators make the slips they name, ids are stable, and a campaign
kills what the scenarios guard and lists what they do not."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import left_behind, shm_names

from omnisim import mutation, registry
from omnisim.mutation.campaign import (
    Baseline,
    Plan,
    SourceChanged,
    load_equivalents,
    run_mutants,
    run_plan,
    source_stamp,
    strategies,
    time_allowed,
)
from omnisim.mutation.operators import OPERATORS, find_mutations

REPO = Path(__file__).resolve().parent.parent
GUARDED = ["runtime/connectors", "runtime/transfer"]

DEMO = '''\
"""A module with one site for every operator."""

LIMIT = 3


class Demo:
    size: int = 4

    def __repr__(self) -> str:
        return "never mutated"

    async def step(self, a, b):
        """Not mutated either."""
        log.debug("an observation")
        k.note("trace.point", a=a)
        local = a
        self.count += 1
        if a < b and not self.closed:
            self.remove(a, b)
        async with self._lock:
            return local == 0o600
'''


def _demo(tmp_path: Path, text: str = DEMO) -> list[mutation.Mutation]:
    path = tmp_path / "runtime" / "demo.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return find_mutations(path, tmp_path)


def test_each_operator_makes_the_slip_it_names(tmp_path: Path) -> None:
    made = {(m.operator, " ".join(m.original.split()), m.replacement) for m in _demo(tmp_path)}
    assert made == {
        ("delete-statement", "self.count += 1", "pass"),
        ("delete-statement", "self.remove(a, b)", "pass"),
        ("constant", "1", "2"),
        ("constant", "0o600", "0o601"),
        ("constant", "4", "5"),  # a class attribute's default
        ("negate-compare", "a < b", "a >= b"),
        ("boundary", "a < b", "a <= b"),
        ("negate-compare", "local == 0o600", "local != 0o600"),
        ("drop-not", "not self.closed", "(self.closed)"),
        ("and-or", "a < b and not self.closed", "(a < b) or (not self.closed)"),
        ("swap-args", "a, b", "b, a"),
        ("remove-lock", "async with self._lock", "if True"),
    }
    assert {op for op, _, _ in made} == set(OPERATORS)


def test_every_mutant_of_the_guarded_packages_compiles_and_has_its_own_id() -> None:
    found = mutation.find(GUARDED)
    assert len(found) > 500
    assert len({m.id for m in found}) == len(found)
    for m in found:
        compile(m.apply(Path(m.path).read_bytes()), m.path, "exec")
    assert {m.operator for m in found} == set(OPERATORS)


def test_an_id_names_the_same_slip_when_other_lines_move(tmp_path: Path) -> None:
    before = {m.id: m.describe() for m in _demo(tmp_path)}
    after = {m.id: m.describe() for m in _demo(tmp_path, "import os\n\n\n" + DEMO)}
    assert before == after


def test_a_survivor_prints_as_a_one_hunk_diff(tmp_path: Path) -> None:
    m = next(m for m in _demo(tmp_path) if m.operator == "remove-lock")
    diff = m.diff()
    assert diff.count("@@ ") == 1
    assert "-        async with self._lock:\n+        if True:\n" in diff


def test_every_reviewed_equivalent_still_exists() -> None:
    """A review of a survivor holds for that exact slip: once the code moves on, it is stale."""
    reviewed = [
        *GUARDED,
        "runtime/processors",
        "runtime/orchestrator.py",
        "runtime/stages.py",
        "runtime/client.py",
        "runtime/supervisor.py",
    ]
    ids = {m.id for m in mutation.find(reviewed)}
    stale = sorted(set(load_equivalents()) - ids)
    assert not stale, f"equivalents.toml names mutants that no longer exist: {stale}"


def _omnisim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omnisim.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_a_campaign_kills_what_the_scenarios_guard_and_lists_what_they_do_not(tmp_path: Path) -> None:
    # A release that never reclaims the released generation's keys.
    killed = _one("runtime/transfer/sender.py", "ChunkSender._run_release_task", "cleanup_prefix")
    # Key validation: no scenario feeds the runtime a bad key, so nothing can notice its loss.
    survivor = _one("runtime/connectors/keys.py", "validate_key", "raise")
    before = shm_names()
    proc = _omnisim(
        "mutate",
        "runtime/transfer/sender.py",
        "runtime/connectors/keys.py",
        "--id",
        killed.id,
        "--id",
        survivor.id,
        "--scenario",
        "abort_during_put",
        "--out",
        str(tmp_path),
    )
    assert proc.returncode == 1, proc.stderr  # a survivor is a blind spot
    # Where no bar moves (stdout is a pipe here, as in a CI log), a line per mutant as it ends.
    lines = proc.stdout.splitlines()
    ended = re.compile(rf"\[[12]/2\] killed {killed.id} runtime\.transfer\.sender:\d+ ")
    assert any(ended.match(line) for line in lines), lines
    assert any(line.startswith(f"survived {survivor.id} runtime.connectors.keys:") for line in lines), lines
    report = json.loads((tmp_path / "mutation.json").read_text())
    outcomes = {o["id"]: o for o in report["outcomes"]}
    assert outcomes[killed.id]["outcome"] == "killed", outcomes[killed.id]
    assert outcomes[killed.id]["plan"].startswith("abort_during_put/")
    assert outcomes[killed.id]["detail"]  # the invariants that fired
    assert outcomes[survivor.id]["outcome"] == "survived"
    assert (tmp_path / "survivors.diff").read_text().count(f"mutant {survivor.id}") == 1
    assert not left_behind(before)


def _one(path: str, where: str, deleted: str) -> mutation.Mutation:
    """The deletion of the first statement of ``where`` that mentions ``deleted``."""
    return next(m for m in mutation.find([path], ["delete-statement"]) if m.where == where and deleted in m.original)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["omnisim/cli.py"], "not part of the runtime"),
        (["runtime/nowhere"], "no such file"),
        (["runtime/connectors/keys.py", "--operator", "flip"], "unknown operator"),
        (["runtime/connectors/keys.py", "--id", "00000000"], "no mutant"),
    ],
)
def test_a_bad_target_is_a_usage_error(args: list[str], message: str) -> None:
    proc = _omnisim("mutate", *args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_a_campaign_stops_when_the_code_changes_under_it() -> None:
    # A mutant is a span of the file as it was: spliced into edited code it is another slip, or no
    # Python at all, and its "crash" would count as a detection.
    stamp = source_stamp()
    assert any(path.endswith("runtime/connectors/shm.py") for path in stamp)
    edited = dict(stamp)
    path = next(iter(edited))
    size, mtime = edited[path]
    edited[path] = (size + 1, mtime)
    m = _one("runtime/transfer/sender.py", "ChunkSender._run_release_task", "cleanup_prefix")
    with pytest.raises(SourceChanged, match="changed while the campaign ran"):
        run_mutants(
            [m], Baseline(), budget=1, seed=0, jobs=1, time_limit=10, plugins=[], on_outcome=print, stamp=edited
        )


def test_a_mutant_that_runs_many_plans_is_not_called_a_hang() -> None:
    # A survivor runs every plan that covers its line: with one limit for every mutant, a survivor
    # of 200 plans ran past it, counted as a timeout, and so as detected.
    plans = [Plan(f"scenario_{i}", "memory") for i in range(200)]
    baseline = Baseline(seconds={p: 1.5 for p in plans})
    assert time_allowed(plans, baseline, 120.0) > sum(baseline.seconds.values()) + 120.0
    assert time_allowed(plans[:1], baseline, 120.0) == pytest.approx(123.0)
    assert time_allowed([], baseline, 120.0) == 120.0


def test_a_plan_runs_every_configuration_and_the_declared_orderings() -> None:
    """A budget smaller than a scenario's configurations still runs each of them once per
    strategy; a scenario that declares orderings also runs schedules that follow them."""
    registry.load()
    configurations = len(registry.get_scenario("corrupt_chunk").configurations())
    failed, ran = run_plan(Plan("corrupt_chunk", "memory"), budget=2, seed=0)
    assert failed == [] and ran == 2 * configurations
    assert [s for s, _ in strategies(12)] == ["random", "pct"]
    assert strategies(12, ordered=True) == [("random", 12), ("pct", 6), ("ordered", 6)]
    assert registry.get_scenario("stale_receiver_entry").constraints
    _, ran = run_plan(Plan("stale_receiver_entry", "memory"), budget=2, seed=0)
    assert ran == 2 + 1 + 1
