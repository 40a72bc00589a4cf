"""A mutation campaign: how much of the runtime the scenarios and invariants actually guard.

1. **Coverage, and the baseline.** Every plan (a scenario on a store) runs its schedules once
   against the clean runtime under coverage. That tells which plans execute which lines, how
   long each takes, and that the clean runtime passes them: a plan that fails clean is left out,
   since a kill there would prove nothing.
2. **One process per mutant.** The campaign forks from a warm parent (torch and the rest already
   imported), so a mutant costs its schedules, not a start-up. The child forgets the runtime's
   modules, imports them again with the mutated source in place of one module, and runs the plans
   that execute the mutated lines, fastest first, with exactly the schedules of the baseline. The
   first violation kills the mutant; those schedules pass on the clean runtime, so the violation
   is the mutation's doing.
3. **Outcomes.** ``killed`` (an invariant failed), ``crashed`` (the mutated runtime broke the run
   before an invariant could be checked, for instance at import), ``timeout`` (the child ran past
   its time: a hang the harness did not bound; the time is :func:`time_allowed`, which grows with
   the plans a mutant runs, so that no mutant is judged a hang for running many plans),
   ``survived`` (every covering plan passed, or no plan executes the line at all) and
   ``equivalent`` (a survivor reviewed as unable to change behaviour, listed with its reason in
   ``equivalents.toml``). The score counts killed, crashed and timeout as detected (as Stryker
   does), over everything but the equivalents.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import multiprocessing
import os
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import ModuleType
from typing import Any

from omnisim.base import CommandFailed
from omnisim.mutation.operators import Mutation

#: The packages a child forgets, so that they import again around the mutated module.
_RELOADED = ("runtime", "omnisim", "scenarios", "invariants")
EQUIVALENTS = Path(__file__).with_name("equivalents.toml")
DETECTED = ("killed", "crashed", "timeout")
#: How many times its plans' time on the clean runtime (under coverage, so already generous) a
#: mutant may take on top of the campaign's time limit before it counts as a hang.
SLOWDOWN_ALLOWED = 2.0


@dataclass(frozen=True)
class Plan:
    """One scenario on one store, run with ``budget`` random schedules and half as many PCT;
    with ``faults`` (``sampled``: BUGGIFY), those faults on top of the scenario's own, so that
    the runtime's failure paths run too."""

    scenario: str
    store: str
    faults: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.scenario}/{self.store}" + "".join(f"+{f}" for f in self.faults)


@dataclass
class Baseline:
    """What coverage found: for each plan, the lines it executes per file, and its cost."""

    lines: dict[Plan, dict[str, set[int]]] = field(default_factory=dict)
    seconds: dict[Plan, float] = field(default_factory=dict)
    #: Plans that fail on the clean runtime, with what failed: left out of the campaign.
    failing: dict[Plan, list[str]] = field(default_factory=dict)

    def covering(self, m: Mutation) -> list[Plan]:
        """The plans that execute a line of ``m``, cheapest first. What runs at import (coverage
        starts after it) counts as executed by every plan that uses the module."""
        span = set(range(m.line, m.end_line + 1))
        plans = [
            p
            for p, files in self.lines.items()
            if (files.get(m.path) if m.at_import else span & files.get(m.path, set()))
        ]
        return sorted(plans, key=lambda p: (self.seconds[p], str(p)))


@dataclass
class Outcome:
    id: str
    module: str
    line: int
    where: str
    description: str
    outcome: str
    #: What detected it: the invariants that failed, or the error.
    detail: str = ""
    #: The plan that detected it.
    plan: str = ""
    plans_run: int = 0
    plans_covering: int = 0
    seconds: float = 0.0
    diff: str = ""
    reason: str = ""


def strategies(budget: int, *, ordered: bool = False) -> list[tuple[str, int]]:
    """What a plan runs: ``budget`` random schedules, half as many PCT, and for a scenario that
    declares orderings (``ordered``) half as many again that follow them: the race its author
    meant, which random schedules may take hundreds to hit."""
    return [("random", budget), ("pct", max(1, budget // 2))] + [("ordered", max(1, budget // 2))] * ordered


def run_plan(plan: Plan, budget: int, seed: int) -> tuple[list[str], int]:
    """Run one plan's schedules; the invariants that failed (empty: it passed) and how many ran.
    Each strategy runs every configuration of the scenario at least once (successive seeds walk
    through them), whatever the budget: a configuration left out is code left unguarded."""
    from omnisim import registry
    from omnisim.explore import explore

    scenario = registry.get_scenario(plan.scenario)
    configurations = len(scenario.configurations())
    ran = 0
    for strategy, schedules in strategies(budget, ordered=bool(scenario.constraints)):
        res = explore(
            plan.scenario,
            strategy=strategy,
            budget=max(schedules, configurations),
            seed=seed,
            store=plan.store,
            faults=list(plan.faults),
            shrink_finds=False,  # a kill needs no shrunk schedule
        )
        ran += res.schedules
        if res.first_violation_after is not None:
            return res.invariants(), ran
    return [], ran


def measure_baseline(plans: Sequence[Plan], files: Sequence[str], budget: int, seed: int) -> Baseline:
    import coverage

    baseline = Baseline()
    for plan in plans:
        cov = coverage.Coverage(data_file=None, include=list(files), config_file=False)
        start = time.perf_counter()
        cov.start()
        try:
            failed, _ = run_plan(plan, budget, seed)
        finally:
            cov.stop()
        baseline.seconds[plan] = time.perf_counter() - start
        if failed:
            baseline.failing[plan] = failed
            continue
        data = cov.get_data()
        baseline.lines[plan] = {f: set(data.lines(f) or ()) for f in data.measured_files()}
    return baseline


def source_stamp() -> dict[str, tuple[int, int]]:
    """Size and modification time of every source file a child imports again: the code a
    campaign measures (its mutants are spans of those files, its baseline their coverage)."""
    stamp = {}
    for package in _RELOADED:
        spec = importlib.util.find_spec(package)
        folders = spec.submodule_search_locations if spec is not None else None
        for folder in folders or ():
            for path in sorted(Path(folder).rglob("*.py")):
                st = path.stat()
                stamp[str(path)] = (st.st_size, st.st_mtime_ns)
    return stamp


class SourceChanged(CommandFailed):
    """The code changed while a campaign ran: a mutant spliced into the new source would be a
    different slip (or no Python at all), and its outcome would be counted against the wrong
    code — a harness error, never a detection."""


def _check_unchanged(stamp: dict[str, tuple[int, int]]) -> None:
    now = source_stamp()
    changed = sorted(set(now.items()) ^ set(stamp.items()))
    if changed:
        raise SourceChanged(
            f"{changed[0][0]} changed while the campaign ran (its mutants and baseline are of the code as it was): "
            "run it again once the code stands still"
        )


class _MutatedSource(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports one module from the mutated source instead of its file (and never from a cached
    ``.pyc``, which holds the clean code)."""

    def __init__(self, m: Mutation) -> None:
        self.m = m
        self.source = m.apply(Path(m.path).read_bytes())

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.m.module:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=self.m.path)

    def exec_module(self, module: ModuleType) -> None:
        module.__file__ = self.m.path
        exec(compile(self.source, self.m.path, "exec"), module.__dict__)


def _child(m: Mutation, plans: list[Plan], budget: int, seed: int, plugins: list[str], conn: Connection) -> None:
    """In the forked child: import the runtime again with ``m`` in place, run ``plans``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a child stops
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for name in [n for n in sys.modules if n.split(".")[0] in _RELOADED]:
        del sys.modules[name]
    sys.meta_path.insert(0, _MutatedSource(m))
    report: dict[str, Any] = {"outcome": "survived", "plans_run": 0}
    try:
        registry = importlib.import_module("omnisim.registry")
        registry.load(plugins)
        for plan in plans:
            failed, _ = run_plan(plan, budget, seed)
            report["plans_run"] += 1
            if failed:
                report |= {"outcome": "killed", "detail": ", ".join(failed), "plan": str(plan)}
                break
    except BaseException as e:  # the mutated runtime broke the run itself
        report |= {"outcome": "crashed", "detail": f"{type(e).__name__}: {e}"[:300]}
    conn.send(report)
    conn.close()


@dataclass
class _Running:
    m: Mutation
    process: multiprocessing.process.BaseProcess
    conn: Connection
    started: float
    covering: int
    #: Seconds it may run (see :func:`time_allowed`).
    allowed: float


def time_allowed(plans: Sequence[Plan], baseline: Baseline, time_limit: float) -> float:
    """How long a mutant may run before it counts as a hang: ``time_limit`` beyond
    :data:`SLOWDOWN_ALLOWED` times what its plans took on the clean runtime. A mutant that passes
    every plan runs them all, so a limit that ignored how many there are would call a survivor of
    200 plans a timeout, and count it as detected."""
    return time_limit + SLOWDOWN_ALLOWED * sum(baseline.seconds[p] for p in plans)


def run_mutants(
    mutations: Sequence[Mutation],
    baseline: Baseline,
    *,
    budget: int,
    seed: int,
    jobs: int,
    time_limit: float,
    plugins: list[str],
    on_outcome: Callable[[Outcome], None],
    stamp: dict[str, tuple[int, int]] | None = None,
) -> list[Outcome]:
    """Run every mutant on ``jobs`` forked children at once; the outcomes in the order given.
    ``stamp``: the :func:`source_stamp` the mutants were found in; the campaign stops with
    :class:`SourceChanged` if the code changes before a mutant starts."""
    context = multiprocessing.get_context("fork")
    equivalents = load_equivalents()
    done: dict[str, Outcome] = {}
    queue = list(mutations)
    running: list[_Running] = []
    shm_before = _omnisim_names()

    def finish(m: Mutation, outcome: Outcome) -> None:
        if outcome.outcome == "survived":
            outcome.diff = m.diff()
            if m.id in equivalents:
                outcome.outcome, outcome.reason = "equivalent", equivalents[m.id]
        done[m.id] = outcome
        on_outcome(outcome)

    try:
        while queue or running:
            while queue and len(running) < jobs:
                if stamp is not None:
                    _check_unchanged(stamp)
                m = queue.pop(0)
                plans = baseline.covering(m)
                if not plans:
                    finish(m, _outcome(m, "survived", detail="no scenario executes this line"))
                    continue
                parent_end, child_end = context.Pipe(duplex=False)
                process = context.Process(target=_child, args=(m, plans, budget, seed, plugins, child_end), daemon=True)
                process.start()
                child_end.close()
                allowed = time_allowed(plans, baseline, time_limit)
                running.append(_Running(m, process, parent_end, time.perf_counter(), len(plans), allowed))
            ready = wait([r.process.sentinel for r in running], timeout=0.5)
            now = time.perf_counter()
            for r in list(running):
                late = now - r.started > r.allowed
                if r.process.sentinel not in ready and not late:
                    continue
                running.remove(r)
                finish(r.m, _collect(r, late, now))
                _reclaim(shm_before, ownerless_too=not running)
    finally:
        for r in running:
            _stop(r.process)
        _reclaim(shm_before, ownerless_too=True)
    return [done[m.id] for m in mutations]


def _collect(r: _Running, late: bool, now: float) -> Outcome:
    report: dict[str, Any] | None = None
    if late:
        _stop(r.process)
    else:
        r.process.join()
        with contextlib.suppress(EOFError, OSError):
            report = r.conn.recv()
    r.conn.close()
    seconds = now - r.started
    if late:
        return _outcome(r.m, "timeout", detail=f"still running after {seconds:.0f} s", covering=r.covering)
    if report is None:
        code = r.process.exitcode
        return _outcome(r.m, "crashed", detail=f"the child died (exit {code})", covering=r.covering, seconds=seconds)
    return _outcome(
        r.m,
        report["outcome"],
        detail=report.get("detail", ""),
        plan=report.get("plan", ""),
        plans_run=report["plans_run"],
        covering=r.covering,
        seconds=seconds,
    )


def _outcome(m: Mutation, outcome: str, *, covering: int = 0, **kwargs: Any) -> Outcome:
    return Outcome(m.id, m.module, m.line, m.where, m.describe(), outcome, plans_covering=covering, **kwargs)


def _stop(process: multiprocessing.process.BaseProcess) -> None:
    """SIGTERM first: the child's run stops at its next decision and sweeps what it made."""
    process.terminate()
    process.join(2.0)
    if process.is_alive():
        process.kill()
        process.join()


def _omnisim_names() -> set[str]:
    from runtime.connectors.namespaces import SHM_DIR

    return {name for name in os.listdir(SHM_DIR) if name.startswith("omnisim-")}


def _reclaim(before: set[str], *, ownerless_too: bool) -> None:
    """Remove what the campaign's children left in /dev/shm (a mutant may well break the
    runtime's own cleanup): every namespace new since the campaign began whose owner is dead,
    and, when no child runs (so none is half-way through making one), those with no owner. With
    the harness's own code, folders and what scenarios planted in them included: the runtime's
    removal rightly leaves a folder holding names that are not ours."""
    from omnisim import devshm
    from runtime.connectors.namespaces import NAME, Owner, ProcTable, ShmDirectory, owner_state

    directory = ShmDirectory()
    processes = ProcTable()
    new: dict[str, list[str]] = {}
    for name in _omnisim_names() - before:
        match = NAME.fullmatch(name)
        if match is not None:
            new.setdefault(match.group(1), []).append(name)
    for namespace, names in new.items():
        owner = directory.read_owner(namespace)
        gone = owner_state(owner, processes) == "dead" if isinstance(owner, Owner) else ownerless_too and owner is None
        if gone:
            for name in names:
                with contextlib.suppress(OSError):
                    devshm.remove(os.path.join(directory.path, name))


def load_equivalents(path: Path = EQUIVALENTS) -> dict[str, str]:
    """Survivors reviewed as equivalent: their id and why no behaviour can tell them apart."""
    if not path.exists():
        return {}
    with path.open("rb") as f:
        return {str(k): str(v) for k, v in tomllib.load(f).get("equivalent", {}).items()}


@dataclass
class Score:
    module: str
    counts: dict[str, int]

    @property
    def detected(self) -> int:
        return sum(self.counts.get(k, 0) for k in DETECTED)

    @property
    def judged(self) -> int:
        return sum(self.counts.values()) - self.counts.get("equivalent", 0)

    @property
    def percent(self) -> float | None:
        return 100.0 * self.detected / self.judged if self.judged else None


def scores(outcomes: Sequence[Outcome], group: Callable[[Outcome], str]) -> list[Score]:
    by: dict[str, dict[str, int]] = {}
    for o in outcomes:
        counts = by.setdefault(group(o), {})
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
    return [Score(name, counts) for name, counts in sorted(by.items())]


def as_dicts(outcomes: Sequence[Outcome]) -> Iterator[dict[str, Any]]:
    for o in outcomes:
        yield asdict(o)
