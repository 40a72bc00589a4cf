"""Running schedules: one run, an exploration of many, artifacts and their replay."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import trio

from invariants import Violation, check
from omnisim.registry import Scenario, applied, get_mutant, get_scenario
from omnisim.sim_kernel import SimKernel
from omnisim.strategies.base import Strategy
from omnisim.strategies.hypothesis import SCHEDULES, HypothesisStrategy
from omnisim.strategies.ordered import OrderedStrategy
from omnisim.strategies.pct import DEFAULT_MAX_STEPS, PctStrategy
from omnisim.strategies.random import RandomStrategy
from omnisim.strategies.replay import ReplayStrategy
from omnisim.world import STORES, UsageError
from runtime.kernel import use_kernel

STRATEGIES = ("random", "pct", "ordered", "hypothesis")
ARTIFACT_VERSION = 1


def trace_digest(lines: list[str]) -> str:
    return hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()


@dataclass
class RunResult:
    scenario: str
    store: str
    strategy: dict[str, Any]
    seed: int
    mutant: str | None
    violations: list[Violation]
    trace_lines: list[str]
    trace_digest: str
    choices: list[int]
    events: list[tuple[str, str]]
    steps: int
    stop_reason: str | None
    unsatisfied: list[str]
    virtual_time_s: float

    def summary(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "store": self.store,
            "seed": self.seed,
            "strategy": self.strategy["strategy"],
            "mutant": self.mutant,
            "violations": [v.as_dict() for v in self.violations],
            "trace_digest": self.trace_digest,
            "points": len(self.trace_lines),
            "steps": self.steps,
            "stop_reason": self.stop_reason,
            "unsatisfied": self.unsatisfied,
            "virtual_time_s": self.virtual_time_s,
        }


def make_strategy(
    name: str, seed: int, scn: Scenario, constraints: list[str] | None = None, *, decisions_hint: int | None = None
) -> Strategy:
    """The strategy ``name`` for one run. ``decisions_hint``: how many choices a run of this
    scenario made before (pct draws its change points among that many)."""
    if name in ("random", "pct", "hypothesis") and constraints:
        raise UsageError("an ordering (--order) needs the ordered strategy (--strategy ordered)")
    if name == "random":
        return RandomStrategy(seed)
    if name == "pct":
        return PctStrategy(seed, max_steps=decisions_hint or DEFAULT_MAX_STEPS)
    if name == "hypothesis":
        raise UsageError("the hypothesis strategy draws its choices inside a search: use explore, not run")
    if name == "ordered":
        chosen = list(constraints) if constraints else list(scn.constraints)
        if not chosen:
            raise UsageError(f"scenario {scn.name!r} declares no ordering constraints; pass --order")
        return OrderedStrategy(seed, chosen)
    raise UsageError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")


def run_once(scn: Scenario, *, store: str, strategy: Strategy, seed: int, mutant: str | None = None) -> RunResult:
    """Run one schedule of ``scn`` and check its invariants. The mutant must already be applied."""
    return trio.run(run_once_async, scn, store, strategy, seed, mutant)


async def run_once_async(
    scn: Scenario, store: str, strategy: Strategy, seed: int, mutant: str | None = None
) -> RunResult:
    """:func:`run_once` inside a running trio loop (used to run many schedules in one loop)."""
    if store not in STORES:
        raise UsageError(f"unknown store {store!r}; choose one of: {', '.join(STORES)}")
    kernel = SimKernel(strategy, faults=scn.faults(seed), horizon_s=scn.horizon_s)
    with use_kernel(kernel):
        world = scn.build(store)
    try:
        outcome = await kernel.run_async(lambda: world.run(scn.body))
        # A run the ordering cut short proves nothing about the runtime: it is reported as
        # unsatisfied instead of being checked.
        violations = [] if outcome.stop_reason == "unsatisfiable" else check(world.observed(outcome), scn.invariants)
    finally:
        world.sweep()
    lines = outcome.trace_lines()
    return RunResult(
        scenario=scn.name,
        store=store,
        strategy=strategy.describe(),
        seed=seed,
        mutant=mutant,
        violations=violations,
        trace_lines=lines,
        trace_digest=trace_digest(lines),
        choices=outcome.choices,
        events=[(e.task, e.name) for e in outcome.trace],
        steps=outcome.steps,
        stop_reason=outcome.stop_reason,
        unsatisfied=outcome.unsatisfied,
        virtual_time_s=outcome.virtual_time_s,
    )


def run(
    scenario: str,
    *,
    seed: int = 0,
    strategy: str = "random",
    store: str = "memory",
    mutant: str | None = None,
    constraints: list[str] | None = None,
) -> RunResult:
    scn = get_scenario(scenario)
    m = get_mutant(mutant)
    with applied(m):
        return run_once(
            scn, store=store, strategy=make_strategy(strategy, seed, scn, constraints), seed=seed, mutant=mutant
        )


@dataclass
class ExploreResult:
    scenario: str
    strategy: str
    store: str
    mutant: str | None
    schedules: int
    seconds: float
    violations: list[dict[str, Any]] = field(default_factory=list)
    first_violation_after: int | None = None
    unsatisfied_runs: int = 0
    artifact: str | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "strategy": self.strategy,
            "store": self.store,
            "mutant": self.mutant,
            "schedules": self.schedules,
            "seconds": round(self.seconds, 3),
            "schedules_per_s": round(self.schedules / self.seconds, 1) if self.seconds else None,
            "violations": self.violations,
            "first_violation_after": self.first_violation_after,
            "unsatisfied_runs": self.unsatisfied_runs,
            "artifact": self.artifact,
        }


def explore(
    scenario: str,
    *,
    strategy: str = "random",
    budget: int = 200,
    time_limit: float | None = None,
    seed: int = 0,
    store: str = "memory",
    mutant: str | None = None,
    out_dir: str | None = None,
    plugins: list[str] | None = None,
    stop_on_violation: bool = True,
    constraints: list[str] | None = None,
) -> ExploreResult:
    """Run up to ``budget`` schedules (seeds ``seed``, ``seed+1``, …); stop at the first violation
    and save it as an artifact in ``out_dir``."""
    scn = get_scenario(scenario)
    m = get_mutant(mutant)
    if strategy == "hypothesis":
        if constraints:
            raise UsageError("an ordering (--order) needs the ordered strategy (--strategy ordered)")
        with applied(m):
            return _explore_with_hypothesis(scn, budget, time_limit, seed, store, mutant, out_dir, plugins or [])
    result = ExploreResult(scenario, strategy, store, mutant, 0, 0.0)
    start = time.perf_counter()

    async def loop() -> None:
        # One trio loop for all schedules: trio's start-up would otherwise cost ~0.4 ms each.
        decisions: int | None = None
        for i in range(budget):
            if time_limit is not None and time.perf_counter() - start > time_limit:
                return
            run_seed = seed + i
            res = await run_once_async(
                scn,
                store,
                make_strategy(strategy, run_seed, scn, constraints, decisions_hint=decisions),
                run_seed,
                mutant,
            )
            decisions = len(res.choices) or decisions
            result.schedules += 1
            if res.unsatisfied:
                result.unsatisfied_runs += 1
            if res.violations:
                result.first_violation_after = result.first_violation_after or result.schedules
                entry: dict[str, Any] = {"seed": run_seed, "violations": [v.as_dict() for v in res.violations]}
                if out_dir is not None:
                    entry["artifact"] = save_artifact(res, out_dir, plugins or [])
                    result.artifact = result.artifact or entry["artifact"]
                result.violations.append(entry)
                if stop_on_violation:
                    return

    with applied(m):
        trio.run(loop)
    result.seconds = time.perf_counter() - start
    return result


def _explore_with_hypothesis(
    scn: Scenario,
    budget: int,
    time_limit: float | None,
    seed: int,
    store: str,
    mutant: str | None,
    out_dir: str | None,
    plugins: list[str],
) -> ExploreResult:
    """Let Hypothesis generate up to ``budget`` schedules (as choice sequences) and, on a
    violation, shrink the schedule; the reported and saved run is the shrunk one."""
    result = ExploreResult(scn.name, "hypothesis", store, mutant, 0, 0.0)
    failing: list[tuple[RunResult, list[int]]] = []
    start = time.perf_counter()

    @hypothesis.settings(
        max_examples=budget,
        database=None,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.generate, hypothesis.Phase.shrink],
    )
    @hypothesis.seed(seed)
    @hypothesis.given(SCHEDULES)
    def schedule_holds(choices: list[int]) -> None:
        if not failing and time_limit is not None and time.perf_counter() - start > time_limit:
            hypothesis.reject()
        res = run_once(scn, store=store, strategy=HypothesisStrategy(choices), seed=seed, mutant=mutant)
        result.schedules += 1
        if res.violations:
            result.first_violation_after = result.first_violation_after or result.schedules
            failing.append((res, choices))  # Hypothesis ends on the shrunk example
            raise ScheduleFailed

    try:
        schedule_holds()
    except ScheduleFailed:
        shrunk, steered = failing[-1]
        entry: dict[str, Any] = {
            "seed": seed,
            "violations": [v.as_dict() for v in shrunk.violations],
            # Decisions the drawn schedule steered away from the first runnable task.
            "steered_choices": sum(1 for c in steered if c),
            "steered_choices_before_shrinking": sum(1 for c in failing[0][1] if c),
        }
        if out_dir is not None:
            entry["artifact"] = result.artifact = save_artifact(shrunk, out_dir, plugins)
        result.violations.append(entry)
    result.seconds = time.perf_counter() - start
    return result


class ScheduleFailed(AssertionError):
    """A schedule broke an invariant (raised to Hypothesis, which then shrinks it)."""


def save_artifact(res: RunResult, out_dir: str, plugins: list[str]) -> str:
    """Write everything needed to replay ``res``; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    name = f"{res.scenario}-{res.mutant or 'clean'}-{res.store}-{res.strategy['strategy']}-seed{res.seed}"
    path = os.path.join(out_dir, name + ".json")
    with open(os.path.join(out_dir, name + ".trace.jsonl"), "w") as f:
        f.writelines(line + "\n" for line in res.trace_lines)
    artifact = {
        "version": ARTIFACT_VERSION,
        "scenario": res.scenario,
        "store": res.store,
        "seed": res.seed,
        "mutant": res.mutant,
        "plugins": [os.path.abspath(p) if os.path.exists(p) else p for p in plugins],
        "strategy": res.strategy,
        "choices": res.choices,
        "events": res.events,
        "trace_digest": res.trace_digest,
        "violations": [v.as_dict() for v in res.violations],
    }
    with open(path, "w") as f:
        json.dump(artifact, f, indent=1)
    return path


@dataclass
class ReplayResult:
    run: RunResult
    expected_digest: str
    diverged_at: int | None
    first_difference: str | None

    @property
    def reproduced(self) -> bool:
        return self.run.trace_digest == self.expected_digest


def load_artifact(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            artifact = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read artifact {path!r}: {e}") from e
    if not isinstance(artifact, dict) or artifact.get("version") != ARTIFACT_VERSION:
        raise UsageError(f"{path!r} is not an omnisim artifact of version {ARTIFACT_VERSION}")
    return artifact


def replay(path: str) -> ReplayResult:
    """Re-run an artifact: its exact choices first, its event order where the choices stop fitting."""
    from omnisim.registry import load

    artifact = load_artifact(path)
    load(artifact.get("plugins"))
    scn = get_scenario(artifact["scenario"])
    strategy = ReplayStrategy(artifact["choices"], [tuple(e) for e in artifact["events"]])
    with applied(get_mutant(artifact.get("mutant"))):
        res = run_once(
            scn, store=artifact["store"], strategy=strategy, seed=artifact["seed"], mutant=artifact.get("mutant")
        )
    res.strategy = {"strategy": "replay", "of": artifact["strategy"]}
    difference = None
    if res.trace_digest != artifact["trace_digest"]:
        difference = _first_difference(path, res.trace_lines)
    return ReplayResult(res, artifact["trace_digest"], strategy.diverged_at, difference)


def _first_difference(artifact_path: str, lines: list[str]) -> str:
    trace_path = artifact_path.removesuffix(".json") + ".trace.jsonl"
    try:
        with open(trace_path) as f:
            recorded = [line.rstrip("\n") for line in f]
    except OSError:
        return "the recorded trace is missing, so the first diverging event is unknown"
    for i, (a, b) in enumerate(zip(recorded, lines, strict=False)):
        if a != b:
            return f"event {i}: recorded {a} but replay gave {b}"
    return f"the traces agree for {min(len(recorded), len(lines))} events, then one is longer"
