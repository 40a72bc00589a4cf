"""The ``omnisim`` command line. Exit status: 0 all invariants held, 1 a violation was found,
2 a usage or setup error. With ``--json`` the last line printed is one JSON object."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from invariants import INVARIANTS
from omnisim import explore as ex
from omnisim import registry
from omnisim.points import POINTS
from omnisim.world import STORES, UsageError

DEFAULT_BUDGET = 200
REPORT_DIR = "reports/latest"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit status for usage errors is 2 too
        self.print_usage(sys.stderr)
        raise UsageError(message)


def _emit(args: argparse.Namespace, human: list[str], payload: dict[str, Any]) -> None:
    for line in human:
        print(line)
    if args.json:
        print(json.dumps(payload, sort_keys=True))


def _violations_text(violations: list[dict[str, str]]) -> list[str]:
    return [f"  VIOLATION {v['invariant']}: {v['message']}" for v in violations]


def cmd_run(args: argparse.Namespace) -> int:
    res = ex.run(
        args.scenario,
        seed=args.seed,
        strategy=args.strategy,
        store=args.store,
        mutant=args.mutant,
        constraints=args.order,
    )
    if args.trace:
        with open(args.trace, "w") as f:
            f.writelines(line + "\n" for line in res.trace_lines)
    summary = res.summary()
    human = [
        f"{res.scenario} seed={res.seed} strategy={summary['strategy']} store={res.store} mutant={res.mutant}: "
        f"{len(res.trace_lines)} events, {res.steps} steps, {res.virtual_time_s:g}s virtual, "
        f"digest {res.trace_digest[:16]}",
        *_violations_text(summary["violations"]),
        *[f"  UNSATISFIED {u}" for u in res.unsatisfied],
    ]
    if not res.violations:
        human.append("  all invariants held")
    _emit(args, human, summary)
    return 1 if res.violations else 0


def _explore_one(args: argparse.Namespace, scenario: str) -> dict[str, Any]:
    res = ex.explore(
        scenario,
        strategy=args.strategy,
        budget=args.budget,
        time_limit=args.time,
        seed=args.seed,
        store=args.store,
        mutant=args.mutant,
        out_dir=args.out,
        plugins=args.plugin,
        constraints=args.order,
    )
    return res.summary()


def _explore_lines(s: dict[str, Any]) -> list[str]:
    head = (
        f"{s['scenario']} [{s['strategy']}, {s['store']}, mutant={s['mutant']}]: {s['schedules']} schedules, "
        f"{s['schedules_per_s']}/s"
    )
    if s["unsatisfied_runs"]:
        head += f", {s['unsatisfied_runs']} runs could not meet the ordering"
    lines = [head]
    for v in s["violations"]:
        lines.append(f"  seed {v['seed']} (after {s['first_violation_after']} schedules): artifact {v.get('artifact')}")
        lines.extend(_violations_text(v["violations"][:5]))
    if not s["violations"]:
        lines.append("  no violation")
    return lines


def cmd_explore(args: argparse.Namespace) -> int:
    if args.all == (args.scenario is not None):
        raise UsageError("give a SCENARIO or --all (not both)")
    names = sorted(registry.SCENARIOS) if args.all else [args.scenario]
    if args.strategy == "ordered" and args.all:
        names = [n for n in names if registry.SCENARIOS[n].constraints]
    results = [_explore_one(args, name) for name in names]
    human = [line for s in results for line in _explore_lines(s)]
    payload = (
        results[0]
        if len(results) == 1
        else {"results": results, "violations": [v for s in results for v in s["violations"]]}
    )
    _emit(args, human, payload)
    return 1 if any(s["violations"] for s in results) else 0


def cmd_replay(args: argparse.Namespace) -> int:
    rr = ex.replay(args.artifact)
    summary = rr.run.summary() | {
        "reproduced": rr.reproduced,
        "expected_trace_digest": rr.expected_digest,
        "diverged_at_choice": rr.diverged_at,
        "first_difference": rr.first_difference,
    }
    human = [
        f"replay of {args.artifact}: digest {rr.run.trace_digest[:16]} "
        + ("(same as recorded)" if rr.reproduced else f"(recorded {rr.expected_digest[:16]}: NOT reproduced)"),
        *_violations_text(summary["violations"]),
    ]
    if rr.first_difference:
        human.append(f"  uncontrolled nondeterminism or changed code: {rr.first_difference}")
    _emit(args, human, summary)
    return 1 if rr.run.violations else 0


def cmd_list(args: argparse.Namespace) -> int:
    rows: list[tuple[str, str]]
    if args.what == "scenarios":
        rows = [(s.name, f"{s.issue}: {s.summary}") for s in sorted(registry.SCENARIOS.values(), key=lambda s: s.name)]
    elif args.what == "mutants":
        rows = [(m.name, f"{m.issue}: {m.summary}") for m in sorted(registry.MUTANTS.values(), key=lambda m: m.name)]
    elif args.what == "invariants":
        rows = [(i.id, i.statement) for i in INVARIANTS.values()]
    else:
        rows = [(name, f"({kind}) {meaning}") for name, (kind, meaning) in POINTS.items()]
    width = max(len(name) for name, _ in rows)
    _emit(args, [f"{name:<{width}}  {text}" for name, text in rows], {args.what: [name for name, _ in rows]})
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Every scenario on both stores (and its ordering, if it has one) against the clean runtime."""
    from omnisim.report import write_check_report

    results = []
    for name in sorted(registry.SCENARIOS):
        scn = registry.SCENARIOS[name]
        budget = scn.budget(args.budget)
        plans = [("random", "memory", budget), ("random", "posix", max(1, budget // 4))]
        if scn.constraints:
            plans.append(("ordered", "memory", max(1, budget // 4)))
        for strategy, store, budget in plans:
            res = ex.explore(name, strategy=strategy, budget=budget, seed=args.seed, store=store, out_dir=args.out)
            results.append(res.summary())
            for line in _explore_lines(results[-1]):
                print(line, flush=True)
    path = write_check_report(results, args.out)
    failed = [s for s in results if s["violations"]]
    payload = {"results": results, "violations": [v for s in failed for v in s["violations"]], "report": path}
    _emit(args, [f"report: {path}", f"{len(results)} explorations, {len(failed)} with violations"], payload)
    return 1 if failed else 0


def cmd_mutants(args: argparse.Namespace) -> int:
    """The detection table: each mutant against its scenarios, by strategy."""
    from omnisim.report import write_mutant_report

    rows = []
    names = args.mutant or sorted(registry.MUTANTS)
    for name in names:
        m = registry.get_mutant(name)
        assert m is not None
        for scenario in m.scenarios:
            scn = registry.get_scenario(scenario)
            wanted = args.strategy or ["random", "ordered"]
            for strategy in [st for st in wanted if st != "ordered" or scn.constraints]:
                res = ex.explore(
                    scenario,
                    strategy=strategy,
                    budget=args.budget,
                    time_limit=args.time_limit,
                    seed=args.seed,
                    mutant=name,
                )
                s = res.summary()
                rows.append(
                    {
                        "mutant": name,
                        "issue": m.issue,
                        "scenario": scenario,
                        "strategy": strategy,
                        "detected": bool(s["violations"]),
                        "schedules": s["first_violation_after"] or s["schedules"],
                        "seconds": s["seconds"],
                        "invariants": sorted({v["invariant"] for e in s["violations"] for v in e["violations"]}),
                    }
                )
                r = rows[-1]
                verdict = (
                    f"found after {r['schedules']} schedules ({r['seconds']}s) by {', '.join(r['invariants'])}"
                    if r["detected"]
                    else f"NOT found in {r['schedules']} schedules"
                )
                print(f"{name:<34} {scenario:<28} {strategy:<10} {verdict}", flush=True)
    undetected = sorted({r["mutant"] for r in rows} - {r["mutant"] for r in rows if r["detected"]})
    path = write_mutant_report(rows, args.out)
    _emit(
        args,
        [f"report: {path}", f"{len(names) - len(undetected)}/{len(names)} mutants detected"],
        {"rows": rows, "undetected": undetected, "report": path},
    )
    return 1 if undetected else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from omnisim import bench

    payload = bench.main(args)
    if args.json:
        print(json.dumps(payload, sort_keys=True))
    return 0


def cmd_pipeline(args: argparse.Namespace) -> int:
    """One request through the real pipeline on the real kernel and /dev/shm."""
    from omnisim.pipeline_cli import run_pipeline

    payload = run_pipeline(args)
    if args.json:
        print(json.dumps(payload, sort_keys=True))
    return 0 if not payload["residue"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="omnisim", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="show the runtime's log")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(sp: argparse.ArgumentParser, *, scenario: bool = True) -> None:
        sp.add_argument(
            "--plugin",
            action="append",
            default=[],
            metavar="MODULE_OR_PATH",
            help="load scenarios or mutants from a module or .py file (repeatable)",
        )
        sp.add_argument("--json", action="store_true", help="end with one JSON object")
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--store", choices=STORES, default="memory")
        if scenario:
            sp.add_argument("--strategy", choices=ex.STRATEGIES, default="random")
            sp.add_argument("--mutant", help="apply a mutant (a re-created historic bug)")
            sp.add_argument(
                "--order",
                action="append",
                metavar="CONSTRAINT",
                help="an ordering for the ordered strategy, e.g. 'a[key=R_1_0] < b < c' (repeatable)",
            )

    sp = sub.add_parser("run", help="run one schedule of a scenario")
    sp.add_argument("scenario")
    common(sp)
    sp.add_argument("--trace", metavar="FILE", help="write the trace (JSON Lines)")
    sp.set_defaults(func=cmd_run)

    sp = sub.add_parser("explore", help="run many schedules; save the first failing one as an artifact")
    sp.add_argument("scenario", nargs="?")
    sp.add_argument("--all", action="store_true")
    common(sp)
    sp.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    sp.add_argument("--time", type=float, help="stop after this many seconds")
    sp.add_argument("--out", default="artifacts", help="where artifacts go (default: %(default)s)")
    sp.set_defaults(func=cmd_explore)

    sp = sub.add_parser("replay", help="re-run an artifact and compare its trace digest")
    sp.add_argument("artifact")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--plugin", action="append", default=[])
    sp.set_defaults(func=cmd_replay)

    sp = sub.add_parser("list", help="list scenarios, mutants, invariants or points")
    sp.add_argument("what", choices=("scenarios", "mutants", "invariants", "points"))
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--plugin", action="append", default=[])
    sp.set_defaults(func=cmd_list)

    sp = sub.add_parser("check", help="the main job: every scenario against the clean runtime; writes reports/latest/")
    common(sp, scenario=False)
    sp.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    sp.add_argument("--out", default=REPORT_DIR)
    sp.set_defaults(func=cmd_check)

    sp = sub.add_parser("mutants", help="the detection table: every mutant against its scenarios")
    common(sp, scenario=False)
    sp.add_argument("--budget", type=int, default=2000)
    sp.add_argument("--mutant", action="append", help="only these mutants")
    sp.add_argument(
        "--strategy",
        action="append",
        choices=ex.STRATEGIES,
        help="only these strategies (repeatable; default: random, and ordered where a scenario declares an order)",
    )
    sp.add_argument("--time-limit", type=float, help="seconds per mutant, scenario and strategy")
    sp.add_argument("--out", default=REPORT_DIR)
    sp.set_defaults(func=cmd_mutants)

    sp = sub.add_parser("bench", help="benchmarks: schedules per second, the pipeline, the connector against upstream")
    sp.add_argument("what", choices=("schedules", "pipeline", "connector", "all"), nargs="?", default="all")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--seconds", type=float, default=3.0, help="time per scenario for the schedule benchmark")
    sp.add_argument("--sizes", default="6.4KB,1MiB,16MiB,128MiB")
    sp.add_argument("--reps-scale", type=float, default=1.0)
    sp.add_argument("--runs", type=int, default=5, help="requests each way for the pipeline benchmark")
    sp.add_argument("--upstream", action="store_true", help="also time upstream's connector (needs its wheel)")
    sp.set_defaults(func=cmd_bench, plugin=[])
    sp = sub.add_parser("pipeline", help="run the real pipeline (real kernel, /dev/shm, torch models)")
    psub = sp.add_subparsers(dest="pipeline_command", required=True, parser_class=_Parser)
    sp = psub.add_parser("run", help="one request: text and audio out, a WAV written")
    sp.add_argument("--text", required=True)
    sp.add_argument("--modalities", default="text,audio")
    sp.add_argument("--out", default="out.wav", help="the 24 kHz WAV to write (default: %(default)s)")
    sp.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    sp.add_argument("--word-timestamps", action="store_true")
    sp.add_argument("--async-chunk", choices=("on", "off"), default="on")
    sp.add_argument("--store", choices=STORES, default="posix")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_pipeline, plugin=[])
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.CRITICAL, format="%(levelname)s %(name)s: %(message)s"
        )
        registry.load(args.plugin)
        handler: Callable[[argparse.Namespace], int] = args.func
        return handler(args)
    except UsageError as e:
        print(f"omnisim: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
