"""Mutation testing of the runtime against the scenario sweep (``omnisim mutate``).

:func:`mutate` finds the mutations of the modules asked for (:mod:`.operators`), runs each
against the plans that execute it (:mod:`.campaign`) and returns the outcomes with the score per
module; :func:`write_report` keeps them, with every survivor as a diff: the harness's blind spots.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnisim.base import STORES, UsageError
from omnisim.mutation.campaign import (
    Baseline,
    Outcome,
    Plan,
    Score,
    as_dicts,
    measure_baseline,
    run_mutants,
    scores,
    source_stamp,
)
from omnisim.mutation.operators import OPERATORS, Mutation, find_mutations, iter_modules

__all__ = ["OPERATORS", "MutationReport", "find", "mutate", "write_report"]


def runtime_root() -> Path:
    """The folder that holds the ``runtime`` package: module names start there."""
    import runtime

    return Path(runtime.__path__[0]).resolve().parent


def find(
    targets: Sequence[str], operators: Sequence[str] = OPERATORS, ids: Sequence[str] | None = None
) -> list[Mutation]:
    """Every mutation of the runtime modules under ``targets`` (files or folders); ``ids``: only those."""
    root = runtime_root()
    package = root / "runtime"
    paths = []
    for target in targets:
        path = Path(target).resolve()
        if not path.exists():
            raise UsageError(f"no such file or folder: {target}")
        if path != package and package not in path.parents:
            raise UsageError(f"{target} is not part of the runtime ({package}): only the runtime is mutated")
        paths.append(path)
    unknown = sorted(set(operators) - set(OPERATORS))
    if unknown:
        raise UsageError(f"unknown operator {unknown[0]!r}; choose from: {', '.join(OPERATORS)}")
    found = [m for path in iter_modules(paths) for m in find_mutations(path, root, tuple(operators))]
    if ids is None:
        return found
    missing = sorted(set(ids) - {m.id for m in found})
    if missing:
        raise UsageError(f"no mutant {missing[0]!r} under {', '.join(targets)} (`omnisim mutate --list` shows them)")
    return [m for m in found if m.id in ids]


@dataclass
class MutationReport:
    outcomes: list[Outcome]
    baseline: Baseline
    seconds: float

    def by_module(self) -> list[Score]:
        return scores(self.outcomes, lambda o: o.module)

    def by_package(self) -> list[Score]:
        return scores(self.outcomes, lambda o: o.module.rsplit(".", 1)[0])

    def total(self) -> Score:
        return scores(self.outcomes, lambda o: "total")[0]

    def survivors(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.outcome == "survived"]

    def as_dict(self) -> dict[str, Any]:
        def table(rows: list[Score]) -> list[dict[str, Any]]:
            return [{"name": s.module, "score": s.percent, **s.counts} for s in rows]

        return {
            "seconds": round(self.seconds, 1),
            "total": table([self.total()])[0] if self.outcomes else None,
            "packages": table(self.by_package()),
            "modules": table(self.by_module()),
            "plans_failing_clean": {str(p): failed for p, failed in self.baseline.failing.items()},
            "outcomes": list(as_dicts(self.outcomes)),
        }


def mutate(
    mutations: Sequence[Mutation],
    *,
    budget: int = 12,
    seed: int = 0,
    jobs: int = 1,
    time_limit: float = 120.0,
    plugins: Sequence[str] = (),
    scenarios: Sequence[str] | None = None,
    on_outcome: Callable[[Outcome], None] = lambda o: None,
    on_baseline: Callable[[Baseline], None] = lambda b: None,
) -> MutationReport:
    """Run ``mutations`` against every scenario (or ``scenarios``) on every store, and with
    sampled faults on the memory store, ``budget`` random and ``budget // 2`` PCT schedules per
    plan (and ``budget // 2`` that follow a scenario's declared orderings, where it has some);
    ``time_limit``: seconds a mutant may run beyond twice its plans' time on the clean runtime
    (see :func:`~omnisim.mutation.campaign.time_allowed`)."""
    import time

    from omnisim import registry

    names = sorted(registry.SCENARIOS) if scenarios is None else list(scenarios)
    for name in names:
        registry.get_scenario(name)
    start = time.perf_counter()
    # The faulted plans run on one store only, memory where the scenario runs there: an injected
    # fault is an exception at a point, the same on every store, and a survivor runs every plan
    # that covers it.
    available = {name: [s for s in STORES if registry.SCENARIOS[name].unavailable(s) is None] for name in names}
    plans = [Plan(name, store) for name in names for store in available[name]]
    plans += [Plan(name, available[name][0], ("sampled",)) for name in names if available[name]]
    files = sorted({m.path for m in mutations})
    stamp = source_stamp()
    baseline = measure_baseline(plans, files, budget, seed)
    on_baseline(baseline)
    outcomes = run_mutants(
        mutations,
        baseline,
        budget=budget,
        seed=seed,
        jobs=jobs,
        time_limit=time_limit,
        plugins=list(plugins),
        on_outcome=on_outcome,
        stamp=stamp,
    )
    return MutationReport(outcomes, baseline, time.perf_counter() - start)


def write_report(report: MutationReport, out_dir: str) -> tuple[str, str]:
    """``mutation.json`` (everything) and ``survivors.diff`` (the blind spots) in ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "mutation.json")
    with open(json_path, "w") as f:
        json.dump(report.as_dict(), f, indent=1)
    diff_path = os.path.join(out_dir, "survivors.diff")
    with open(diff_path, "w") as f:
        for o in report.survivors():
            f.write(f"# {o.id} {o.module}:{o.line} {o.where}: {o.description}")
            f.write(f" ({o.detail})\n" if o.detail else f" (ran {o.plans_run} plan(s))\n")
            f.write(o.diff + "\n")
    return json_path, diff_path
