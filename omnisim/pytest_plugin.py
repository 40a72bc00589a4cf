"""omnisim in a user's test suite: a pytest plugin (entry point ``pytest11``, loaded by pytest
whenever omnisim is installed).

A test explores a scenario — a built-in one, or its own, registered with the decorators — and
fails on the first violation, with the invariants' messages, the artifact that was saved and
the command that replays it::

    from omnisim.registry import scenario

    @scenario("my_edge", summary="...", issue="mine", build=edge_world)
    async def my_edge(world): ...

    def test_my_edge_holds(omnisim_explore):
        omnisim_explore("my_edge", strategy="pct", budget=300)

``--omnisim-budget N`` overrides every budget (a nightly job runs longer than a pull request);
``--omnisim-artifacts DIR`` keeps the artifacts there (default: the test's ``tmp_path``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # the engine (and torch) load only when a test explores
    from omnisim.explore import ExploreResult
    from omnisim.registry import Params


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("omnisim", "omnisim: explore scenarios from tests")
    group.addoption(
        "--omnisim-budget", type=_budget, default=None, help="schedules for every omnisim_explore call (at least 1)"
    )
    group.addoption("--omnisim-artifacts", default=None, help="where failing schedules are saved (default: tmp_path)")


def pytest_configure(config: pytest.Config) -> None:
    artifacts = config.getoption("--omnisim-artifacts")
    if artifacts is not None and os.path.exists(artifacts) and not os.path.isdir(artifacts):
        raise pytest.UsageError(f"--omnisim-artifacts {artifacts!r} is not a folder")


def _budget(text: str) -> int:
    """A budget from the command line: a whole number of schedules, at least one."""
    try:
        budget = int(text)
    except ValueError:
        budget = 0
    if budget < 1:
        raise argparse.ArgumentTypeError(f"--omnisim-budget must be a whole number of schedules >= 1, got {text!r}")
    return budget


class Explorer:
    """``omnisim_explore(scenario, ...)``: explore, and fail the test on a violation."""

    def __init__(self, out_dir: str, budget: int | None) -> None:
        self.out_dir = out_dir
        self.budget = budget

    def __call__(
        self,
        scenario: str,
        *,
        budget: int = 200,
        strategy: str = "random",
        store: str = "memory",
        seed: int = 0,
        mutant: str | None = None,
        params: Params | None = None,
        time_limit: float | None = None,
    ) -> ExploreResult:
        from omnisim import registry
        from omnisim.explore import explore

        registry.load()
        res = explore(
            scenario,
            strategy=strategy,
            budget=self.budget if self.budget is not None else budget,
            time_limit=time_limit,
            seed=seed,
            store=store,
            mutant=mutant,
            params=params,
            out_dir=self.out_dir,
            plugins=_defining_files(scenario, mutant),
        )
        if res.violations:  # a find, or (a mutant's undeclared invariant) breakage: either fails
            pytest.fail(_failure(res), pytrace=False)
        return res


@pytest.fixture
def omnisim_explore(request: pytest.FixtureRequest, tmp_path: Any) -> Explorer:
    """Explore a scenario under a budget; the test fails with the artifact and its replay command."""
    given = request.config.getoption("--omnisim-artifacts")
    # (absolute now: a test may change the working folder before it finds something)
    started_in = str(request.config.invocation_params.dir)
    out_dir = os.path.join(started_in, given) if given else str(tmp_path / "omnisim-artifacts")
    return Explorer(out_dir, request.config.getoption("--omnisim-budget"))


def _defining_files(scenario: str, mutant: str | None) -> list[str]:
    """The files that registered ``scenario`` and ``mutant`` outside omnisim: a replay must load
    them again (the artifact records them as plugins)."""
    from omnisim import registry

    functions = [registry.get_scenario(scenario).body]
    found = registry.get_mutant(mutant)
    if found is not None:
        functions.append(found.patches)
    files = []
    for fn in functions:
        module = sys.modules.get(fn.__module__)
        path = getattr(module, "__file__", None)
        if path and not registry.is_builtin(fn) and path not in files:
            files.append(os.path.abspath(path))
    return files


def _failure(res: ExploreResult) -> str:
    entry = next((e for e in res.violations if res.counts_entry(e)), res.violations[0])
    where = f"omnisim: {res.scenario} [{res.strategy}, {res.store}" + (f", mutant {res.mutant}" if res.mutant else "")
    if res.counts_entry(entry):
        lines = [f"{where}] broke an invariant after {res.first_violation_after} schedule(s), seed {entry['seed']}:"]
    elif entry.get("clean_too"):
        lines = [
            f"{where}] is broken, not detected: seed {entry['seed']} breaks {', '.join(entry['clean_too'])} on the "
            "runtime without the mutant as well (the scenario's failure, not the mutant's):"
        ]
    else:
        declared = ", ".join(sorted(res.wanted or ()))
        lines = [
            f"{where}] is broken, not detected: seed {entry['seed']} broke invariants its mutant does not "
            f"declare (it declares {declared}):"
        ]
    lines += [f"  {v['invariant']}: {v['message']}" for v in entry["violations"]]
    artifact = entry.get("artifact")  # (none for a hypothesis search's breakage)
    if artifact:
        lines += [f"artifact: {artifact}", f"replay:   omnisim replay {shlex.quote(artifact)}"]
    return "\n".join(lines)
