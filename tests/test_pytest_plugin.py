"""The pytest plugin, as a user meets it: a test file of their own, their own scenario, a failure
that names the artifact and the command that replays it — and the replay reproduces."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = """
from omnisim.registry import Patch, mutant, scenario
from runtime.transfer.adapter import ChunkTransferAdapter
from scenarios.edge import EdgeRequest, edge_world, serve


@scenario("usertest_roundtrip", summary="my own edge scenario", issue="mine", build=edge_world)
async def roundtrip(world):
    await serve(EdgeRequest(world, "P"), [2, 1])


@mutant("usertest_forgetful_receiver", summary="my own bug", issue="mine",
        scenarios=("usertest_roundtrip",), expect=("no-tombstones",))
def forgetful_receiver():
    async def cleanup_receiver(self, request_id):
        return None

    yield Patch(ChunkTransferAdapter, "cleanup_receiver", cleanup_receiver)


def test_my_scenario_holds(omnisim_explore):
    res = omnisim_explore("usertest_roundtrip", budget=20)
    assert res.schedules == 20


def test_a_builtin_scenario_holds_under_pct(omnisim_explore):
    omnisim_explore("abort_during_put", strategy="pct", budget=20)


def test_my_bug_is_caught(omnisim_explore):
    omnisim_explore("usertest_roundtrip", budget=20, mutant="usertest_forgetful_receiver")
"""


def test_a_user_test_file_explores_and_fails_with_a_replayable_artifact(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    artifacts = pytester.path / "artifacts"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--omnisim-artifacts", str(artifacts))
    result.assert_outcomes(passed=2, failed=1)
    output = result.stdout.str()
    assert "usertest_roundtrip [random, memory, mutant usertest_forgetful_receiver] broke an invariant" in output
    assert "no-tombstones:" in output
    replay = re.search(r"replay:\s+omnisim replay (\S+\.json)", output)
    assert replay is not None, output
    # The artifact names the test file as a plugin, so a fresh process replays the user's own
    # scenario and mutant: exit 1, the violation reproduces.
    proc = subprocess.run(
        [sys.executable, "-m", "omnisim.cli", "replay", replay.group(1)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "reproduced" in proc.stdout


def test_the_budget_option_overrides_every_call(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_budget="""
def test_budget(omnisim_explore):
    assert omnisim_explore("abort_during_put", budget=500).schedules == 7
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--omnisim-budget", "7")
    result.assert_outcomes(passed=1)


def test_a_mutant_that_breaks_what_it_does_not_declare_fails_as_broken(pytester: pytest.Pytester) -> None:
    """Breakage is never a pass (nor a detection): the test fails, and says which it is."""
    pytester.makepyfile(
        test_broken=USER_TESTS.split("def test_my_scenario_holds")[0].replace(
            'expect=("no-tombstones",)', 'expect=("aligner-complete",)'
        )
        + """
def test_my_bug_is_caught(omnisim_explore):
    omnisim_explore("usertest_roundtrip", budget=5, mutant="usertest_forgetful_receiver")
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "is broken, not detected" in result.stdout.str()


def test_a_budget_of_no_schedules_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_zero="def test_zero(omnisim_explore):\n    omnisim_explore('abort_during_put')\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--omnisim-budget", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--omnisim-budget must be a whole number of schedules >= 1" in result.stderr.str()


def test_hypothesis_strategies_for_schedules_and_faults_work_with_given() -> None:
    """A user's property test: any schedule, with up to two storage faults, keeps the edge clean;
    and the same strategies find a re-created bug."""
    from hypothesis import HealthCheck, given, settings

    from omnisim import registry
    from omnisim.explore import run_schedule
    from omnisim.strategies.hypothesis import fault_specs, schedules

    registry.load()
    checks = settings(
        max_examples=200, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )

    @checks
    @given(schedules(), fault_specs(("put_fail", "put_raise_after_create")))
    def edge_holds(choices: list[int], faults: list[str]) -> None:
        assert run_schedule("abort_during_put", choices, faults=faults).violations == []

    edge_holds()

    @checks
    @given(schedules())
    def bug_hides(choices: list[int]) -> None:
        assert run_schedule("abort_during_put", choices, mutant="cleanup_on_scheduler_thread").violations == []

    with pytest.raises(AssertionError):
        bug_hides()


MISTAKES = """
from omnisim.registry import Patch, mutant, scenario
from omnisim.explore import run_schedule
from runtime.sched.ar import ARScheduler
from scenarios.edge import EdgeRequest, edge_world, serve


@scenario("usertest_probe", summary="a probe of my own", issue="mine", build=edge_world)
async def probe(world):
    await serve(EdgeRequest(world, "P"), [2, 1])
    world.probe("my-audio-matches", False, "the audio differs")


@scenario("usertest_undeclared_probe", summary="a probe of an invariant I do not run", issue="mine",
          build=edge_world, invariants=("no-crash",))
async def undeclared(world):
    await serve(EdgeRequest(world, "P"), [2, 1])
    world.probe("no-orphan-shm", False, "my own look found a segment")


@mutant("usertest_inherited", summary="a patch of an inherited method", issue="mine",
        scenarios=("abort_during_put",), expect=("no-tombstones",))
def inherited():
    yield Patch(ARScheduler, "request_abort", lambda self, request_id: None)


def test_an_unknown_probe_is_a_usage_error(omnisim_explore):
    omnisim_explore("usertest_probe", budget=1)


def test_a_probe_fails_the_run_even_if_its_checker_does_not_run(omnisim_explore):
    omnisim_explore("usertest_undeclared_probe", budget=1)


def test_a_patch_of_an_inherited_method_is_undone(omnisim_explore):
    omnisim_explore("abort_during_put", budget=2, mutant="usertest_inherited")
    assert "request_abort" not in vars(ARScheduler)


def test_run_schedule_needs_no_explore_before_it():
    assert run_schedule("abort_during_put", []).violations == []
"""


def test_a_users_mistakes_are_said_clearly(pytester: pytest.Pytester) -> None:
    """Found by a review that wrote a test suite of its own: a probe of an invariant that does not
    exist passed silently, a probe of one the scenario does not run was dropped, a patch of an
    inherited method raised a KeyError, and ``run_schedule`` knew no scenario unless an explore
    had run first."""
    pytester.makepyfile(test_mistakes=MISTAKES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    output = result.stdout.str()
    assert "no invariant is named 'my-audio-matches'" in output
    assert "no-orphan-shm: my own look found a segment" in output


def test_a_user_scenario_that_takes_a_builtin_name_fails_where_it_is_registered(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_taken="""
from omnisim.registry import scenario
from scenarios.edge import edge_world

@scenario("similar_ids", summary="mine", issue="mine", build=edge_world)
async def mine(world):
    pass
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    output = result.stdout.str()
    assert "scenario 'similar_ids' is registered twice (first in " in output and "race_8082.py" in output
    assert "test_taken.py" in output
