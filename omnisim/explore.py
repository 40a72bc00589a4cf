"""Running schedules: one run, an exploration of many, artifacts and their replay."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import trio
from hypothesis.database import DirectoryBasedExampleDatabase

from invariants import CheckerFailed, UnknownInvariant, Violation, check
from omnisim.base import STORES, Misuse, UsageError, is_interrupt, stop_at_decisions, stop_requested
from omnisim.devshm import sweep_made_stores
from omnisim.faults import Fault, FaultPlan, UnknownFaultError, fixed_fault
from omnisim.registry import Params, Scenario, applied, get_mutant, get_scenario, lifted
from omnisim.shrink import Shrunk, shrink
from omnisim.sim_kernel import SimKernel
from omnisim.strategies.base import Strategy
from omnisim.strategies.dfs import Bound, DfsSearch, DfsStrategy
from omnisim.strategies.hypothesis import SCHEDULES, HypothesisStrategy
from omnisim.strategies.ordered import OrderedStrategy
from omnisim.strategies.pct import DEFAULT_MAX_STEPS, PctStrategy
from omnisim.strategies.random import RandomStrategy
from omnisim.strategies.replay import ReplayStrategy
from runtime.kernel import use_kernel

STRATEGIES = ("random", "pct", "ordered", "hypothesis", "dfs")
#: Strategies that search (they run inside explore, never as one run).
SEARCHES = ("hypothesis", "dfs")
ARTIFACT_VERSION = 1


def trace_digest(lines: list[str]) -> str:
    """The SHA-256 of the trace as a file holds it: every line ends with a newline."""
    return hashlib.sha256(("\n".join(lines) + "\n" if lines else "").encode()).hexdigest()


@dataclass
class RunResult:
    scenario: str
    store: str
    strategy: dict[str, Any]
    seed: int
    mutant: str | None
    params: dict[str, str]
    violations: list[Violation]
    trace_lines: list[str]
    trace_digest: str
    choices: list[int]
    events: list[tuple[str, str]]
    steps: int
    stop_reason: str | None
    unsatisfied: list[str]
    virtual_time_s: float
    #: Faults added from the command line (``--fault``).
    faults: list[str] = field(default_factory=list)
    #: The faults that replaced every other fault of the run (a shrunk find's); None: the
    #: scenario's own, the sampled and the command line's.
    fault_plan: list[Fault] | None = None
    #: The faults that fired, in order.
    fired: list[Fault] = field(default_factory=list)
    #: The clients the scenario made (each a request a shrinker may leave out), and those this
    #: run left out.
    clients: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "store": self.store,
            "seed": self.seed,
            "strategy": self.strategy["strategy"],
            "mutant": self.mutant,
            "params": self.params,
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
    scenario makes (pct draws its change points among that many; see :func:`pct_steps`)."""
    if name in ("random", "pct", "hypothesis", "dfs") and constraints:
        raise UsageError("an ordering (--order) needs the ordered strategy (--strategy ordered)")
    if name == "random":
        return RandomStrategy(seed)
    if name == "pct":
        return PctStrategy(seed, max_steps=decisions_hint or DEFAULT_MAX_STEPS)
    if name in SEARCHES:
        raise UsageError(f"the {name} strategy is a search across runs: use explore, not run")
    if name == "ordered":
        chosen = list(constraints) if constraints else list(scn.constraints)
        if not chosen:
            raise UsageError(f"scenario {scn.name!r} declares no ordering constraints; pass --order")
        return OrderedStrategy(seed, chosen)
    raise UsageError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")


def single_threaded() -> None:
    """A simulated run is one logical thread, so it must not start thread pools either: torch's
    intra-op pool would spin against every other process on the machine (a pipeline scenario ran
    several times slower next to one other torch process). Called before every simulated run;
    ``OMP_NUM_THREADS`` covers the processes a campaign starts."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def run_once(
    scn: Scenario,
    *,
    store: str,
    strategy: Strategy,
    seed: int,
    mutant: str | None = None,
    params: Params | None = None,
    fault_plan: list[Fault] | None = None,
    left_out: frozenset[str] = frozenset(),
) -> RunResult:
    """Run one schedule of ``scn`` and check its invariants. The mutant must already be applied.
    ``params``: the configuration (default: the one ``seed`` walks to). ``fault_plan``: the
    run's only faults, in place of the scenario's (its own, sampled or injected) and ``--fault``'s.
    ``left_out``: clients of the scenario this run leaves out (a shrunk find's)."""
    return trio.run(
        functools.partial(run_once_async, left_out=left_out), scn, store, strategy, seed, mutant, params, fault_plan
    )


async def run_once_async(
    scn: Scenario,
    store: str,
    strategy: Strategy,
    seed: int,
    mutant: str | None = None,
    params: Params | None = None,
    fault_plan: list[Fault] | None = None,
    *,
    left_out: frozenset[str] = frozenset(),
) -> RunResult:
    """:func:`run_once` inside a running trio loop (used to run many schedules in one loop)."""
    if store not in STORES:
        raise UsageError(f"unknown store {store!r}; choose one of: {', '.join(STORES)}")
    why = scn.unavailable(store)
    if why is not None:
        raise UsageError(f"scenario {scn.name!r} cannot run on the {store} store here: {why}")
    single_threaded()
    config = scn.params_for(seed, params)
    kernel = SimKernel(strategy, faults=scn.faults(seed), horizon_s=scn.horizon_s)
    try:
        with use_kernel(kernel):
            world = scn.make_world(store, config)
            world.seed = seed
            world.left_out = left_out
        if fault_plan is not None:
            # Set once the world is built: it replaces a plan the world injected as well.
            kernel.faults = FaultPlan.fixed(fault_plan)
        try:
            outcome = await kernel.run_async(lambda: world.run(scn.body))
        except BaseException as e:
            misuse = _misuse_in(e)
            if misuse is not None:
                raise UsageError(f"{scn.name}: {misuse}") from None
            raise
        # A run the ordering cut short proves nothing about the runtime: it is reported as
        # unsatisfied instead of being checked.
        try:
            checked = outcome.stop_reason != "unsatisfiable"
            violations = check(world.observed(outcome), scn.invariants) if checked else []
        except UnknownInvariant as e:
            raise UsageError(f"scenario {scn.name!r}: {e.args[0]}") from None
        except CheckerFailed as e:
            if e.builtin:
                raise
            raise UsageError(f"scenario {scn.name!r}: {e}") from e
    finally:
        sweep_made_stores()  # whatever the run made, even if it was stopped while building
    lines = outcome.trace_lines()
    return RunResult(
        scenario=scn.name,
        store=store,
        strategy=strategy.describe(),
        seed=seed,
        mutant=mutant,
        params=config,
        violations=violations,
        trace_lines=lines,
        trace_digest=trace_digest(lines),
        choices=outcome.choices,
        events=[(e.task, e.name) for e in outcome.trace],
        steps=outcome.steps,
        stop_reason=outcome.stop_reason,
        unsatisfied=outcome.unsatisfied,
        virtual_time_s=outcome.virtual_time_s,
        faults=list(scn.fault_specs),
        fault_plan=fault_plan,
        fired=kernel.faults.fired if kernel.faults is not None else [],
        clients=world.clients,
        left_out=sorted(left_out),
    )


#: The random schedules :func:`pct_steps` measures.
PCT_PROBES = 3


async def pct_steps(scn: Scenario, store: str, mutant: str | None, params: Params | None) -> int | None:
    """How many choices a run of ``scn`` makes, for pct to draw its change points among: the most
    of a few random schedules' (PCT's bound needs the longest run's count: a change point past
    the count is never drawn). Measured the same way by every run and exploration, so a pct
    find's seed is all that ``run --seed`` needs to repeat it."""
    steps = [
        len((await run_once_async(scn, store, RandomStrategy(seed), seed, mutant, params)).choices)
        for seed in range(PCT_PROBES)
    ]
    return max(steps) or None


def _misuse_in(error: BaseException) -> Misuse | None:
    """The :class:`Misuse` that stopped a run, alone or inside trio's exception groups."""
    if isinstance(error, Misuse):
        return error
    if isinstance(error, BaseExceptionGroup):
        return next((m for inner in error.exceptions if (m := _misuse_in(inner)) is not None), None)
    return None


def run(
    scenario: str,
    *,
    seed: int = 0,
    strategy: str = "random",
    store: str = "memory",
    mutant: str | None = None,
    constraints: list[str] | None = None,
    params: Params | None = None,
    faults: list[str] | None = None,
) -> RunResult:
    scn = get_scenario(scenario).with_faults(faults or [])
    m = get_mutant(mutant)
    with applied(m):
        steps = trio.run(pct_steps, scn, store, mutant, params) if strategy == "pct" else None
        return run_once(
            scn,
            store=store,
            strategy=make_strategy(strategy, seed, scn, constraints, decisions_hint=steps),
            seed=seed,
            mutant=mutant,
            params=params,
        )


def run_schedule(
    scenario: str,
    choices: list[int],
    *,
    seed: int = 0,
    store: str = "memory",
    mutant: str | None = None,
    params: Params | None = None,
    faults: list[str] | None = None,
) -> RunResult:
    """Run the schedule ``choices`` (as :mod:`omnisim.strategies.hypothesis` reads them) of one
    scenario: the body of a user's ``@given(schedules(), fault_specs())`` test."""
    scn = get_scenario(scenario).with_faults(faults or [])
    m = get_mutant(mutant)
    with applied(m):
        return run_once(scn, store=store, strategy=HypothesisStrategy(choices), seed=seed, mutant=mutant, params=params)


@dataclass
class ExploreResult:
    scenario: str
    strategy: str
    store: str
    mutant: str | None
    schedules: int
    seconds: float
    violations: list[dict[str, Any]] = field(default_factory=list)
    #: The first schedule with a violation that counts (see ``wanted``).
    first_violation_after: int | None = None
    unsatisfied_runs: int = 0
    artifact: str | None = None
    #: Schedules this exploration may run (its budget).
    budget: int = 0
    #: Stopped by Ctrl-C or SIGTERM: the schedule that was running is not counted.
    interrupted: bool = False
    #: The invariants a violation must include to count as a find, which ends the exploration:
    #: a mutant's declared ones (anything else it trips is breakage, recorded but not a find).
    #: None: any violation counts.
    wanted: tuple[str, ...] | None = None
    #: A search (``dfs``) ran every schedule within its bound: a proof, within that bound.
    exhausted: bool = False
    #: The digests of the different traces its schedules produced.
    traces: set[str] = field(default_factory=set)
    #: The faults asked for on top of the scenario's own (``--fault``, ``--faults``).
    faults: list[str] = field(default_factory=list)

    def counts(self, violations: list[Violation]) -> bool:
        """Whether a run with ``violations`` is a find."""
        return bool(violations) and (self.wanted is None or any(v.invariant in self.wanted for v in violations))

    def counts_entry(self, entry: dict[str, Any]) -> bool:
        """Whether a recorded entry of :attr:`violations` is a find (not one the runtime without
        the mutant makes as well: ``clean_too``)."""
        wanted = self.wanted is None or any(v["invariant"] in self.wanted for v in entry["violations"])
        return wanted and not entry.get("clean_too")

    def invariants(self) -> list[str]:
        """Every invariant that failed in some schedule, counted or not."""
        return sorted({v["invariant"] for entry in self.violations for v in entry["violations"]})

    @property
    def violation_count(self) -> int:
        return sum(len(entry["violations"]) for entry in self.violations)

    def summary(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "strategy": self.strategy,
            "store": self.store,
            "mutant": self.mutant,
            "faults": self.faults,
            "schedules": self.schedules,
            "seconds": round(self.seconds, 3),
            "schedules_per_s": round(self.schedules / self.seconds, 1) if self.seconds else None,
            "violations": self.violations,
            "first_violation_after": self.first_violation_after,
            "wanted": list(self.wanted) if self.wanted is not None else None,
            "exhausted": self.exhausted,
            "distinct_traces": len(self.traces),
            "unsatisfied_runs": self.unsatisfied_runs,
            "artifact": self.artifact,
            "interrupted": self.interrupted,
        }


#: Called after every schedule of an exploration (a progress display).
OnSchedule = Callable[[ExploreResult], None]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped an exploration; ``partial`` is what it ran before. The
    schedule that was running is abandoned: never checked, never saved as an artifact."""

    def __init__(self, partial: ExploreResult) -> None:
        super().__init__(f"interrupted after {partial.schedules} schedules")
        self.partial = partial


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
    params: Params | None = None,
    on_schedule: OnSchedule | None = None,
    faults: list[str] | None = None,
    determinism_every: int = 0,
    delays: int = 2,
    shrink_finds: bool = True,
    hypothesis_db: str | None = None,
    preemptions: int | None = None,
) -> ExploreResult:
    """Run up to ``budget`` schedules (seeds ``seed``, ``seed+1``, …); stop at the first violation
    and save it as an artifact in ``out_dir``. Ctrl-C raises :class:`Interrupted`.

    ``determinism_every=N`` runs every N-th schedule (the first included) a second time: two
    runs of one schedule that give different traces are a ``deterministic`` violation, which
    names the first diverging event (not for ``hypothesis``).

    ``dfs`` runs every schedule of seed ``seed``'s world that strays at most ``delays`` from
    the default schedule (with ``preemptions``: that makes at most that many choices the default
    would not make, whichever task each takes; see :class:`~omnisim.strategies.dfs.Bound`), depth
    first; :attr:`ExploreResult.exhausted` says it ran them all.

    A random, PCT or ordered find that is saved (``out_dir``) is shrunk first (``shrink_finds``, see
    :mod:`omnisim.shrink`): the artifact is the smallest failing schedule of the same world.

    ``hypothesis_db``: a folder for Hypothesis's example database. A failing schedule it saved
    (for this scenario, store, mutant, configuration, faults and seed) is tried first next time;
    without one, every exploration starts from nothing and runs the same for the same inputs."""
    if budget < 1:
        raise UsageError(f"the budget must be at least 1 schedule, got {budget}")
    scn = get_scenario(scenario).with_faults(faults or [])
    m = get_mutant(mutant)
    scn.configurations(params)  # an unknown parameter is a usage error before anything runs
    result = ExploreResult(
        scenario,
        strategy,
        store,
        mutant,
        0,
        0.0,
        budget=budget,
        wanted=m.expect if m else None,
        faults=list(faults or []),
    )
    start = time.perf_counter()
    with applied(m), _interruptible(result, start), stop_at_decisions():
        if strategy == "hypothesis":
            if constraints:
                raise UsageError("an ordering (--order) needs the ordered strategy (--strategy ordered)")
            _explore_with_hypothesis(
                result, scn, time_limit, seed, store, out_dir, plugins or [], params, on_schedule, hypothesis_db
            )
        else:
            _explore_schedules(
                result,
                scn,
                time_limit,
                seed,
                out_dir,
                plugins or [],
                constraints,
                params,
                on_schedule,
                stop_on_violation,
                determinism_every,
                Bound(preemptions, "preemptions") if preemptions is not None else Bound(delays),
                shrink_finds,
            )
    result.seconds = time.perf_counter() - start
    return result


@contextmanager
def _interruptible(result: ExploreResult, start: float) -> Iterator[None]:
    try:
        yield
    except BaseException as e:
        if not is_interrupt(e):
            raise
        result.interrupted = True
        result.seconds = time.perf_counter() - start
        raise Interrupted(result) from None


def _explore_schedules(
    result: ExploreResult,
    scn: Scenario,
    time_limit: float | None,
    seed: int,
    out_dir: str | None,
    plugins: list[str],
    constraints: list[str] | None,
    params: Params | None,
    on_schedule: OnSchedule | None,
    stop_on_violation: bool,
    determinism_every: int,
    bound: Bound,
    shrink_finds: bool,
) -> None:
    strategy, store, mutant, budget = result.strategy, result.store, result.mutant, result.budget
    start = time.perf_counter()

    search = DfsSearch(bound) if strategy == "dfs" else None

    def next_schedule(i: int, steps: int | None) -> tuple[int, Callable[[], Strategy]] | None:
        """Schedule ``i``'s seed and a maker of its strategy (a second run needs a fresh one);
        None once a search has run every schedule it can."""
        if search is None:
            run_seed = seed + i
            return run_seed, lambda: make_strategy(strategy, run_seed, scn, constraints, decisions_hint=steps)
        execution = search.next_execution()
        if execution is None:
            return None
        # One world, one seed: the search is over the schedules of that world.
        return seed, lambda: DfsStrategy(execution.prefix, execution.bound)

    async def loop() -> None:
        # One trio loop for all schedules: trio's start-up would otherwise cost ~0.4 ms each.
        steps = await pct_steps(scn, store, mutant, params) if strategy == "pct" else None
        for i in range(budget):
            if time_limit is not None and time.perf_counter() - start > time_limit:
                return
            planned = next_schedule(i, steps)
            if planned is None:
                result.exhausted = True
                return
            run_seed, make = planned
            schedule = make()
            res = await run_once_async(scn, store, schedule, run_seed, mutant, params)
            if search is not None and isinstance(schedule, DfsStrategy):
                search.record(schedule)
            if determinism_every and i % determinism_every == 0 and not stop_requested:
                again = await run_once_async(scn, store, make(), run_seed, mutant, params)
                parted = first_divergence(res.trace_lines, again.trace_lines, ("the first run", "the second"))
                if parted:
                    res.violations.append(Violation("deterministic", f"two runs of seed {run_seed} part at {parted}"))
            if stop_requested:
                raise KeyboardInterrupt  # the run was cut short: it is neither counted nor checked
            result.schedules += 1
            result.traces.add(res.trace_digest)
            result.seconds = time.perf_counter() - start
            if res.unsatisfied:
                result.unsatisfied_runs += 1
            found = result.counts(res.violations)
            clean_too = await _clean_too(res, scn, make(), mutant, result.wanted) if found else []
            found = found and not clean_too
            if found:
                result.first_violation_after = result.first_violation_after or result.schedules
            shrunk = None
            if found and shrink_finds and out_dir is not None and search is None:
                shrunk = await _shrink(res, scn, store, run_seed, mutant, params, result.counts)
                res = shrunk.run
            if res.violations:
                entry: dict[str, Any] = {"seed": run_seed, "violations": [v.as_dict() for v in res.violations]}
                if clean_too:
                    entry["clean_too"] = clean_too
                if shrunk is not None:
                    entry["shrunk"] = shrunk.as_dict()
                if out_dir is not None:
                    entry["artifact"] = save_artifact(res, out_dir, plugins)
                    result.artifact = result.artifact or entry["artifact"]
                result.violations.append(entry)
            if on_schedule is not None:
                on_schedule(result)
            if stop_requested:
                raise KeyboardInterrupt  # (during the shrink: the find is kept, as shrunk so far)
            if (found or clean_too) and stop_on_violation:
                return  # (a find the runtime without the mutant makes too: the scenario cannot judge it)
        if search is not None and search.next_execution() is None:
            result.exhausted = True  # the budget ended exactly where the bounded space does

    trio.run(loop)


async def _clean_too(
    found: RunResult, scn: Scenario, schedule: Strategy, mutant: str | None, wanted: tuple[str, ...] | None
) -> list[str]:
    """The declared invariants that the schedule of a mutant's find breaks on the runtime without
    the mutant as well: such a find is the scenario's (or the harness's), not the mutant's."""
    if mutant is None or wanted is None:
        return []
    with lifted(get_mutant(mutant)):
        clean = await run_once_async(scn, found.store, schedule, found.seed, None, found.params)
    return sorted({v.invariant for v in clean.violations} & set(wanted))


async def _shrink(
    found: RunResult,
    scn: Scenario,
    store: str,
    seed: int,
    mutant: str | None,
    params: Params | None,
    counts: Callable[[list[Violation]], bool],
) -> Shrunk:
    """The smallest schedule and fewest faults of ``found``'s world that still fail as it did;
    recorded as what it came from.

    A smaller world must fail an invariant the find failed (one that ``counts``), and show no
    slip of its own code that the find did not: one that fails for another reason — a check of
    the scenario's that does not hold once a client is left out, a crash of the scenario's code
    in a world without requests — is another failure, not this one made smaller."""
    failed = {v.invariant for v in found.violations if counts([v])}
    slipped = any(v.is_a_slip_of_the_world for v in found.violations)

    def fails_as_found(res: RunResult) -> bool:
        if not slipped and any(v.is_a_slip_of_the_world for v in res.violations):
            return False
        return any(v.invariant in failed for v in res.violations)

    shrunk = await shrink(
        found,
        lambda strategy, faults, left_out: run_once_async(
            scn, store, strategy, seed, mutant, params, faults, left_out=left_out
        ),
        fails_as_found,
    )
    shrunk.run.strategy = found.strategy | {"shrunk": shrunk.as_dict()}
    return shrunk


def _explore_with_hypothesis(
    result: ExploreResult,
    scn: Scenario,
    time_limit: float | None,
    seed: int,
    store: str,
    out_dir: str | None,
    plugins: list[str],
    params: Params | None,
    on_schedule: OnSchedule | None,
    database: str | None,
) -> None:
    """Let Hypothesis generate up to ``budget`` schedules (as choice sequences) and, on a
    violation, shrink the schedule; the reported and saved run is the shrunk one."""
    budget, mutant = result.budget, result.mutant
    failing: list[tuple[RunResult, list[int]]] = []
    shrink_runs = 0
    start = time.perf_counter()

    @hypothesis.settings(
        max_examples=budget,
        database=DirectoryBasedExampleDatabase(database) if database else None,
        deadline=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.reuse, hypothesis.Phase.generate, hypothesis.Phase.shrink],
    )
    @hypothesis.seed(seed)
    @hypothesis.given(SCHEDULES)
    def schedule_holds(choices: list[int]) -> None:
        nonlocal shrink_runs
        if stop_requested:
            raise KeyboardInterrupt
        if not failing and time_limit is not None and time.perf_counter() - start > time_limit:
            # Out of time: the search ends now. Not an example that passes at once (Hypothesis
            # would go on drawing its whole budget of them) nor reject() (an example that passed
            # before and is rejected when replayed is a FlakyFailure): a BaseException, which
            # Hypothesis lets through at once, replaying nothing.
            raise _OutOfTime
        res = run_once(scn, store=store, strategy=HypothesisStrategy(choices), seed=seed, mutant=mutant, params=params)
        if stop_requested:
            raise KeyboardInterrupt
        if failing:  # Hypothesis shrinks the find: these runs are not schedules of the search
            shrink_runs += 1
        else:
            result.schedules += 1
            result.traces.add(res.trace_digest)
        if result.counts(res.violations):
            result.first_violation_after = result.first_violation_after or result.schedules
            failing.append((res, choices))  # Hypothesis ends on the shrunk example
            raise ScheduleFailed
        if res.violations:  # breakage, not the bug: recorded, and Hypothesis goes on
            result.violations.append({"seed": seed, "violations": [v.as_dict() for v in res.violations]})

    # One entry per world: the same closure explores every scenario, so its digest would not do.
    world = repr((scn.name, store, mutant, sorted((params or {}).items()), scn.fault_specs, seed))
    schedule_holds._hypothesis_internal_database_key = hashlib.sha256(world.encode()).digest()  # type: ignore[attr-defined]
    try:
        schedule_holds()
    except _OutOfTime:
        pass
    except ScheduleFailed:
        shrunk, steered = failing[-1]
        entry: dict[str, Any] = {
            "seed": seed,
            "violations": [v.as_dict() for v in shrunk.violations],
            # Decisions the drawn schedule steered away from the first runnable task.
            "steered_choices": sum(1 for c in steered if c),
            "steered_choices_before_shrinking": sum(1 for c in failing[0][1] if c),
            "shrink_runs": shrink_runs,
        }
        clean_too = trio.run(_clean_too, shrunk, scn, HypothesisStrategy(steered), mutant, result.wanted)
        if clean_too:
            entry["clean_too"] = clean_too
            result.first_violation_after = None
        if out_dir is not None:
            entry["artifact"] = result.artifact = save_artifact(shrunk, out_dir, plugins)
        result.violations.append(entry)


class ScheduleFailed(AssertionError):
    """A schedule broke an invariant (raised to Hypothesis, which then shrinks it)."""


class _OutOfTime(BaseException):
    """The search's time is up (raised through Hypothesis, which lets it through at once)."""


def save_artifact(res: RunResult, out_dir: str, plugins: list[str]) -> str:
    """Write everything needed to replay ``res``; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    config = "".join(f"-{value}" for value in res.params.values())
    name = f"{res.scenario}{config}-{res.mutant or 'clean'}-{res.store}-{res.strategy['strategy']}-seed{res.seed}"
    path = os.path.join(out_dir, name + ".json")
    with open(os.path.join(out_dir, name + ".trace.jsonl"), "w") as f:
        f.writelines(line + "\n" for line in res.trace_lines)
    artifact = {
        "version": ARTIFACT_VERSION,
        "scenario": res.scenario,
        "store": res.store,
        "seed": res.seed,
        "mutant": res.mutant,
        "params": res.params,
        "faults": res.faults,
        "plugins": [os.path.abspath(p) if os.path.exists(p) else p for p in plugins],
        "strategy": res.strategy,
        "choices": res.choices,
        "events": res.events,
        "trace_digest": res.trace_digest,
        "violations": [v.as_dict() for v in res.violations],
    }
    if res.fault_plan is not None:
        artifact["fault_plan"] = [fault.as_dict() for fault in res.fault_plan]
    if res.left_out:
        artifact["left_out"] = res.left_out
    with open(path, "w") as f:
        json.dump(artifact, f, indent=1)
    return path


@dataclass
class ReplayResult:
    run: RunResult
    expected_digest: str
    diverged_at: int | None
    first_difference: str | None
    #: With ``check``: where a second replay parted from the first (None: it did not).
    nondeterminism: str | None = None

    @property
    def reproduced(self) -> bool:
        return self.run.trace_digest == self.expected_digest


#: What an artifact must hold, with the type each field must have.
_ARTIFACT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "scenario": str,
    "store": str,
    "seed": int,
    "strategy": dict,
    "choices": list,
    "events": list,
    "trace_digest": str,
}


def load_artifact(path: str) -> dict[str, Any]:
    """Read and check an artifact; a file that is not a readable, complete artifact is a usage error."""
    try:
        with open(path, encoding="utf-8") as f:
            artifact = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"cannot read artifact {path!r}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read artifact {path!r}: {e}") from None
    if not isinstance(artifact, dict) or artifact.get("version") != ARTIFACT_VERSION:
        raise UsageError(f"{path!r} is not an omnisim artifact of version {ARTIFACT_VERSION}")
    for name, kind in _ARTIFACT_FIELDS.items():
        if not isinstance(artifact.get(name), kind) or isinstance(artifact.get(name), bool):
            raise UsageError(f"artifact {path!r} has no valid {name!r} field")
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in artifact["choices"]):
        raise UsageError(f"artifact {path!r}: 'choices' must be a list of task ids (whole numbers from 0)")
    faults = artifact.get("faults", [])
    if not (isinstance(faults, list) and all(isinstance(spec, str) for spec in faults)):
        raise UsageError(f"artifact {path!r}: 'faults' must be a list of fault specs like put_fail@key=R_0_3")
    if not all(isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e) for e in artifact["events"]):
        raise UsageError(f"artifact {path!r}: 'events' must be a list of [task, event] pairs")
    params = artifact.get("params")
    if params is not None and not (isinstance(params, dict) and all(isinstance(v, str) for v in params.values())):
        raise UsageError(f"artifact {path!r}: 'params' must map names to values")
    left_out = artifact.get("left_out", [])
    if not (isinstance(left_out, list) and all(isinstance(name, str) for name in left_out)):
        raise UsageError(f"artifact {path!r}: 'left_out' must be a list of client names")
    return artifact


def _fault_plan_of(artifact: dict[str, Any], path: str) -> list[Fault] | None:
    """The faults an artifact's run had in place of its scenario's (a shrunk find's); None for
    an artifact without (its faults are the scenario's and its ``faults`` specs, drawn again)."""
    entries = artifact.get("fault_plan")
    if entries is None:
        return None
    if not isinstance(entries, list):
        raise UsageError(f"artifact {path!r}: 'fault_plan' must be a list of faults")
    try:
        return [fixed_fault(entry) for entry in entries]
    except UnknownFaultError as e:
        raise UsageError(f"artifact {path!r}: {e}") from None


def replay(path: str, *, plugins: list[str] | None = None, check: bool = False) -> ReplayResult:
    """Re-run an artifact: its exact choices first, its event order where the choices stop fitting.
    With ``check``, run it twice: two runs of one schedule must give the same trace, byte for byte."""
    from omnisim.registry import load

    artifact = load_artifact(path)
    load([*(artifact.get("plugins") or []), *(plugins or [])])
    scn = get_scenario(artifact["scenario"]).with_faults(artifact.get("faults") or [])
    mutant = get_mutant(artifact.get("mutant"))
    scn.configurations(artifact.get("params"))
    faults = _fault_plan_of(artifact, path)

    _recorded_gate(artifact, path)  # (a malformed one is refused before anything runs)

    def once() -> tuple[RunResult, ReplayStrategy]:
        # (a gate of its own for each run: an ordering follows its run's events)
        gate = _recorded_gate(artifact, path)
        strategy = ReplayStrategy(artifact["choices"], [tuple(e) for e in artifact["events"]], gate)
        with applied(mutant):
            res = run_once(
                scn,
                store=artifact["store"],
                strategy=strategy,
                seed=artifact["seed"],
                mutant=artifact.get("mutant"),
                params=artifact.get("params"),
                fault_plan=faults,
                left_out=frozenset(artifact.get("left_out", [])),
            )
        res.strategy = {"strategy": "replay", "of": artifact["strategy"]}
        return res, strategy

    res, strategy = once()
    unknown = sorted(set(artifact.get("left_out", [])) - set(res.clients))
    if unknown:  # (known only once the world ran: a scenario makes its clients as it goes)
        raise UsageError(f"artifact {path!r} leaves out {unknown[0]!r}, a request {scn.name} does not make")
    difference = None
    if res.trace_digest != artifact["trace_digest"]:
        difference = _first_difference(path, artifact["events"], res.trace_lines)
    nondeterminism = None
    if check:
        nondeterminism = first_divergence(res.trace_lines, once()[0].trace_lines, ("the first run", "the second"))
        nondeterminism = nondeterminism or first_divergence(
            res.trace_lines, _replayed_elsewhere(path, plugins), ("this process", "a fresh one with another hash seed")
        )
    return ReplayResult(res, artifact["trace_digest"], strategy.diverged_at, difference, nondeterminism)


def _recorded_gate(artifact: dict[str, Any], path: str) -> OrderedStrategy | None:
    """The recorded strategy's hold on tasks, rebuilt for its replay: an ordered run's ordering."""
    recorded = artifact["strategy"]
    if not isinstance(recorded, dict) or recorded.get("strategy") != "ordered":
        return None
    constraints = recorded.get("constraints")
    if not (isinstance(constraints, list) and all(isinstance(c, str) for c in constraints)):
        raise UsageError(f"artifact {path!r}: an ordered run's strategy must list its constraints")
    return OrderedStrategy(0, constraints)


#: Prints the trace of one replay (``argv``: the artifact, then its plugins) as a JSON list.
_REPLAY_TRACE = """
import json, sys
from omnisim.explore import replay
print(json.dumps(replay(sys.argv[1], plugins=sys.argv[2:]).run.trace_lines))
"""


def _replayed_elsewhere(path: str, plugins: list[str] | None) -> list[str]:
    """The trace of the same replay in a fresh interpreter whose string hashes differ from this
    one's: what a second run in this process cannot show (an order that follows ``hash()``, as a
    set of request ids iterated would) shows there."""
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    done = subprocess.run(
        [sys.executable, "-c", _REPLAY_TRACE, path, *(plugins or [])],
        env=dict(os.environ, PYTHONHASHSEED=hash_seed),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the replay in a fresh process failed: {done.stderr.strip()[-2000:]}")
    trace: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return trace


def _first_difference(artifact_path: str, events: list[list[str]], lines: list[str]) -> str:
    """Where a replay's trace ``lines`` part from the recording: from the trace file beside the
    artifact, or, without one, from the artifact's own ``events`` (each event's task and point)."""
    trace_path = artifact_path.removesuffix(".json") + ".trace.jsonl"
    try:
        with open(trace_path) as f:
            recorded = [line.rstrip("\n") for line in f]
    except OSError:
        replayed = [f"{e['task']} at {e['ev']}" for e in map(json.loads, lines)]
        parted = first_divergence(
            [f"{task} at {point}" for task, point in events], replayed, ("recorded", "replay gave")
        )
        compared = "the recorded trace is missing: only the artifact's tasks and points were compared"
        return f"{parted or 'the same tasks at the same points'} ({compared})"
    return first_divergence(recorded, lines, ("recorded", "replay gave")) or "the traces are the same"


def first_divergence(a: list[str], b: list[str], names: tuple[str, str] = ("one run", "the other")) -> str | None:
    """Where two traces part (None: they do not)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"event {i}: {names[0]} {x} but {names[1]} {y}"
    if len(a) != len(b):
        return f"the traces agree for {min(len(a), len(b))} events, then one is longer"
    return None
