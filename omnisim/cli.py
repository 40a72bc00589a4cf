"""The ``omnisim`` command line.

Exit status, for every verb:

====  =======================================================================================
0     every invariant held (``replay``: the recorded run was clean and replays the same)
1     a violation was found (``replay``: the recorded violation reproduces); a request failed
2     a usage or environment error, reported in one line on stderr before any work starts
3     ``replay`` only: the run does not reproduce (its trace differs from the recorded one)
4     omnisim itself failed (a bug): one line on stderr; ``-v`` shows the traceback
130   stopped by Ctrl-C (SIGINT), after printing what ran so far; 143 for SIGTERM
====  =======================================================================================

With ``--json`` the last line printed is one JSON object (``{"error": …}`` for a command that
failed after it started). ``-v`` (anywhere on the line) shows the runtime's log and the traceback
of an unexpected error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

from omnisim.base import (
    ENGINE_STORES,
    STORES,
    CommandFailed,
    UsageError,
    is_interrupt,
    stop_requested,
    writable_dir,
    writable_file,
)

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

    from omnisim.progress import Sofar

DEFAULT_BUDGET = 200
#: A search runs until it has tried every schedule within its bound: that is its proof.
DFS_BUDGET = 1_000_000
#: ``check`` runs this share of its schedules twice, comparing the traces (determinism is a feature).
CHECK_DETERMINISM_EVERY = 20
REPORT_DIR = "reports/latest"
#: Everything a command generates by default lands under this (git-ignored) folder.
RUNS_DIR = "runs"
ARTIFACT_DIR = os.path.join(RUNS_DIR, "artifacts")
STRATEGIES = ("random", "pct", "ordered", "hypothesis", "dfs")

EXIT_OK, EXIT_VIOLATION, EXIT_USAGE, EXIT_NOT_REPRODUCED, EXIT_INTERNAL = 0, 1, 2, 3, 4
EXIT_SIGINT, EXIT_SIGTERM = 130, 143
EXIT_SIGPIPE = 141  # as a shell reports a command killed by SIGPIPE (`omnisim mutate --list | head`)


# == arguments ====================================================================================


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # argparse would print the usage and exit 2 itself
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def positive_int(text: str) -> int:
    return _whole_number(text, least=1)


def non_negative_int(text: str) -> int:
    return _whole_number(text, least=0)


def _whole_number(text: str, *, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def _stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a stop string cannot be empty (it would be found everywhere)")
    return text


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, like 1,4,10, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be at least 1, got {text!r}")
    return values


def _sampled(text: str) -> str:
    if text.partition(":")[0] != "sampled":
        raise argparse.ArgumentTypeError(f"expected sampled or sampled:KIND,KIND…, not {text!r}")
    return text


def _port(text: str) -> int:
    port = _whole_number(text, least=0)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, not {port}")
    return port


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a probability is 0..1, not {text}")
    return value


class _ParamAction(argparse.Action):
    """``--param NAME=VALUE``, repeatable, collected into a dict."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: object, _: object = None
    ) -> None:
        name, sep, val = str(value).partition("=")
        if not sep or not name:
            raise UsageError(f"--param wants NAME=VALUE, got {value!r}")
        setattr(namespace, self.dest, {**getattr(namespace, self.dest), name: val})


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def _add_plugin(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE_OR_PATH",
        help="load scenarios or mutants from a module or .py file (repeatable)",
    )


def _add_json(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--json", action="store_true", help="end with one JSON object (and show no live progress)")


def _add_run_options(sp: argparse.ArgumentParser, *, store_default: str | None = "memory") -> None:
    _add_plugin(sp)
    _add_json(sp)
    sp.add_argument("--seed", type=int, default=0, help="the first schedule's seed (default: %(default)s)")
    sp.add_argument(
        "--store",
        choices=STORES,
        default=store_default,
        help="where chunks live: in memory, in real POSIX shared memory in /dev/shm, or there with a small ring "
        "per stage edge for the chunks that fit on it"
        + (" (default: %(default)s)" if store_default else " (default: all three)"),
    )


def _add_jobs(sp: argparse.ArgumentParser, *, ray: bool = False) -> None:
    where = sp.add_mutually_exclusive_group()  # (processes here, or a Ray cluster's: not both)
    where.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        metavar="N",
        help="run the explorations in N processes (the results are the same for any N; default: %(default)s)",
    )
    sp.add_argument(
        "--shard",
        type=shard,
        default=(0, 1),
        metavar="I/N",
        help="only the I-th of N equal shares of the work (0 ≤ I < N), for a CI matrix: "
        "the N shards together run exactly what one run without --shard does",
    )
    if ray:
        where.add_argument(
            "--ray",
            metavar="ADDRESS",
            help="run the explorations as tasks on a Ray cluster (`local`: start one on this machine; or an "
            "address for ray.init, like `auto`), with the same results; Ray is an optional extra",
        )


def shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise argparse.ArgumentTypeError(f"a shard is I/N with 0 ≤ I < N, like 0/4, not {text!r}")
    return int(index), int(count)


def _add_faults(sp: argparse.ArgumentParser, named: str, sampled: str) -> None:
    """``--fault`` (help ``named``) and ``--faults sampled`` (help ``sampled``), both collected in
    ``args.fault`` as the specs :func:`omnisim.faults.faults_of_specs` reads."""
    sp.add_argument("--fault", action="append", default=[], metavar="KIND[@NAME=VALUE,...][#N]", help=named)
    sp.add_argument(
        "--faults", action="append", dest="fault", type=_sampled, metavar="sampled[:KIND,...]", help=sampled
    )


#: What one run can be scheduled by (dfs and hypothesis are searches across runs).
RUN_STRATEGIES = ("random", "pct", "ordered")


def _add_engine_options(sp: argparse.ArgumentParser, *, store: bool = True) -> None:
    """What the commands that build a real engine (``serve``, ``pipeline run``, ``soak``) build it from."""
    sp.add_argument("--pipeline", default="qwen3_omni", help="a shipped pipeline or a YAML path (default: %(default)s)")
    sp.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the models run")
    sp.add_argument(
        "--async-chunk",
        choices=("on", "off"),
        help="chunked hand-off between stages, or whole (default: the deploy file's, on)",
    )
    sp.add_argument(
        "--transport",
        choices=("ring", "segments"),
        help="how every edge hands chunks over: a shared ring per edge for the chunks that fit, or a segment per "
        "chunk (default: the deploy file's, ring)",
    )
    if store:
        sp.add_argument(
            "--store", choices=ENGINE_STORES, default="posix", help="where segments live (default: %(default)s)"
        )
    needs = " (needs --store posix)" if store else ""
    sp.add_argument(
        "--processes",
        action="store_true",
        help=f"each stage in an OS process of its own{needs} (default: the deploy file's, in this one)",
    )


def _add_scenario_options(sp: argparse.ArgumentParser, strategies: tuple[str, ...] = STRATEGIES) -> None:
    sp.add_argument(
        "--strategy",
        choices=strategies,
        default="random",
        help="how schedules are chosen (default: %(default)s)"
        + ("" if strategies == STRATEGIES else "; dfs and hypothesis search across runs: `omnisim explore`"),
    )
    sp.add_argument("--mutant", help="apply a mutant (a re-created historic bug; `omnisim list mutants`)")
    _add_faults(
        sp,
        "inject a fault in every run, besides the scenario's own (repeatable): KIND at its point, on the "
        "N-th hit whose attributes match, e.g. put_fail@key=R_0_3 or decode_fail#2 (`omnisim list faults`)",
        "BUGGIFY: in each run, every KIND (default: the storage failures) is active with probability 1/2 "
        "and, if active, fires on each hit with probability 1/5, drawn from the run's seed (so replay repeats it)",
    )
    sp.add_argument(
        "--order",
        action="append",
        metavar="CONSTRAINT",
        help="an ordering for the ordered strategy, e.g. 'a[key=R_1_0] < b < c' over the names of "
        "`omnisim list points` (repeatable)",
    )
    sp.add_argument(
        "--param",
        action=_ParamAction,
        default={},
        metavar="NAME=VALUE",
        help="fix one parameter of the scenario's configuration (repeatable; `omnisim list scenarios` shows "
        "them); unfixed ones are walked through, one configuration per seed",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="omnisim", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="show the runtime's log and tracebacks")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    sp = sub.add_parser(
        "check",
        help="the main job: every scenario, every strategy, every store, against the clean runtime",
        description="Explore every scenario with the random walk and PCT on every store (and each scenario's "
        "ordering, if it declares one) against the clean runtime; write a report; exit 1 on any violation.",
        epilog=_examples("omnisim check", "omnisim check --budget 50 --store memory", "omnisim check --jobs 2"),
    )
    _add_run_options(sp, store_default=None)
    _add_jobs(sp, ray=True)
    sp.add_argument(
        "--budget",
        type=positive_int,
        default=DEFAULT_BUDGET,
        help="schedules per scenario for the random walk on the memory store; the others get a share "
        "(default: %(default)s)",
    )
    sp.add_argument("--out", default=REPORT_DIR, help="where the report goes (default: %(default)s)")
    sp.set_defaults(func=cmd_check, needs_registry=True)

    sp = sub.add_parser(
        "run",
        help="run one schedule of a scenario",
        description="Run one schedule of SCENARIO and check its invariants.",
        epilog=_examples(
            "omnisim run abort_during_put --seed 3",
            "omnisim run pipeline_requests --param async_chunk=off --store posix --json",
        ),
    )
    sp.add_argument("scenario", help="a scenario name (`omnisim list scenarios`)")
    _add_run_options(sp)
    _add_scenario_options(sp, RUN_STRATEGIES)
    sp.add_argument("--trace", metavar="FILE", help="write the run's trace (JSON Lines) to FILE")
    sp.set_defaults(func=cmd_run, needs_registry=True)

    sp = sub.add_parser(
        "explore",
        help="run many schedules; save the first failing one as an artifact",
        description="Run up to --budget schedules of a scenario (or of every scenario with --all), seeds "
        "--seed, --seed+1, ...; stop at the first violation and save it as a replayable artifact.",
        epilog=_examples(
            "omnisim explore id_reuse_after_cancel --strategy pct --budget 200",
            "omnisim explore similar_ids --mutant prefix_cleanup --budget 50",
            "omnisim explore id_reuse_after_cancel --strategy dfs --delays 2",
            "omnisim explore abort_during_put --strategy dfs --preemptions 2 --mutant cleanup_waits_for_io",
            "omnisim explore --all --budget 100 --json",
        ),
    )
    sp.add_argument("scenario", nargs="?", help="a scenario name (`omnisim list scenarios`)")
    sp.add_argument("--all", action="store_true", help="explore every scenario")
    _add_jobs(sp, ray=True)
    _add_run_options(sp)
    _add_scenario_options(sp)
    sp.add_argument(
        "--budget",
        type=positive_int,
        help=f"schedules per scenario (default: {DEFAULT_BUDGET}; dfs: until its bounded space is exhausted, "
        f"at most {DFS_BUDGET:,})",
    )
    sp.add_argument("--time", type=positive_float, metavar="SECONDS", help="stop each scenario after this long")
    bound = sp.add_mutually_exclusive_group()
    bound.add_argument(
        "--delays",
        type=non_negative_int,
        metavar="N",
        help="dfs: every schedule that strays at most N from the default one, taking a decision's k-th "
        "candidate costing k (default: 2)",
    )
    bound.add_argument(
        "--preemptions",
        type=non_negative_int,
        metavar="N",
        help="dfs: every schedule that makes at most N choices the default would not make, whichever task each "
        "takes (more schedules than --delays N, and bugs that need a switch to a task far down the order)",
    )
    sp.add_argument(
        "--check-determinism",
        type=positive_int,
        metavar="N",
        default=0,
        help="run every N-th schedule twice; traces that differ are a 'deterministic' violation",
    )
    sp.add_argument(
        "--hypothesis-db",
        default=os.path.join(RUNS_DIR, "hypothesis"),
        metavar="DIR",
        help="`hypothesis`: its example database (a failing schedule found before is tried first; "
        "default: %(default)s; '' for none)",
    )
    sp.add_argument(
        "--no-shrink",
        dest="shrink",
        action="store_false",
        help="save a find as found (by default a random, PCT or ordered find is shrunk to the fewest "
        "deviations from the default schedule, added faults and requests that still fail)",
    )
    sp.add_argument("--out", default=ARTIFACT_DIR, help="where artifacts go (default: %(default)s)")
    sp.set_defaults(func=cmd_explore, needs_registry=True)

    sp = sub.add_parser(
        "replay",
        help="re-run an artifact and compare its trace",
        description="Re-run an artifact's schedule. Exit 1 if its violation reproduces, 0 if a clean run "
        "replays clean, 3 if the run does not reproduce (the first diverging event is named).",
        epilog=_examples(
            "omnisim replay runs/artifacts/similar_ids-prefix_cleanup-memory-random-seed0.json",
            "omnisim replay --check runs/artifacts/similar_ids-prefix_cleanup-memory-random-seed0.json",
        ),
    )
    sp.add_argument("artifact", help="an artifact .json written by explore")
    sp.add_argument(
        "--check",
        action="store_true",
        help="run the schedule again, here and in a fresh process with another string-hash seed: exit 3 and "
        "name the first diverging event if a trace differs",
    )
    _add_json(sp)
    _add_plugin(sp)
    sp.set_defaults(func=cmd_replay, needs_registry=True)

    sp = sub.add_parser(
        "mutants",
        help="the detection table: every mutant against its scenarios",
        description="Explore each mutant (a re-created historic bug) against the scenarios it names, by "
        "strategy, and write the detection table; exit 1 if a mutant was not found.",
        epilog=_examples("omnisim mutants --budget 2000", "omnisim mutants --mutant prefix_cleanup --strategy pct"),
    )
    _add_run_options(sp)
    sp.add_argument(
        "--budget", type=positive_int, default=2000, help="schedules per mutant and strategy (default: %(default)s)"
    )
    sp.add_argument("--mutant", action="append", help="only these mutants (repeatable)")
    sp.add_argument(
        "--strategy",
        action="append",
        choices=STRATEGIES,
        help="only these strategies (repeatable; default: random, and ordered where a scenario declares an order)",
    )
    sp.add_argument("--time-limit", type=positive_float, help="seconds per mutant, scenario and strategy")
    sp.add_argument("--out", default=REPORT_DIR, help="where the table goes (default: %(default)s)")
    sp.set_defaults(func=cmd_mutants, needs_registry=True)

    sp = sub.add_parser(
        "mutate",
        help="the mutation score: systematic slips in the runtime's source against the scenario sweep",
        description="Mutate the runtime's source one slip at a time (a deleted call, a negated or off-by-one "
        "comparison, swapped arguments, a removed lock, …), run the scenarios that execute the slip, and "
        "report the score per module with every surviving mutant as a diff; exit 1 if any survives.",
        epilog=_examples(
            "omnisim mutate runtime/transfer",
            "omnisim mutate runtime/connectors runtime/transfer --jobs 2",
            "omnisim mutate runtime/connectors/keys.py --list",
            "omnisim mutate runtime/connectors/wire.py --operator boundary --scenario corrupt_chunk",
        ),
    )
    _add_plugin(sp)
    _add_json(sp)
    _add_jobs(sp)
    sp.add_argument(
        "target",
        nargs="*",
        help="runtime files or folders to mutate (default: the runtime's connectors and transfer, wherever "
        "omnisim runs from)",
    )
    sp.add_argument(
        "--budget",
        type=positive_int,
        default=12,
        help="random schedules per scenario and store, and half as many PCT (default: %(default)s)",
    )
    sp.add_argument("--seed", type=int, default=0, help="the first schedule's seed (default: %(default)s)")
    sp.add_argument(
        "--time-limit",
        type=positive_float,
        default=120.0,
        help="seconds a mutant may run beyond twice its plans' time on the clean runtime before it counts as a "
        "hang (default: %(default)s)",
    )
    sp.add_argument("--operator", action="append", help="only these operators (repeatable; `--list` shows them)")
    sp.add_argument("--scenario", action="append", help="only these scenarios (repeatable; default: all)")
    sp.add_argument("--id", action="append", help="only the mutants with these ids (repeatable; see --list)")
    sp.add_argument("--limit", type=positive_int, help="only the first N mutants")
    sp.add_argument("--list", action="store_true", help="list the mutants and stop")
    sp.add_argument("--out", default=REPORT_DIR, help="where the report goes (default: %(default)s)")
    sp.set_defaults(func=cmd_mutate, needs_registry=True)

    sp = sub.add_parser(
        "report",
        help="one self-contained HTML page for a campaign and its failing runs",
        description="Write one HTML page (no script, no external file) from report folders (check.json, "
        "mutants.json, mutation.json) and artifacts: the explorations, the mutant detection table by strategy, "
        "the mutation score with its survivors, and a timeline of each failing run.",
        epilog=_examples(
            "omnisim report",
            "omnisim report reports/latest runs/artifacts/abort_during_put-clean-memory-random-seed3.json",
        ),
    )
    sp.add_argument(
        "source", nargs="*", default=[REPORT_DIR], help=f"report folders or artifacts (default: {REPORT_DIR})"
    )
    sp.add_argument(
        "-o", "--out", default=os.path.join(REPORT_DIR, "index.html"), help="the page (default: %(default)s)"
    )
    sp.set_defaults(func=cmd_report, needs_registry=False)

    sp = sub.add_parser(
        "trace",
        help="export a run's trace for other viewers",
        description="Export an artifact's trace. --perfetto writes the Chrome trace event format, which "
        "ui.perfetto.dev and chrome://tracing open: one thread per task, a slice per wait.",
        epilog=_examples("omnisim trace export --perfetto runs/artifacts/RUN.json -o run.perfetto.json"),
    )
    trace_sub = sp.add_subparsers(dest="trace_command", required=True, parser_class=_Parser, metavar="ACTION")
    tp = trace_sub.add_parser(
        "export",
        help="write the trace in another format",
        description="Write an artifact's trace in the Chrome trace event format (--perfetto).",
        epilog=_examples("omnisim trace export --perfetto runs/artifacts/RUN.json -o run.perfetto.json"),
    )
    tp.add_argument("artifact", help="an artifact (.json) saved by run or explore")
    tp.add_argument("--perfetto", action="store_true", required=True, help="the Chrome/Perfetto trace format")
    tp.add_argument("-o", "--out", help="where to write (default: beside the artifact, .perfetto.json)")
    tp.set_defaults(func=cmd_trace_export, needs_registry=False)

    sp = sub.add_parser(
        "list",
        help="list scenarios (with their parameters), mutants, invariants or points",
        epilog=_examples("omnisim list scenarios", "omnisim list points --json"),
    )
    sp.add_argument("what", choices=("scenarios", "mutants", "invariants", "points", "faults"), help="what to list")
    _add_json(sp)
    _add_plugin(sp)
    sp.set_defaults(func=cmd_list, needs_registry=False)

    sp = sub.add_parser(
        "bench",
        help="benchmarks: schedules per second, the pipeline, the connector against upstream",
        description="Benchmarks print figures; they assert nothing about time.",
        epilog=_examples("omnisim bench schedules --seconds 4", "omnisim bench connector --upstream"),
    )
    sp.add_argument(
        "what",
        choices=("schedules", "pipeline", "connector", "pages", "reuse", "serve", "all"),
        nargs="?",
        default="all",
        help="which benchmark (default: %(default)s; `serve` needs a running `omnisim serve` and is not in `all`; "
        "`pages`, a large chunk's page costs next to their alternatives, is not in `all` either)",
    )
    _add_json(sp)
    sp.add_argument("--seconds", type=positive_float, default=3.0, help="time per scenario for `schedules`")
    sp.add_argument("--sizes", default="6.4KB,1MiB,16MiB,128MiB", help="payload sizes for `connector`")
    sp.add_argument("--reps-scale", type=positive_float, default=1.0, help="scale the connector's repetitions")
    sp.add_argument("--runs", type=positive_int, default=5, help="requests each way for `pipeline`")
    sp.add_argument("--processes", action="store_true", help="`pipeline`: each stage in an OS process of its own")
    sp.add_argument("--requests", type=positive_int, default=200, help="requests for `reuse`")
    sp.add_argument("--concurrency", type=positive_int, default=8, help="requests at a time for `reuse`")
    sp.add_argument(
        "--upstream",
        action="store_true",
        help="also time upstream vLLM-Omni's connector (see --upstream-script)",
    )
    sp.add_argument(
        "--upstream-script",
        metavar="PATH",
        help="the upstream timing script (default: shared/bench/upstream_shm.py next to or inside this checkout)",
    )
    sp.add_argument("--url", default="http://127.0.0.1:8000", help="`serve`: the server (default: %(default)s)")
    sp.add_argument(
        "--concurrencies", type=_int_list, default=[1, 4, 10], help="`serve`: requests at a time (default: 1,4,10)"
    )
    sp.add_argument("--prompts", type=positive_int, help="`serve`: requests per concurrency (default: twice it)")
    sp.add_argument("--timeout", type=positive_float, default=300.0, help="`serve`: seconds per request")
    sp.set_defaults(func=cmd_bench, needs_registry=True, plugin=[])

    sp = sub.add_parser(
        "serve",
        help="the OpenAI-compatible server (chat completions with audio, speech over SSE and WebSocket)",
        description="Serve the pipeline over HTTP with vLLM-Omni's serving contract: POST /v1/chat/completions, "
        "POST /v1/audio/speech (SSE or raw streaming, word timestamps), WS /v1/audio/speech/stream, GET /v1/models, "
        "/health, /metrics, and a page at / that speaks what you type. Ctrl-C or SIGTERM stops it gracefully "
        "(a background job of a script is started with SIGINT ignored, as every such job: stop it with SIGTERM).",
        epilog=_examples(
            "omnisim serve",
            "omnisim serve --port 8001 --processes",
            'curl -N localhost:8000/v1/audio/speech -d \'{"input": "hello", "stream": true}\'',
        ),
    )
    _add_engine_options(sp)
    sp.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    sp.add_argument("--port", type=_port, default=8000, help="the port; 0 picks a free one (default: %(default)s)")
    sp.add_argument("--served-model-name", help="the model name clients use (default: the pipeline's name)")
    sp.add_argument("--ready-timeout", type=positive_float, default=120.0, help="seconds to wait for the stages")
    sp.add_argument("--access-log", action="store_true", help="log every request to stderr")
    sp.set_defaults(func=cmd_serve, needs_registry=False, plugin=[])

    sp = sub.add_parser(
        "sweep",
        help="remove what dead omnisim processes left in /dev/shm",
        description="Remove every omnisim namespace in /dev/shm whose owner process is dead (its pid is gone, or "
        "belongs to a newer process): segments, lock files, wakeup folders, owner records. A live owner's "
        "namespace, one whose owner cannot be judged (another pid namespace), names that are not ours and "
        "ownerless names younger than a minute are left alone and listed.",
        epilog=_examples("omnisim sweep --dry-run", "omnisim sweep --json"),
    )
    sp.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    _add_json(sp)
    sp.set_defaults(func=cmd_sweep, needs_registry=False, plugin=[])

    sp = sub.add_parser(
        "soak",
        help="many requests through the real engine, with aborts, reused ids and killed stages",
        description="Send --requests requests through the real engine, --concurrency at a time: about 15% are "
        "aborted at a random moment, about 10% reuse an id right after it ended, and with --kill-every a random "
        "stage process is SIGKILLed that often; with --fault or --faults the puts and gets meet injected storage "
        "and decode failures. Every request is checked (one terminal; a finished one's audio equals its text run "
        "alone; a failed one failed for a death or a fault that struck it); at the end nothing may be left. Exit 1 "
        "on any problem.",
        epilog=_examples(
            "omnisim soak --processes --requests 300 --concurrency 8 --kill-every 5",
            "omnisim soak --requests 1000",
            "omnisim soak --requests 300 --faults sampled --fault-probability 0.005",
        ),
    )
    sp.add_argument("--requests", type=positive_int, default=300, help="how many requests (default: %(default)s)")
    sp.add_argument("--concurrency", type=positive_int, default=8, help="requests at a time (default: %(default)s)")
    _add_engine_options(sp, store=False)
    sp.add_argument("--kill-every", type=positive_float, metavar="SECONDS", help="SIGKILL a random stage this often")
    sp.add_argument(
        "--seed", type=int, default=0, help="for the aborts, reuses, kills and faults (default: %(default)s)"
    )
    _add_faults(
        sp,
        "inject a fault that raises into the connectors' puts and gets, on the N-th hit of its point whose "
        "attributes match (repeatable; stages in this process only; `omnisim list faults`)",
        "BUGGIFY: every KIND (default: the storage failures) is active with probability 1/2 (drawn from --seed) "
        "and, if active, fires on each hit with --fault-probability",
    )
    sp.add_argument(
        "--fault-probability",
        type=_probability,
        default=0.001,
        metavar="P",
        help="how often an active sampled fault fires on a hit of its point (default: %(default)s; a request makes "
        "about a hundred puts and gets)",
    )
    _add_json(sp)
    sp.set_defaults(func=cmd_soak, needs_registry=False, plugin=[])

    sp = sub.add_parser(
        "pipeline",
        help="run the real pipeline (real kernel, /dev/shm, torch models)",
        description="Run the real pipeline: Thinker → Talker → Code2Wav on the real kernel, /dev/shm and torch models.",
        epilog=_examples('omnisim pipeline run --text "hello world"', "omnisim pipeline run --help"),
    )
    psub = sp.add_subparsers(dest="pipeline_command", required=True, parser_class=_Parser, metavar="COMMAND")
    sp = psub.add_parser(
        "run",
        help="one request: text and audio out, a WAV written",
        description="Send one request through Thinker → Talker → Code2Wav on the real kernel and /dev/shm; "
        "print the text, write a 24 kHz WAV, report the timings and that nothing was left behind. "
        "Exit 1 if the request failed.",
        epilog=_examples(
            'omnisim pipeline run --text "hello world"',
            'omnisim pipeline run --text "hello world" --word-timestamps --out runs/hello.wav',
            'omnisim pipeline run --text "a long answer, cut short" --max-tokens 4',
            'omnisim pipeline run --text "first this. then that" --stop . --stop !',
        ),
    )
    sp.add_argument("--text", required=True, help="what to say (1 to 20000 characters, not only spaces)")
    sp.add_argument("--modalities", default="text,audio", help="text, audio or text,audio (default: %(default)s)")
    sp.add_argument(
        "--out", default=os.path.join(RUNS_DIR, "out.wav"), help="the 24 kHz WAV to write (default: %(default)s)"
    )
    sp.add_argument("--word-timestamps", action="store_true", help="also align every word (needs audio)")
    sp.add_argument(
        "--max-tokens",
        type=positive_int,
        metavar="N",
        help="the most tokens the answer may have, as vLLM's max_tokens (default: as many as it takes)",
    )
    sp.add_argument(
        "--stop",
        action="append",
        type=_stop_string,
        metavar="STRING",
        help="end the answer before the first of these strings in it, as vLLM's stop (repeatable)",
    )
    _add_engine_options(sp)
    _add_json(sp)
    sp.set_defaults(func=cmd_pipeline, needs_registry=False, plugin=[])
    return p


# == commands =====================================================================================


def _emit(args: argparse.Namespace, human: list[str], payload: dict[str, Any]) -> None:
    for line in human:
        print(line)
    if args.json:
        print(json.dumps(payload, sort_keys=True))


def _violations_text(violations: list[dict[str, str]]) -> list[str]:
    return [f"  VIOLATION {v['invariant']}: {v['message']}" for v in violations]


def _check_order(constraints: list[str] | None) -> None:
    """Every event an ordering names must exist (``omnisim list points``)."""
    from omnisim.points import POINTS
    from omnisim.strategies.ordered import parse_chain

    for constraint in constraints or []:
        for pattern in parse_chain(constraint):
            if pattern.name not in POINTS:
                raise UsageError(
                    f"the ordering names {pattern.name!r}, which is no point or note (`omnisim list points`)"
                )


def cmd_run(args: argparse.Namespace) -> int:
    from omnisim import explore as ex

    _check_order(args.order)
    if args.trace:
        writable_file(args.trace)
    res = ex.run(
        args.scenario,
        seed=args.seed,
        strategy=args.strategy,
        store=args.store,
        mutant=args.mutant,
        constraints=args.order,
        params=args.param,
        faults=args.fault,
    )
    if args.trace:
        with open(args.trace, "w") as f:
            f.writelines(line + "\n" for line in res.trace_lines)
    summary = res.summary()
    config = "".join(f" {k}={v}" for k, v in res.params.items())
    human = [
        f"{res.scenario}{config} seed={res.seed} strategy={summary['strategy']} store={res.store} "
        f"mutant={res.mutant}: {len(res.trace_lines)} events, {res.steps} steps, {res.virtual_time_s:g}s virtual, "
        f"digest {res.trace_digest[:16]}",
        *_violations_text(summary["violations"]),
        *[f"  UNSATISFIED {u}" for u in res.unsatisfied],
    ]
    if not res.violations:
        human.append("  all invariants held")
    _emit(args, human, summary)
    return EXIT_VIOLATION if res.violations else EXIT_OK


def explore_lines(s: dict[str, Any]) -> list[str]:
    """The lines printed for one finished (or interrupted) exploration."""
    faults = f", faults={'+'.join(s['faults'])}" if s.get("faults") else ""
    head = (
        f"{s['scenario']} [{s['strategy']}, {s['store']}, mutant={s['mutant']}{faults}]: {s['schedules']} schedules, "
        f"{s['schedules_per_s']}/s"
    )
    if s["unsatisfied_runs"]:
        head += f", {s['unsatisfied_runs']} runs could not meet the ordering"
    if s.get("interrupted"):
        head += " (interrupted)"
    lines = [head]
    wanted = s.get("wanted")
    for v in s["violations"]:
        if v.get("clean_too"):  # the scenario's find, not the mutant's
            when = f"BROKEN: the runtime without the mutant trips {', '.join(v['clean_too'])} too"
        elif wanted is None or any(found["invariant"] in wanted for found in v["violations"]):
            when = f"after {s['first_violation_after']} schedules"
        else:  # breakage, not a detection: none of the invariants the mutant declares
            when = f"BROKEN: trips none of its mutant's {', '.join(wanted)}"
        lines.append(f"  seed {v['seed']} ({when}): artifact {v.get('artifact')}")
        if "shrunk" in v:
            shrunk = v["shrunk"]
            line = (
                f"  shrunk in {shrunk['runs']} runs: {shrunk['preemptions_before']} → {shrunk['preemptions']} "
                f"preemptions, {shrunk['deviations_before']} → {shrunk['deviations']} deviations from the default"
            )
            if shrunk.get("faults_before"):  # none fired, or a summary from before faults were shrunk
                line += f", {shrunk['faults_before']} → {shrunk['faults']} faults"
            if shrunk.get("clients_before"):  # a scenario without clients (requests it may leave out)
                line += f", {shrunk['clients_before']} → {shrunk['clients']} requests"
            lines.append(line)
        lines.extend(_violations_text(v["violations"][:5]))
        if len(v["violations"]) > 5:
            lines.append(f"  … and {len(v['violations']) - 5} more (all in the artifact, and with --json)")
    if not s["violations"]:
        lines.append("  no violation")
    if s.get("exhausted"):
        lines.append(f"  bounded space exhausted: {s['schedules']} schedules")
    return lines


#: What a command that explores has finished so far, for the summary an interrupt prints.
_progress: list[Any] = []

#: In a worker: where it reports what it has run so far (a process pool's queue or a Ray queue;
#: set by :func:`report_sofar_to`; empty when nothing is live).
_sofar: list[SimpleQueue[tuple[int, Sofar]]] = []


@contextmanager
def _tracked(progress: Any) -> Iterator[Any]:
    _progress.append(progress)
    try:
        yield progress
    finally:
        progress.close_bar()


def _explore_all(args: argparse.Namespace, jobs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Run explorations one after the other with a progress display; their summaries."""
    from omnisim import explore as ex
    from omnisim.progress import Progress

    index, count = args.shard
    if not jobs[index::count]:
        print(f"omnisim: shard {index}/{count} has none of the {len(jobs)} exploration(s) to run", file=sys.stderr)
    jobs = jobs[index::count]
    with _tracked(Progress.for_command(explore_lines, json_output=args.json)) as progress:
        progress.plan([kwargs["budget"] for _, kwargs in jobs])
        if args.ray:
            from omnisim.ray_campaign import explore_on_ray

            budgets = iter([kwargs["budget"] for _, kwargs in jobs])

            def report(summary: dict[str, Any]) -> None:
                progress.done(summary, next(budgets))

            explore_on_ray(args.ray, jobs, report, args.plugin, progress.campaign_bar())
            return progress.finished
        if args.jobs > 1:
            _explore_in_processes(args.jobs, jobs, progress, args.plugin)
            return progress.finished
        for scenario, kwargs in jobs:
            faults = f", faults={'+'.join(kwargs['faults'])}" if kwargs.get("faults") else ""
            label = f"{scenario} [{kwargs.get('strategy', 'random')}, {kwargs.get('store', 'memory')}{faults}]"
            on_schedule = progress.start(label, kwargs["budget"])
            try:
                res = ex.explore(scenario, on_schedule=on_schedule, **kwargs)
            except ex.Interrupted as stop:
                progress.done(stop.partial.summary())
                raise
            progress.done(res.summary(), kwargs["budget"])
        return progress.finished


def _explore_in_processes(
    processes: int, jobs: list[tuple[str, dict[str, Any]]], progress: Any, plugins: list[str]
) -> None:
    """The explorations of ``jobs`` on a pool of ``processes`` (spawned, each with its own trio
    loop and simulator). Each exploration is deterministic and independent, so the results are
    those of one process; they are reported in the jobs' order. On Ctrl-C or SIGTERM the workers
    are told to stop (SIGTERM: each abandons its schedule in progress and removes what it made)
    and what they ran is reported before the interrupt goes on up."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
    from multiprocessing import resource_tracker

    from omnisim.progress import LIVE_EVERY_S

    context = multiprocessing.get_context("spawn")
    live = progress.campaign_bar()
    # The workers are started by the first submits, and are born ignoring Ctrl-C (an ignored
    # signal stays ignored across exec): one pressed while they import would end them with a
    # traceback each, before their initializer could say the parent decides. And CPython's
    # resource tracker (which the pool's queues need) unblocks SIGINT and SIGTERM in this thread
    # as it starts: it is started first and the mask put back (_Signals may block SIGINT), so
    # that the pool's threads are born with it.
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        try:
            resource_tracker.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # Workers report what they have run so far here, for the live bar (a SimpleQueue: no feeder thread).
        sofar = context.SimpleQueue() if live is not None else None
        pool = ProcessPoolExecutor(
            processes,
            mp_context=context,
            initializer=init_worker,
            initargs=(plugins, logging.getLogger().level, sofar),
        )
        futures: list[Future[dict[str, Any]]] = [
            pool.submit(explore_job, scenario, kwargs, i) for i, (scenario, kwargs) in enumerate(jobs)
        ]
    finally:
        signal.signal(signal.SIGINT, handler)
    reported = 0

    def report_ready(*, stopping: bool = False) -> None:
        """Report the finished explorations that come next in the jobs' order. While stopping,
        one that never ran (cancelled, or its worker gone) ends the report."""
        nonlocal reported
        while sofar is not None and live is not None and not sofar.empty():
            live(*sofar.get())
        while reported < len(futures) and futures[reported].done():
            future = futures[reported]
            if stopping and (future.cancelled() or future.exception() is not None):
                return
            progress.done(future.result(), jobs[reported][1]["budget"])
            reported += 1

    try:
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=LIVE_EVERY_S if live else None, return_when=FIRST_COMPLETED)
            report_ready()
    except BaseException:
        # No future is cancelled: the jobs still queued stop at once as well (a stop is sticky in
        # a worker), and a pool broken by a worker that died while it started (SIGTERM) fails
        # its futures, which it cannot do to a cancelled one (it raises in its own thread).
        # The pool's own processes: the only handle on them that concurrent.futures gives.
        for worker in list(pool._processes.values()):
            if worker.is_alive() and worker.pid is not None:
                os.kill(worker.pid, signal.SIGTERM)
        wait([f for f in futures if not f.cancelled()], timeout=30)
        report_ready(stopping=True)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def init_worker(plugins: list[str], log_level: int, sofar: SimpleQueue[tuple[int, Sofar]] | None = None) -> None:
    """Make a worker process (of the pool, or of Ray) ready to explore: the plugins loaded, and
    where to report what each exploration has run so far (``sofar``: for a live bar)."""
    report_sofar_to(sofar)
    # Ctrl-C reaches the whole process group: the parent decides, and stops its workers with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    from omnisim import registry

    registry.load(plugins)


def report_sofar_to(sofar: SimpleQueue[tuple[int, Sofar]] | None) -> None:
    """Where this worker's explorations send what they have run so far (a process pool's queue,
    or a Ray queue, which has the same ``put``; None: nowhere)."""
    _sofar[:] = [sofar] if sofar is not None else []


class NotRun(Exception):
    """An exploration its worker was told to stop before it began (it ends the report)."""


def explore_job(scenario: str, kwargs: dict[str, Any], index: int = 0) -> dict[str, Any]:
    """One exploration in a worker: its summary (a partial one if it was stopped). What it has run
    so far goes to the worker's ``sofar`` queue, if it has one, at most every ``LIVE_EVERY_S``."""
    from omnisim import explore as ex
    from omnisim.progress import LIVE_EVERY_S, Sofar

    if stop_requested:  # the worker was told to stop before this job began: it never runs
        raise NotRun(scenario)
    sent = [0.0]

    def on_schedule(result: ex.ExploreResult, *, last: bool = False) -> None:
        now = time.monotonic()
        if _sofar and (last or now - sent[0] >= LIVE_EVERY_S):
            sent[0] = now
            _sofar[0].put((index, Sofar.of(result)))

    try:
        result = ex.explore(scenario, on_schedule=on_schedule, **kwargs)
        on_schedule(result, last=True)  # before the summary goes back: the bar counts all of it
        return result.summary()
    except ex.Interrupted as stop:
        return stop.partial.summary()


def cmd_explore(args: argparse.Namespace) -> int:
    from omnisim import registry

    if args.all == (args.scenario is not None):
        raise UsageError("give a SCENARIO or --all (not both)")
    _check_order(args.order)
    registry.get_mutant(args.mutant)
    names = sorted(registry.SCENARIOS) if args.all else [registry.get_scenario(args.scenario).name]
    if args.strategy == "ordered" and args.all and not args.order:
        names = [n for n in names if registry.SCENARIOS[n].constraints]
    if args.all:
        names = [n for n in names if not _left_out(registry.SCENARIOS[n], args.store)]
    if args.param:
        for name in names:
            registry.SCENARIOS[name].configurations(args.param)
    writable_dir(args.out)
    if args.strategy != "dfs" and (args.delays is not None or args.preemptions is not None):
        raise UsageError("--delays and --preemptions bound a dfs search: add --strategy dfs")
    if args.strategy == "hypothesis" and args.hypothesis_db:
        writable_dir(args.hypothesis_db)
    common = {
        "strategy": args.strategy,
        "budget": args.budget or (DFS_BUDGET if args.strategy == "dfs" else DEFAULT_BUDGET),
        "time_limit": args.time,
        "seed": args.seed,
        "store": args.store,
        "mutant": args.mutant,
        "out_dir": args.out,
        "plugins": args.plugin,
        "constraints": args.order,
        "params": args.param,
        "faults": args.fault,
        "determinism_every": args.check_determinism,
        "delays": 2 if args.delays is None else args.delays,
        "preemptions": args.preemptions,
        "shrink_finds": args.shrink,
        "hypothesis_db": args.hypothesis_db or None,
    }
    results = _explore_all(args, [(name, common) for name in names])
    payload = (
        results[0]
        if len(results) == 1
        else {"results": results, "violations": [v for s in results for v in s["violations"]]}
    )
    _emit(args, [], payload)
    return EXIT_VIOLATION if any(s["violations"] for s in results) else EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    from omnisim import explore as ex

    rr = ex.replay(args.artifact, plugins=args.plugin, check=args.check)
    summary = rr.run.summary() | {
        "nondeterminism": rr.nondeterminism,
        "reproduced": rr.reproduced,
        "expected_trace_digest": rr.expected_digest,
        "diverged_at_choice": rr.diverged_at,
        "first_difference": rr.first_difference,
    }
    if rr.reproduced:
        verdict = "reproduced: the violation again" if rr.run.violations else "reproduced: clean again"
    else:
        verdict = f"NOT reproduced (recorded digest {rr.expected_digest[:16]})"
    human = [
        f"replay of {args.artifact}: digest {rr.run.trace_digest[:16]}, {verdict}",
        *_violations_text(summary["violations"]),
    ]
    if rr.first_difference:
        human.append(
            f"  the replay departs from the recording: {rr.first_difference}. The code changed since, the artifact "
            "was edited (its scenario, seed, choices…), or the run is nondeterministic (`--check` tells)"
        )
    if args.check:
        human.append(
            f"  NONDETERMINISTIC: two runs of the same schedule part at {rr.nondeterminism}"
            if rr.nondeterminism
            else f"  deterministic: a second run here and one in a fresh process with another hash seed gave the same "
            f"{len(rr.run.trace_lines)} events"
        )
    _emit(args, human, summary)
    if not rr.reproduced or rr.nondeterminism:
        return EXIT_NOT_REPRODUCED
    return EXIT_VIOLATION if rr.run.violations else EXIT_OK


def cmd_list(args: argparse.Namespace) -> int:
    rows: list[tuple[str, str]]
    if args.what in ("scenarios", "mutants"):
        from omnisim import registry

        registry.load(args.plugin)
        if args.what == "scenarios":
            rows = [(s.name, s.describe()) for s in sorted(registry.SCENARIOS.values(), key=lambda s: s.name)]
        else:
            rows = [
                (m.name, f"{m.issue}: {m.summary}") for m in sorted(registry.MUTANTS.values(), key=lambda m: m.name)
            ]
    elif args.what == "invariants":
        from invariants import INVARIANTS

        if args.plugin:  # (a plugin may register invariants of its own)
            from omnisim import registry

            registry.load(args.plugin)

        rows = [(i.id, i.statement) for i in INVARIANTS.values()]
    elif args.what == "faults":
        from omnisim.faults import FAULT_KINDS, SAMPLED_KINDS

        raising = "raises an error there (in a simulated run, and in `omnisim soak`)"
        acted = "acted out on the simulated world (see faults.py)"
        rows = [
            (kind, f"at {point}: " + (raising if raises else acted)) for kind, (point, raises) in FAULT_KINDS.items()
        ]
        rows.append(("sampled", f"--faults sampled[:KIND,...]: BUGGIFY over {', '.join(SAMPLED_KINDS)} by default"))
    else:
        from omnisim.points import POINTS

        rows = [(name, f"({kind}) {meaning}") for name, (kind, meaning) in POINTS.items()]
    width = max(len(name) for name, _ in rows)
    _emit(args, [f"{name:<{width}}  {text}" for name, text in rows], {args.what: [name for name, _ in rows]})
    return EXIT_OK


def _left_out(scn: Any, store: str) -> bool:
    """Whether ``scn`` cannot run on ``store`` here; if so, say why on stderr."""
    why = scn.unavailable(store)
    if why is not None:
        print(f"{scn.name} [{store}]: left out: {why}", file=sys.stderr)
    return why is not None


def check_plans(scn: Any, budget: int, stores: list[str]) -> list[tuple[str, str, int, list[str]]]:
    """What ``check`` runs for one scenario: every strategy that can find something (the random
    walk, PCT, and the scenario's ordering if it declares one) on each store, and the random walk
    again with faults sampled on top of the scenario's own (BUGGIFY: storage errors, failed and
    raising puts, undecodable chunks), whose invariants must hold all the same; /dev/shm gets a
    quarter of the memory store's budget (a schedule there costs real system calls)."""
    share = scn.budget(budget)
    plans = []
    for store in (s for s in stores if not _left_out(scn, s)):
        scale = 1 if store == "memory" else 4
        plans.append(("random", store, max(1, share // scale), []))
        plans.append(("pct", store, max(1, share // (2 * scale)), []))
        plans.append(("random", store, max(1, share // (2 * scale)), ["sampled"]))
    if scn.constraints and "memory" in stores:
        plans.append(("ordered", "memory", max(1, share // 4), []))
    return plans


def cmd_check(args: argparse.Namespace) -> int:
    from omnisim import registry
    from omnisim.report import write_check_report

    writable_dir(args.out)
    stores = [args.store] if args.store else list(STORES)
    jobs = [
        (
            name,
            {"strategy": strategy, "budget": budget, "seed": args.seed, "store": store, "out_dir": args.out}
            | {"determinism_every": CHECK_DETERMINISM_EVERY, "faults": faults},
        )
        for name in sorted(registry.SCENARIOS)
        for strategy, store, budget, faults in check_plans(registry.SCENARIOS[name], args.budget, stores)
    ]
    results = _explore_all(args, jobs)
    path = write_check_report(results, args.out)
    failed = [s for s in results if s["violations"]]
    payload = {"results": results, "violations": [v for s in failed for v in s["violations"]], "report": path}
    _emit(args, [f"report: {path}", f"{len(results)} explorations, {len(failed)} with violations"], payload)
    return EXIT_VIOLATION if failed else EXIT_OK


def cmd_mutants(args: argparse.Namespace) -> int:
    from omnisim import explore as ex
    from omnisim import registry
    from omnisim.report import write_mutant_report

    writable_dir(args.out)
    names = args.mutant or sorted(registry.MUTANTS)
    mutants = [registry.get_mutant(name) for name in names]
    rows: list[dict[str, Any]] = []

    def row_lines(r: dict[str, Any]) -> list[str]:
        if r["detected"]:
            verdict = f"found after {r['schedules']} schedules ({r['seconds']}s) by {', '.join(r['fired'])}"
        elif r["clean_too"]:
            verdict = f"BROKEN: the runtime without it trips {', '.join(r['clean_too'])} too"
        elif r["invariants"]:
            # Something failed, but not what the mutant declares: breakage, never a detection.
            verdict = f"BROKEN: tripped {', '.join(r['invariants'])}, not {' or '.join(r['expect'])}"
        else:
            verdict = f"NOT found in {r['schedules']} schedules"
        return [f"{r['mutant']:<34} {r['scenario']:<28} {r['strategy']:<10} {verdict}"]

    from omnisim.progress import Progress

    with _tracked(Progress.for_command(row_lines, json_output=args.json)) as progress:
        for m in mutants:
            assert m is not None
            for scenario in m.scenarios:
                scn = registry.get_scenario(scenario)
                wanted = args.strategy or ["random", "ordered"]
                for strategy in [st for st in wanted if st != "ordered" or scn.constraints]:
                    on_schedule = progress.start(f"{m.name} on {scenario} [{strategy}]", args.budget)
                    res = ex.explore(
                        scenario,
                        strategy=strategy,
                        budget=args.budget,
                        time_limit=args.time_limit,
                        seed=args.seed,
                        store=m.store or args.store,
                        mutant=m.name,
                        on_schedule=on_schedule,
                    )
                    fired = res.invariants()
                    rows.append(
                        {
                            "mutant": m.name,
                            "issue": m.issue,
                            "scenario": scenario,
                            "strategy": strategy,
                            "expect": list(m.expect),
                            "detected": res.first_violation_after is not None,
                            # Which declared invariants fired (what the detection rests on) …
                            "fired": [name for name in fired if name in m.expect],
                            # … and everything that failed, declared or not.
                            "invariants": fired,
                            # What the runtime without the mutant trips as well (no detection).
                            "clean_too": sorted({i for v in res.violations for i in v.get("clean_too", [])}),
                            "schedules": res.first_violation_after or res.schedules,
                            "seconds": round(res.seconds, 3),
                        }
                    )
                    progress.done(rows[-1])
    undetected = sorted({r["mutant"] for r in rows} - {r["mutant"] for r in rows if r["detected"]})
    broken = sorted({r["mutant"] for r in rows if r["invariants"]} & set(undetected))
    path = write_mutant_report(rows, args.out)
    _emit(
        args,
        [
            f"report: {path}",
            f"{len(names) - len(undetected)}/{len(names)} mutants detected by an invariant they declare"
            + (f"; {len(broken)} only broke something else: {', '.join(broken)}" if broken else ""),
        ],
        {"rows": rows, "undetected": undetected, "broken": broken, "report": path},
    )
    return EXIT_VIOLATION if undetected else EXIT_OK


def cmd_mutate(args: argparse.Namespace) -> int:
    from omnisim import mutation, registry

    writable_dir(args.out)
    index, count = args.shard
    for name in args.scenario or ():
        registry.get_scenario(name)  # an unknown name is a usage error, --list or not
    package = mutation.runtime_root() / "runtime"
    targets = args.target or [str(package / "connectors"), str(package / "transfer")]
    mutations = mutation.find(targets, args.operator or mutation.OPERATORS, ids=args.id)[: args.limit]
    mutations = mutations[index::count]
    if args.list:
        human = [f"{m.id}  {m.module}:{m.line}  {m.where}  {m.describe()}" for m in mutations]
        _emit(args, [*human, f"{len(mutations)} mutants"], {"mutants": [m.id for m in mutations]})
        return EXIT_OK
    from tqdm import tqdm

    live = sys.stdout.isatty() and not args.json
    bar = tqdm(total=len(mutations), unit="mutant", disable=not live, file=sys.stderr, dynamic_ncols=True)
    counts: dict[str, int] = {}

    def say(line: str) -> None:
        if args.json:
            return
        if live:
            bar.write(line)  # above the bar, which stays
        else:
            print(line, flush=True)

    def on_outcome(o: Any) -> None:
        counts[o.outcome] = counts.get(o.outcome, 0) + 1
        bar.update(1)
        bar.set_postfix_str(", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        if o.outcome == "survived":
            say(f"survived {o.id} {o.module}:{o.line} {o.where}: {o.description}")
        elif not live:
            # Where no bar moves (a CI log), a line per mutant shows an hour-long campaign moving.
            done = f"[{sum(counts.values())}/{len(mutations)}]"
            say(f"{done} {o.outcome} {o.id} {o.module}:{o.line} {o.where}" + (f" ({o.detail})" if o.detail else ""))

    def on_baseline(baseline: Any) -> None:
        for plan, failed in baseline.failing.items():
            say(f"left out {plan}: it fails on the clean runtime ({', '.join(failed)})")
        say(f"baseline: {len(baseline.lines)} plans pass on the clean runtime")

    try:
        report = mutation.mutate(
            mutations,
            budget=args.budget,
            seed=args.seed,
            jobs=args.jobs,
            time_limit=args.time_limit,
            plugins=args.plugin,
            scenarios=args.scenario,
            on_outcome=on_outcome,
            on_baseline=on_baseline,
        )
    finally:
        bar.close()
    json_path, diff_path = mutation.write_report(report, args.out)
    human = [f"{'module':<34} {'killed':>6} {'crash':>6} {'t/o':>5} {'surv':>5} {'equiv':>6} {'score':>7}"]
    for s in [*report.by_module(), report.total()]:
        c = s.counts
        score = f"{s.percent:.1f}%" if s.percent is not None else "-"
        human.append(
            f"{s.module:<34} {c.get('killed', 0):>6} {c.get('crashed', 0):>6} {c.get('timeout', 0):>5} "
            f"{c.get('survived', 0):>5} {c.get('equivalent', 0):>6} {score:>7}"
        )
    human += [f"survivors as diffs: {diff_path}", f"report: {json_path} ({report.seconds:.0f} s)"]
    _emit(args, human, report.as_dict() | {"report": json_path, "survivors": diff_path})
    return EXIT_VIOLATION if report.survivors() else EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from omnisim.report.html import write_page

    for source in args.source:
        if not os.path.exists(source):
            raise UsageError(f"no such report folder or artifact: {source}")
    writable_file(args.out)
    print(f"report: {write_page(args.source, args.out)}")
    return EXIT_OK


def cmd_trace_export(args: argparse.Namespace) -> int:
    from omnisim.explore import load_artifact
    from omnisim.report.perfetto import chrome_trace
    from omnisim.report.timeline import read_trace

    artifact = load_artifact(args.artifact)
    out = args.out or args.artifact.removesuffix(".json") + ".perfetto.json"
    writable_file(out)
    events = read_trace(args.artifact)
    with open(out, "w") as f:
        json.dump(chrome_trace(events, f"{artifact['scenario']} seed {artifact['seed']}"), f)
    print(f"wrote {out} ({len(events)} events): open it in ui.perfetto.dev or chrome://tracing")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    if args.processes and args.store != "posix":
        raise UsageError("--processes needs --store posix: stage processes share /dev/shm")
    from omnisim.serve import serve

    return serve(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "serve":
        from omnisim import bench_serve

        report = bench_serve.run(args.url.rstrip("/"), args.concurrencies, args.prompts, args.timeout)
        if args.json:
            print(json.dumps(report, sort_keys=True))
        else:
            bench_serve.print_table(report)
        counts = all(level["sample_counts_match"] for level in report["levels"])
        return EXIT_OK if counts and all(report["identical"].values()) else EXIT_VIOLATION
    from omnisim import bench

    payload = bench.main(args)
    if args.json:
        print(json.dumps(payload, sort_keys=True))
    return EXIT_OK


def cmd_sweep(args: argparse.Namespace) -> int:
    import trio

    from runtime.connectors.namespaces import ProcTable, ShmDirectory, sweep

    report = trio.run(lambda: sweep(ShmDirectory(time.time), ProcTable(), dry_run=args.dry_run))
    verb = "would remove" if args.dry_run else "removed"
    human = [f"{verb} {name}" for name in report.removed]
    human += [f"kept {ns}: its owner lives" for ns in report.live]
    human += [f"kept {ns}: its owner is in another pid namespace" for ns in report.unjudged]
    human += [f"kept {ns}: no owner record, and younger than a minute" for ns in report.young_orphans]
    human += [f"left alone {name}: not ours" for name in report.foreign]
    human += [f"could not remove {error}" for error in report.errors]
    human.append(f"{len(report.removed)} name(s) {'to remove' if args.dry_run else 'removed'}")
    _emit(args, human, report.as_dict() | {"dry_run": args.dry_run})
    return EXIT_OK


def cmd_soak(args: argparse.Namespace) -> int:
    from omnisim.faults import UnknownFaultError, check_raising
    from omnisim.pipeline_cli import pipeline_config
    from omnisim.soak import clean, print_report, soak

    config = pipeline_config(args)
    processes = args.processes or config.deploy.processes
    if args.kill_every and not processes:
        raise UsageError("--kill-every kills stage processes: it needs --processes")
    if args.fault and processes:
        raise UsageError("--fault and --faults fire in the process that puts or gets: not with --processes yet")
    try:
        check_raising(args.fault)
    except UnknownFaultError as e:
        raise UsageError(str(e)) from None
    bar = None
    if not args.json and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=args.requests, unit="req", desc="soak", file=sys.stderr)

    def progress(done: int, report: Any) -> None:
        if bar is not None:
            bar.update(done - bar.n)
            bar.set_postfix({"problems": len(report.problems), "killed": report.kills}, refresh=False)

    try:
        report = soak(
            args.requests,
            args.concurrency,
            processes=processes,
            kill_every=args.kill_every,
            config=config,
            device=args.device,
            seed=args.seed,
            faults=args.fault,
            fault_probability=args.fault_probability,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
    print_report(report)
    if args.json:
        print(json.dumps(report.as_dict(), sort_keys=True))
    return EXIT_OK if clean(report) else EXIT_VIOLATION


def cmd_pipeline(args: argparse.Namespace) -> int:
    """One request through the real pipeline on the real kernel and /dev/shm."""
    from omnisim.pipeline_cli import run_pipeline

    payload = run_pipeline(args)
    if args.json:
        print(json.dumps(payload, sort_keys=True))
    return EXIT_OK if not payload["residue"] else EXIT_VIOLATION


# == running a command ============================================================================


def _take_verbose(argv: list[str]) -> tuple[list[str], bool]:
    """``-v``/``--verbose`` work anywhere on the line (before a ``--``)."""
    end = argv.index("--") if "--" in argv else len(argv)
    kept = [a for a in argv[:end] if a not in ("-v", "--verbose")] + argv[end:]
    return kept, len(kept) != len(argv)


class _Signals:
    """SIGTERM is handled as SIGINT's handler would handle it, so that trio stops a run the one
    safe way it stops on Ctrl-C; which signal came decides the exit status."""

    def __init__(self) -> None:
        self.terminated = False

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        self.terminated = True
        stop_requested.append("SIGTERM")
        on_int = signal.getsignal(signal.SIGINT)
        if not callable(on_int):
            # SIGINT's handler was set to the default action or ignored since the start: nobody
            # would turn it into a KeyboardInterrupt, so raise one here.
            raise KeyboardInterrupt
        # Exactly what SIGINT would have done at this instruction (trio's handler defers the
        # interrupt if it landed inside trio's own machinery) — unless that handler belongs to a
        # trio run that is being torn down, which cannot take it any more.
        try:
            on_int(signal.SIGINT, frame)
        except KeyboardInterrupt:
            raise
        except Exception:
            raise KeyboardInterrupt from None

    @contextmanager
    def installed(self) -> Iterator[_Signals]:
        previous = signal.signal(signal.SIGTERM, self._on_term)
        # A background job of a script starts with SIGINT ignored. trio then installs no handler
        # of its own, and SIGTERM would have to raise its interrupt wherever it lands, trio's own
        # machinery included. So SIGINT is blocked instead (what the shell asked: it never comes
        # through) and given Python's handler, which trio replaces with its own for SIGTERM to
        # hand the stop to. Ignoring it again discards one that came meanwhile.
        ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        if ignored:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)
            if ignored:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _interrupted(signals: _Signals, json_output: bool) -> int:
    """Print what ran before the interrupt (``json_output``: as the last line of stdout too, as
    every ``--json`` command ends); the exit status of the signal."""
    terminated = signals.terminated or "SIGTERM" in stop_requested
    name = "SIGTERM" if terminated else "Ctrl-C"
    finished = [s for p in _progress for s in p.finished]
    if json_output:
        print(json.dumps({"interrupted": "SIGTERM" if terminated else "SIGINT", "results": finished}), flush=True)
    print(f"omnisim: stopped by {name}", file=sys.stderr)
    if finished:
        schedules = sum(s.get("schedules", 0) for s in finished)
        found = sum(1 for s in finished if s.get("violations") or s.get("detected"))
        print(
            f"omnisim: before that, {len(finished)} exploration(s) ran, {schedules} schedules, "
            f"{found} with violations; the schedule in progress was abandoned (not checked, not saved)",
            file=sys.stderr,
        )
    return EXIT_SIGTERM if terminated else EXIT_SIGINT


def _reader_gone() -> bool:
    """Whether the reader of our stdout has closed it (a broken pipe of our own output, not of
    a channel to a stage process, which is a failure like any other)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def main(argv: list[str] | None = None) -> int:
    argv, verbose = _take_verbose(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.INFO if verbose else logging.CRITICAL, format="%(levelname)s %(name)s: %(message)s"
    )
    _progress.clear()
    stop_requested.clear()
    json_output = False
    with _Signals().installed() as signals:
        try:
            args = build_parser().parse_args(argv)
            json_output = bool(getattr(args, "json", False))
            if args.needs_registry:
                from omnisim import registry

                registry.load(args.plugin)
            handler: Callable[[argparse.Namespace], int] = args.func
            status = handler(args)
            # Inside the try, so that a reader who stopped reading is noticed here and not in
            # the interpreter's last flush, which can only print a traceback.
            sys.stdout.flush()
            return status
        except UsageError as e:
            print(f"omnisim: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except CommandFailed as e:
            if json_output:  # (work was done: a --json command still ends with its JSON line)
                print(json.dumps({"error": str(e)}), flush=True)
            print(f"omnisim: {e}", file=sys.stderr)
            return EXIT_VIOLATION
        except BaseException as e:
            if is_interrupt(e):
                return _interrupted(signals, json_output)
            if isinstance(e, BrokenPipeError) and _reader_gone():
                # Nothing more can reach the reader; stdout points at nothing so the exit is quiet.
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return EXIT_SIGPIPE
            if not isinstance(e, Exception):
                raise
            if verbose:
                traceback.print_exc()
            message = textwrap.shorten(f"{type(e).__name__}: {e}", 300)
            hint = "" if verbose else " (run with -v for the traceback)"
            if json_output:
                print(json.dumps({"internal_error": message}), flush=True)
            print(f"omnisim: internal error: {message}{hint}", file=sys.stderr)
            return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
