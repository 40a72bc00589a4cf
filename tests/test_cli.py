"""The ``omnisim`` command line (DESIGN "Command line (public contract)").

Most commands run in-process through :func:`omnisim.cli.main`; two runs go through a subprocess
to prove the console entry and its exit status. Exit status: 0 all invariants held, 1 a
violation was found, 2 a usage or setup error. With ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import left_behind

from omnisim import cli, registry
from omnisim.base import UsageError
from scenarios import RACE_TABLE

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Default output folders (``artifacts``, ``reports/latest``) land in the test's folder."""
    monkeypatch.chdir(tmp_path)


def omnisim(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def last_json(out: str) -> dict[str, Any]:
    lines = out.strip().splitlines()
    assert lines, "nothing was printed"
    payload = json.loads(lines[-1])
    assert isinstance(payload, dict)
    return payload


# -- list --------------------------------------------------------------------------------------


def test_list_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = omnisim(capsys, "list", "scenarios")
    assert code == 0, err
    listed = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert set(RACE_TABLE) <= listed

    code, out, _ = omnisim(capsys, "list", "scenarios", "--json")
    assert code == 0
    assert set(RACE_TABLE) <= set(last_json(out)["scenarios"])


@pytest.mark.parametrize(
    ("what", "some"),
    [
        ("mutants", {"prefix_cleanup", "num_puts_after_success", "no_terminal_fence"}),
        ("invariants", {"no-orphan-shm", "no-orphan-lock", "no-tombstones", "liveness"}),
        ("points", {"shm.put.begin", "shm.put.end", "orch.abort.begin", "adapter.cleanup_sender.end"}),
    ],
)
def test_list_others(capsys: pytest.CaptureFixture[str], what: str, some: set[str]) -> None:
    code, out, err = omnisim(capsys, "list", what, "--json")
    assert code == 0, err
    names = last_json(out)[what]
    assert some <= set(names)
    # The human lines name each entry with a one-line meaning.
    for line, name in zip(out.splitlines()[:-1], names, strict=True):
        assert line.startswith(name) and len(line.split(None, 1)) == 2


# -- run, explore, replay ----------------------------------------------------------------------


def test_run_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    code, out, err = omnisim(capsys, "run", "abort_during_put", "--json", "--trace", str(trace))
    assert code == 0, err
    payload = last_json(out)
    assert {"scenario", "seed", "strategy", "violations", "trace_digest", "points"} <= set(payload)
    assert payload["scenario"] == "abort_during_put"
    assert payload["seed"] == 0
    assert payload["strategy"] == "random"
    assert payload["violations"] == []
    lines = trace.read_text().splitlines()
    assert payload["points"] == len(lines) > 0
    assert payload["trace_digest"] == hashlib.sha256(trace.read_bytes()).hexdigest()


def test_run_is_deterministic_and_seeds_matter(capsys: pytest.CaptureFixture[str]) -> None:
    digests = []
    for seed in ("3", "3", "4"):
        code, out, _ = omnisim(capsys, "run", "abort_during_put", "--seed", seed, "--json")
        assert code == 0
        digests.append(last_json(out)["trace_digest"])
    assert digests[0] == digests[1]
    assert digests[0] != digests[2]


def test_run_ordered_and_posix(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = omnisim(capsys, "run", "abort_during_put", "--strategy", "ordered", "--store", "posix", "--json")
    assert code == 0, err
    payload = last_json(out)
    assert payload["strategy"] == "ordered"
    assert payload["store"] == "posix"
    assert payload["violations"] == [] and payload["unsatisfied"] == []


def test_explore_clean_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = omnisim(capsys, "explore", "abort_during_put", "--budget", "20", "--json")
    assert code == 0, err
    payload = last_json(out)
    assert {"scenario", "strategy", "schedules", "violations", "schedules_per_s", "first_violation_after"} <= set(
        payload
    )
    assert payload["scenario"] == "abort_during_put"
    assert payload["strategy"] == "random"
    assert payload["schedules"] == 20
    assert payload["violations"] == []
    assert payload["first_violation_after"] is None
    assert payload["schedules_per_s"] > 0
    assert not Path("runs").exists() and not Path("artifacts").exists()  # nothing failed, nothing saved


@pytest.mark.parametrize(
    ("scenario", "mutant", "invariant"),
    [
        ("similar_ids", "prefix_cleanup", "exact-key-ownership"),
        ("pipeline_abort_before_output", "abort_terminal_from_stage0", "terminal-delivered"),
    ],
)
def test_explore_finds_mutant_and_replay_reproduces(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, scenario: str, mutant: str, invariant: str
) -> None:
    out_dir = tmp_path / "out"
    code, out, err = omnisim(
        capsys,
        "explore",
        scenario,
        "--mutant",
        mutant,
        "--budget",
        "200",
        "--out",
        str(out_dir),
        "--json",
    )
    assert code == 1, err
    payload = last_json(out)
    assert payload["mutant"] == mutant
    assert payload["violations"], "the mutant was not detected"
    assert payload["first_violation_after"] >= 1
    found = payload["violations"][0]
    artifact_path = Path(found["artifact"])
    assert artifact_path.is_file() and artifact_path.parent == out_dir
    assert {v["invariant"] for v in found["violations"]} >= {invariant}
    artifact = json.loads(artifact_path.read_text())
    assert artifact["scenario"] == scenario
    assert artifact["mutant"] == mutant
    assert artifact["seed"] == found["seed"]
    assert artifact["choices"] and artifact["events"]

    code, out, err = omnisim(capsys, "replay", str(artifact_path), "--json")
    assert code == 1, err
    replayed = last_json(out)
    assert replayed["reproduced"] is True
    assert replayed["trace_digest"] == artifact["trace_digest"]
    assert replayed["expected_trace_digest"] == artifact["trace_digest"]
    assert replayed["scenario"] == scenario
    assert replayed["violations"] == artifact["violations"]
    assert replayed["first_difference"] is None


# -- usage errors: exit 2 and a clear message on stderr ----------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "no_such_scenario"], "unknown scenario 'no_such_scenario'"),
        (["explore", "no_such_scenario", "--budget", "1"], "unknown scenario 'no_such_scenario'"),
        (["run", "abort_during_put", "--mutant", "no_such_mutant"], "unknown mutant 'no_such_mutant'"),
        (["explore", "abort_during_put", "--mutant", "no_such_mutant"], "unknown mutant 'no_such_mutant'"),
        (["run", "abort_during_put", "--store", "tape"], "invalid choice: 'tape'"),
        (["run", "abort_during_put", "--strategy", "telepathy"], "invalid choice: 'telepathy'"),
        (["replay", "missing-artifact.json"], "cannot read artifact 'missing-artifact.json'"),
        (["run", "repeated_receiver_cleanups", "--strategy", "ordered"], "declares no ordering constraints"),
        (["explore", "--budget", "1"], "give a SCENARIO or --all"),
        (["list", "everything"], "invalid choice: 'everything'"),
        (["run", "abort_during_put", "--plugin", "no_such_plugin_module_xyz"], "cannot load plugin"),
        (["run", "abort_during_put", "--plugin", "missing_plugin.py"], "does not exist"),
        (["explore", "abort_during_put", "--budget", "0"], "--budget: must be at least 1"),
        (["explore", "abort_during_put", "--budget", "-1"], "--budget: must be at least 1"),
        (["explore", "abort_during_put", "--time", "0"], "--time: must be a positive number"),
        (["explore", "abort_during_put", "--out", "/proc/no/such"], "cannot write to '/proc/no/such'"),
        (["explore", "abort_during_put", "--out", "/dev/null"], "cannot write to '/dev/null'"),
        (["run", "abort_during_put", "--param", "x=1"], "has no parameter 'x'"),
        (["run", "pipeline_requests", "--param", "async_chunk=maybe"], "is one of on, off"),
        (
            ["run", "abort_during_put", "--strategy", "ordered", "--order", "shm.put.begin < no.such.point"],
            "no.such.point",
        ),
        (["pipeline", "run", "--text", ""], "the input text is empty"),
        (["pipeline", "run", "--text", "   "], "the input text is empty"),
        (["pipeline", "run", "--text", "x" * 20001], "the limit is 20000"),
        (["pipeline", "run", "--text", "hi", "--out", "/proc/no/such.wav"], "cannot write to '/proc/no'"),
        (["pipeline", "run", "--text", "hi", "--modalities", "video"], "--modalities takes text and/or audio"),
        (["pipeline", "run", "--text", "hi", "--modalities", "text", "--word-timestamps"], "needs the audio"),
        (["pipeline", "run", "--text", "hi", "--processes", "--store", "memory"], "--processes needs --store posix"),
        (["pipeline", "run", "--text", "hi", "--stop", "i", "--stop", ""], "--stop: a stop string cannot be empty"),
        (["soak", "--pipeline", "qwen3_tts_aligner"], "this runtime runs a thinker -> talker -> code2wav pipeline"),
        (["soak", "--pipeline", "no_such.yaml"], "no_such.yaml"),
        (["soak", "--kill-every", "1"], "it needs --processes"),
        (["explore", "abort_during_put", "--delays", "1"], "bound a dfs search"),
        (["explore", "abort_during_put", "--fault", "put_fail#0"], "a hit number from 1"),
        (
            ["explore", "abort_during_put", "--strategy", "hypothesis", "--hypothesis-db", "/proc/no/such"],
            "cannot write to '/proc/no/such'",
        ),
        (["mutate", "--list", "--scenario", "no_such_scenario"], "unknown scenario 'no_such_scenario'"),
        (["run", "similar_ids", "--fault", "crash_reader"], "cannot crash process 'main'"),
    ],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = omnisim(capsys, *argv)
    assert code == 2
    assert "omnisim: error:" in err and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert out == ""
    assert not Path("runs").exists()  # refused before any work started


def test_soak_runs_the_pipeline_it_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = omnisim(
        capsys,
        "soak",
        "--requests",
        "4",
        "--concurrency",
        "2",
        "--transport",
        "segments",
        "--async-chunk",
        "off",
        "--json",
    )
    report = last_json(out)
    assert code == 0, out
    assert report["async_chunk"] == "off" and set(report["transport"].values()) == {"segments"}
    assert report["outcomes"].get("finished", 0) + report["outcomes"].get("aborted", 0) == 4
    assert report["shm_left"] == [] and report["pipeline"].endswith("qwen3_omni.yaml")


def test_a_json_command_that_fails_still_ends_with_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omnisim.base import CommandFailed

    def failing(args: argparse.Namespace) -> int:
        raise CommandFailed("request r failed: stage talker died")

    monkeypatch.setattr(cli, "cmd_pipeline", failing)
    code, out, err = omnisim(capsys, "pipeline", "run", "--text", "hi", "--json")
    assert code == 1 and last_json(out) == {"error": "request r failed: stage talker died"}
    assert "stage talker died" in err


def test_verbose_works_anywhere(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["-v", "list", "points"], ["list", "-v", "points"], ["list", "points", "-v"]):
        code, out, err = omnisim(capsys, *argv)
        assert code == 0, err
        assert "shm.put.begin" in out


def test_every_option_has_help_and_every_verb_an_example() -> None:
    def walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from walk(sub)

    verbs = 0
    for parser in walk(cli.build_parser()):
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                assert action.help, f"{parser.prog}: {action.dest} has no help text"
        if not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            verbs += 1
            assert parser.epilog and "examples:" in parser.epilog, f"{parser.prog} --help shows no example"
    assert verbs >= 7


def test_help_and_argument_errors_do_not_import_torch() -> None:
    for argv in (["--help"], ["explore", "--budget", "0", "x"], ["list", "points"], ["list", "invariants"]):
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "omnisim.cli", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )
        imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
        assert "torch" not in imported, f"omnisim {' '.join(argv)} imported torch"


def test_replay_of_a_file_that_is_not_an_artifact_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.json"
    bogus.write_text(json.dumps({"hello": "world"}))
    code, _, err = omnisim(capsys, "replay", str(bogus))
    assert code == 2
    assert "is not an omnisim artifact" in err
    bogus.write_text("{not json")
    code, _, err = omnisim(capsys, "replay", str(bogus))
    assert code == 2
    assert "cannot read artifact" in err


@pytest.mark.parametrize("order", ["a b < c", "a[k] < b", "just_one_event"])
def test_bad_order_exits_2(capsys: pytest.CaptureFixture[str], order: str) -> None:
    code, _, err = omnisim(capsys, "run", "abort_during_put", "--strategy", "ordered", "--order", order)
    assert code == 2
    assert "omnisim: error:" in err


# -- plugins -----------------------------------------------------------------------------------

PLUGIN = textwrap.dedent(
    '''
    """A third-party plugin: one scenario and one mutant, with omnisim's own decorators."""

    from omnisim.registry import Patch, mutant, scenario
    from runtime.transfer.adapter import ChunkTransferAdapter
    from scenarios.edge import EdgeRequest, edge_world, serve

    SCENARIO = "clitest_plugin_edge_roundtrip"
    MUTANT = "clitest_plugin_forgetful_receiver"


    @scenario(SCENARIO, summary="a plugin's own scenario: one request across the edge", issue="plugin",
              build=edge_world)
    async def roundtrip(world):
        await serve(EdgeRequest(world, "P"), [2, 1])


    @mutant(MUTANT, summary="a plugin's own mutant: receiver cleanup forgets nothing", issue="plugin",
            scenarios=(SCENARIO,), expect=("no-tombstones",))
    def forgetful_receiver():
        async def cleanup_receiver(self, request_id):
            return None

        yield Patch(ChunkTransferAdapter, "cleanup_receiver", cleanup_receiver)
    '''
)


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The plugin file; whatever it registers goes into copies of the global registries, and
    the modules it loads and the import path it extends are forgotten, so it is gone after the
    test (and registering it again in another test cannot clash)."""
    import invariants

    path = tmp_path / "third_party_plugin.py"
    path.write_text(PLUGIN)
    registry.load()
    monkeypatch.setattr(registry, "SCENARIOS", dict(registry.SCENARIOS))
    monkeypatch.setattr(registry, "MUTANTS", dict(registry.MUTANTS))
    monkeypatch.setattr(invariants, "INVARIANTS", dict(invariants.INVARIANTS))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield str(path)
    for name in set(sys.modules) - before:
        if name.startswith("omnisim_plugin_") or str(getattr(sys.modules[name], "__file__", "")).startswith(
            str(tmp_path)
        ):
            del sys.modules[name]


def test_a_plugin_that_another_plugin_imports_is_loaded_once(
    capsys: pytest.CaptureFixture[str], plugin: str, tmp_path: Path
) -> None:
    """A test file that imports the plugin by name, both named by an artifact: the plugin is
    one module, not two that each register its scenario (found by an outside audit: "registered
    twice", and the printed replay command failed)."""
    (tmp_path / "its_test.py").write_text("import third_party_plugin  # noqa: F401\n")
    code, out, err = omnisim(capsys, "list", "scenarios", "--plugin", plugin, "--plugin", str(tmp_path / "its_test.py"))
    assert code == 0, err
    assert "clitest_plugin_edge_roundtrip" in out


def test_a_plugin_in_a_package_imports_its_neighbours_by_the_package_s_name(
    capsys: pytest.CaptureFixture[str], plugin: str, tmp_path: Path
) -> None:
    package = tmp_path / "omnisim_user_pkg" / "checks"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "names.py").write_text('SCENARIO = "clitest_packaged_scenario"\n')
    (package / "test_it.py").write_text(
        PLUGIN.replace(
            'SCENARIO = "clitest_plugin_edge_roundtrip"', "from omnisim_user_pkg.checks.names import SCENARIO"
        ).replace('"clitest_plugin_forgetful_receiver"', '"clitest_packaged_mutant"')
    )
    code, out, err = omnisim(capsys, "list", "scenarios", "--plugin", str(package / "test_it.py"))
    assert code == 0, err
    assert "clitest_packaged_scenario" in out


#: Plugins that are wrong in one way each, and what the command line must say of them (exit 2,
#: never an internal error of omnisim's, found by an outside audit).
BAD_PLUGINS = {
    "a mutant patching what does not exist": (
        PLUGIN.replace('"cleanup_receiver", cleanup_receiver', '"cleanup_receiverr", cleanup_receiver'),
        ["explore", "clitest_plugin_edge_roundtrip", "--mutant", "clitest_plugin_forgetful_receiver"],
        "patches ChunkTransferAdapter.cleanup_receiverr, which does not exist",
    ),
    "a checker that raises": (
        PLUGIN.replace("build=edge_world)", "build=edge_world, invariants=('clitest-raises',))")
        + "\nfrom invariants import invariant\n\n@invariant('clitest-raises', 'raises')\ndef raises(world):\n"
        "    raise RuntimeError('checker bug')\n",
        ["run", "clitest_plugin_edge_roundtrip"],
        "the checker of invariant 'clitest-raises' (",
    ),
    "a build that raises": (
        PLUGIN.replace("build=edge_world)", "build=lambda store: {}['bad build'])"),
        ["run", "clitest_plugin_edge_roundtrip"],
        "its build (",
    ),
    "a syntax error": (PLUGIN + "\ndef broken(:\n", ["list", "scenarios"], "cannot load plugin"),
    "an import that raises": (
        PLUGIN + "\nraise RuntimeError('plugin import bug')\n",
        ["list", "scenarios"],
        "plugin import bug",
    ),
    "an invariant under a taken id": (
        PLUGIN + "\nfrom invariants import invariant\n\n@invariant('no-tombstones', 'mine')\ndef mine(world):\n"
        "    return []\n",
        ["list", "scenarios"],
        "invariant 'no-tombstones' is registered twice",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PLUGINS))
def test_a_wrong_plugin_is_a_usage_error_naming_what_is_wrong(
    capsys: pytest.CaptureFixture[str], plugin: str, case: str
) -> None:
    text, argv, message = BAD_PLUGINS[case]
    Path(plugin).write_text(text)
    code, _, err = omnisim(capsys, *argv, "--plugin", plugin)
    assert code == 2 and message in err, err


def test_a_find_the_runtime_without_the_mutant_makes_too_is_no_detection(
    capsys: pytest.CaptureFixture[str], plugin: str
) -> None:
    """A scenario that fails on its own (here: its body raises) fails the same with a mutant that
    changes nothing: that is the scenario's failure, never the mutant's detection."""
    Path(plugin).write_text(
        PLUGIN.replace('await serve(EdgeRequest(world, "P"), [2, 1])', "raise SystemExit(3)").replace(
            'expect=("no-tombstones",)', 'expect=("no-crash",)'
        )
    )
    argv = ["explore", "clitest_plugin_edge_roundtrip", "--plugin", plugin, "--budget", "3", "--no-shrink"]
    code, out, err = omnisim(capsys, *argv, "--json")
    assert code == 1, err  # (a SystemExit in a simulated task is a crash: the world goes on)
    assert {v["invariant"] for v in last_json(out)["violations"][0]["violations"]} == {"no-crash"}
    code, out, err = omnisim(capsys, *argv, "--mutant", "clitest_plugin_forgetful_receiver", "--json")
    payload = last_json(out)
    assert payload["first_violation_after"] is None, payload
    assert payload["violations"][0]["clean_too"] == ["no-crash"]
    code, out, err = omnisim(capsys, *argv, "--mutant", "clitest_plugin_forgetful_receiver")
    assert "BROKEN: the runtime without the mutant trips no-crash too" in out, out


def test_plugin_registers_scenario_and_mutant(capsys: pytest.CaptureFixture[str], plugin: str, tmp_path: Path) -> None:
    code, out, err = omnisim(capsys, "list", "scenarios", "--plugin", plugin)
    assert code == 0, err
    assert "clitest_plugin_edge_roundtrip" in {line.split()[0] for line in out.splitlines()}
    code, out, err = omnisim(capsys, "list", "mutants", "--plugin", plugin, "--json")
    assert code == 0, err
    assert "clitest_plugin_forgetful_receiver" in last_json(out)["mutants"]

    code, out, err = omnisim(capsys, "run", "clitest_plugin_edge_roundtrip", "--plugin", plugin, "--json")
    assert code == 0, err
    assert last_json(out)["violations"] == []

    out_dir = tmp_path / "plugin-out"
    code, out, err = omnisim(
        capsys,
        "explore",
        "clitest_plugin_edge_roundtrip",
        "--plugin",
        plugin,
        "--mutant",
        "clitest_plugin_forgetful_receiver",
        "--budget",
        "10",
        "--out",
        str(out_dir),
        "--json",
    )
    assert code == 1, err
    payload = last_json(out)
    assert {v["invariant"] for v in payload["violations"][0]["violations"]} >= {"no-tombstones"}
    artifact = json.loads(Path(payload["artifact"]).read_text())
    assert artifact["plugins"] == [os.path.abspath(plugin)]

    # The artifact names its plugin, so replay needs no --plugin.
    code, out, err = omnisim(capsys, "replay", payload["artifact"], "--json")
    assert code == 1, err
    assert last_json(out)["reproduced"] is True


# -- the console entry -------------------------------------------------------------------------


def console(*argv: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("omnisim")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "omnisim.cli"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def test_console_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    proc = console("run", "abort_during_put", "--seed", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    payload = last_json(proc.stdout)
    assert payload["violations"] == []
    # The same scenario, seed and strategy in this process give the byte-identical trace.
    code, out, _ = omnisim(capsys, "run", "abort_during_put", "--seed", "5", "--json")
    assert code == 0
    assert last_json(out)["trace_digest"] == payload["trace_digest"]


def test_module_entry_exit_status_for_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "omnisim.cli", "run", "no_such_scenario"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 2
    assert "omnisim: error: unknown scenario 'no_such_scenario'" in proc.stderr


def test_a_reader_that_stops_reading_ends_the_command_quietly() -> None:
    """`omnisim … | head` is not a failure of omnisim: the exit status a shell gives a command
    killed by SIGPIPE, and nothing on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnisim.cli", "mutate", "runtime/connectors/keys.py", "--list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


def test_hypothesis_shrinks_a_failing_schedule_and_it_replays(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["id_reuse_after_cancel", "--strategy", "hypothesis", "--mutant", "accept_while_draining"]
    code, out, err = omnisim(capsys, "explore", *args, "--budget", "300", "--out", str(tmp_path), "--json")
    assert code == 1, err
    summary = last_json(out)
    (found,) = summary["violations"]
    assert found["steered_choices"] <= found["steered_choices_before_shrinking"]
    # The runs of the shrink are not schedules of the search: it ran as many as it took to find.
    assert found["shrink_runs"] > 0 and summary["schedules"] == summary["first_violation_after"]
    code, out, err = omnisim(capsys, "replay", found["artifact"], "--json")
    assert code == 1 and last_json(out)["reproduced"] is True


def test_hypothesis_is_for_explore_only(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = omnisim(capsys, "run", "similar_ids", "--strategy", "hypothesis")
    assert code == 2 and "invalid choice: 'hypothesis'" in err


def test_mutants_table_by_chosen_strategies(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["mutants", "--mutant", "prefix_cleanup", "--strategy", "pct", "--strategy", "random"]
    code, out, err = omnisim(capsys, *args, "--budget", "50", "--time-limit", "30", "--out", str(tmp_path), "--json")
    assert code == 0, err
    rows = last_json(out)["rows"]
    assert [r["strategy"] for r in rows] == ["pct", "random"] and all(r["detected"] for r in rows)


def test_a_mutant_that_only_breaks_the_runtime_is_not_a_detection(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11: a typo in a mutant (an AttributeError in the runtime) trips ``no-crash`` and
    leaves tombstones — but it is not the bug the mutant declares, so it is reported as broken."""
    from omnisim.registry import Patch, mutant
    from runtime.transfer.adapter import ChunkTransferAdapter

    registry.load()
    monkeypatch.setattr(registry, "MUTANTS", dict(registry.MUTANTS))

    @mutant(
        "clitest_typo", summary="a typo", issue="test", scenarios=("abort_during_put",), expect=("no-stale-commit",)
    )
    def typo() -> Iterator[Patch]:
        async def cleanup_receiver(self: ChunkTransferAdapter, request_id: str) -> None:
            self.no_such_attribute.clear()

        yield Patch(ChunkTransferAdapter, "cleanup_receiver", cleanup_receiver)

    args = ["mutants", "--mutant", "clitest_typo", "--strategy", "random", "--budget", "20", "--out", str(tmp_path)]
    code, out, err = omnisim(capsys, *args, "--json")
    assert code == 1, err
    payload = last_json(out)
    (row,) = payload["rows"]
    assert not row["detected"] and "no-crash" in row["invariants"] and row["fired"] == []
    assert payload["broken"] == ["clitest_typo"]
    code, out, err = omnisim(capsys, *args)
    assert "BROKEN: tripped" in out and "not no-stale-commit" in out


def test_a_mutant_must_declare_what_it_trips() -> None:
    from omnisim.registry import mutant

    with pytest.raises(UsageError, match="declares no invariant"):
        mutant("clitest_undeclared", summary="s", issue="i", scenarios=("abort_during_put",), expect=())


# -- exit codes a script can trust: replay ------------------------------------------------------


def test_replay_exit_codes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """1 when the violation reproduces, 0 when a clean run replays clean, 3 when it does not reproduce."""
    from omnisim.explore import run, save_artifact

    clean = save_artifact(run("abort_during_put", seed=2), str(tmp_path / "clean"), [])
    code, out, err = omnisim(capsys, "replay", clean, "--json")
    assert code == 0, err
    assert last_json(out)["reproduced"] is True

    tampered = json.loads(Path(clean).read_text())
    tampered["choices"] = [999] * len(tampered["choices"])  # no task has that id: the schedule diverges
    tampered["scenario"] = "stale_receiver_entry"
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(tampered))
    code, out, err = omnisim(capsys, "replay", str(path), "--json")
    assert code == 3, err
    assert last_json(out)["reproduced"] is False
    assert "NOT reproduced" in out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda a: a.pop("choices"), "no valid 'choices'"),
        (lambda a: a.update(choices="abc"), "no valid 'choices'"),
        (lambda a: a.update(events=[["task"]]), "'events' must be a list"),
        (lambda a: a.update(seed="7"), "no valid 'seed'"),
        (lambda a: a.update(params={"async_chunk": 1}), "'params' must map"),
    ],
)
def test_replay_of_an_incomplete_artifact_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, edit: Any, message: str
) -> None:
    from omnisim.explore import run, save_artifact

    artifact = json.loads(Path(save_artifact(run("abort_during_put"), str(tmp_path), [])).read_text())
    edit(artifact)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(artifact))
    code, _, err = omnisim(capsys, "replay", str(path))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_replay_of_a_binary_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    code, _, err = omnisim(capsys, "replay", str(path))
    assert code == 2 and "cannot read artifact" in err and "Traceback" not in err


# -- Ctrl-C and SIGTERM ---------------------------------------------------------------------------


def _shm_names() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("omnisim-")}


@pytest.mark.parametrize("jobs", ["1", "2"])
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_explore_cleanly(tmp_path: Path, sig: signal.Signals, status: int, jobs: str) -> None:
    """Each signal stops a long exploration at once: its exit status, a summary of what ran, no
    artifact invented from the interrupted schedule, nothing left in /dev/shm — also when the
    explorations run in worker processes (which the signal does not reach: their parent stops them)."""
    before = _shm_names()
    out_dir = tmp_path / "artifacts"
    proc = _a_long_exploration(tmp_path, before, "--out", str(out_dir), "--jobs", jobs)
    time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    sent = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    stopped_after = time.monotonic() - sent
    assert proc.returncode == status, err
    assert "(interrupted)" in out and "stopped by" in err and "Traceback" not in err
    assert not any(out_dir.glob("*.json")), "the interrupted schedule was saved as a violation"
    assert left_behind(before) == []  # (what other runs on this machine made meanwhile, and own, is theirs)
    assert stopped_after < 30  # a generous bound for a loaded machine; the note gives the figure


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sigterm_stops_explore_cleanly_when_it_started_with_sigint_ignored(tmp_path: Path, jobs: str) -> None:
    """A background job of a script starts with SIGINT ignored, and keeps ignoring it; SIGTERM
    still stops it in order (trio's own handler takes the stop, never an interrupt raised inside
    trio's machinery): the summary, no traceback, nothing left."""
    before = _shm_names()
    proc = _a_long_exploration(tmp_path, before, "--jobs", jobs, sigint=signal.SIG_IGN)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # (ignored, as the shell asked)
    time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    # Luck alone would let a SIGINT that got through look ignored (it would be taken only when the
    # next exploration ends): whatever the process has started since, no thread of it can take one.
    assert not _threads_taking_sigint(proc.pid), proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "(interrupted)" in out and "stopped by SIGTERM" in err and "Traceback" not in err
    assert not _made_by(proc.pid, _shm_names() - before)  # (other runs may make names meanwhile)


def _a_long_exploration(cwd: Path, before: set[str], *argv: str, sigint: Any = signal.SIG_DFL) -> subprocess.Popen[str]:
    """``explore --all`` on /dev/shm, once its schedules run (each makes a namespace there),
    however long its imports take; SIGINT as a terminal's Ctrl-C finds it (``sigint``), even when
    this test runs as a background job (which starts with SIGINT ignored, and a child inherits that)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnisim.cli", "explore", "--all", "--budget", "100000", "--store", "posix", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
    )
    started = time.monotonic()
    while not _made_by(proc.pid, _shm_names() - before) and time.monotonic() - started < 120:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    return proc


def _threads_taking_sigint(pid: int) -> list[str]:
    """The threads of ``pid`` that a SIGINT would be delivered to (neither ignored nor blocked)."""
    bit = 1 << (signal.SIGINT - 1)
    taking = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            masks = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        if not (int(masks["SigIgn"], 16) | int(masks["SigBlk"], 16)) & bit:
            taking.append(task)
    return taking


def _made_by(pid: int, names: set[str]) -> bool:
    """Whether one of ``names`` belongs to a namespace that ``pid`` or a child of it owns (other
    processes, such as tests running beside this one, make names in /dev/shm too)."""
    from runtime.connectors.namespaces import OWNER_SUFFIX, ShmDirectory

    directory = ShmDirectory(time.time)
    for name in names:
        if not name.endswith(f"-{OWNER_SUFFIX}"):
            continue
        owner = directory.read_owner(name.removeprefix("omnisim-").removesuffix(f"-{OWNER_SUFFIX}"))
        if owner is not None and (owner.pid == pid or _parent_of(owner.pid) == pid):
            return True
    return False


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_an_interrupt_of_a_json_command_ends_its_stdout_with_json(tmp_path: Path) -> None:
    proc = _a_long_exploration(tmp_path, _shm_names(), "--json")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    last = json.loads(out.strip().splitlines()[-1])
    assert last["interrupted"] == "SIGINT" and isinstance(last["results"], list)


def test_a_hypothesis_search_ends_when_its_time_is_up() -> None:
    """Out of time, the search ends: it does not go on drawing its whole budget of examples."""
    argv = ["explore", "abort_during_put", "--strategy", "hypothesis", "--time", "1", "--budget", "1000000"]
    proc = subprocess.run(
        [sys.executable, "-m", "omnisim.cli", *argv, "--hypothesis-db", ""],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no violation" in proc.stdout


def test_an_unreadable_trace_is_a_usage_error_for_report_and_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["explore", "similar_ids", "--mutant", "prefix_cleanup", "--budget", "3", "--no-shrink"]
    code, _, err = omnisim(capsys, *argv, "--out", str(tmp_path))
    assert code == 1, err
    (artifact,) = tmp_path.glob("*-seed*.json")
    trace = artifact.with_name(artifact.name.removesuffix(".json") + ".trace.jsonl")
    for garbage in (b"not json\n", b"\xff\xfe\n", b'{"i": 1}\n'):
        trace.write_bytes(garbage)
        for command in (
            ["report", str(artifact), "--out", str(tmp_path / "r.html")],
            ["trace", "export", str(artifact), "--perfetto"],
        ):
            code, _, err = omnisim(capsys, *command)
            assert code == 2 and "is not a trace the simulator wrote" in err, err


def test_a_replay_without_its_trace_file_names_where_it_departs_from_the_artifact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The artifact's own events (task and point of each) say where a replay departs when the
    trace file beside it is gone (found by an outside audit: it said "unknown")."""
    argv = ["explore", "similar_ids", "--mutant", "prefix_cleanup", "--budget", "3", "--no-shrink"]
    code, _, err = omnisim(capsys, *argv, "--out", str(tmp_path))
    assert code == 1, err
    (artifact,) = tmp_path.glob("*-seed*.json")
    artifact.with_name(artifact.name.removesuffix(".json") + ".trace.jsonl").unlink()
    recorded = json.loads(artifact.read_text())
    task = recorded["events"][3][0]
    recorded["events"][3] = [task, "a.point.never.reached"]
    recorded["trace_digest"] = "0" * 64
    artifact.write_text(json.dumps(recorded))
    code, out, err = omnisim(capsys, "replay", str(artifact), "--json")
    assert code == 3, err
    difference = last_json(out)["first_difference"]
    assert difference.startswith(f"event 3: recorded {task} at a.point.never.reached but replay gave {task} at ")
    assert "the recorded trace is missing" in difference


def test_an_empty_shard_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = omnisim(capsys, "explore", "abort_during_put", "--budget", "1", "--shard", "1/2")
    assert code == 0 and "shard 1/2 has none of the 1 exploration(s) to run" in err


def test_ctrl_c_is_never_a_crash_of_the_runtime() -> None:
    """A KeyboardInterrupt raised inside a simulated task stops the run; it is not recorded as
    a crash (and so never as a violation)."""
    import trio

    from omnisim.sim_kernel import SimKernel
    from omnisim.strategies.random import RandomStrategy

    kernel = SimKernel(RandomStrategy(0))

    async def main() -> None:
        await kernel.point("scenario.client.wait", req="x")
        raise KeyboardInterrupt

    with pytest.raises(BaseException) as caught:
        trio.run(kernel.run_async, main)
    from omnisim.base import is_interrupt

    assert is_interrupt(caught.value)
    assert kernel.crashes == []


# -- faults from the command line ----------------------------------------------------------------


def test_a_fault_from_the_command_line_is_injected_recorded_and_replayed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A reader that stops for good holding a key's lock, in a process nothing supervises: its
    # request can only hang. (A fault the runtime handles — a failed put, an undecodable chunk —
    # may fail the request it hit, and the invariants allow that.)
    args = ["explore", "terminal_success_vs_failure", "--fault", "stall#1", "--budget", "40"]
    code, out, err = omnisim(capsys, *args, "--out", str(tmp_path), "--json")
    assert code == 1, err
    found = last_json(out)["violations"][0]
    assert any(v["invariant"] == "liveness" for v in found["violations"])
    artifact = json.loads(Path(found["artifact"]).read_text())
    assert artifact["faults"] == ["stall#1"]
    code, out, err = omnisim(capsys, "replay", found["artifact"], "--json")
    assert code == 1 and last_json(out)["reproduced"] is True, err
    # Without the fault the same scenario holds.
    code, _, err = omnisim(capsys, "explore", "terminal_success_vs_failure", "--budget", "40", "--out", str(tmp_path))
    assert code == 0, err


@pytest.mark.parametrize("spec", ["nope", "put_fail@key", "put_fail#x", "put_fail@=R"])
def test_a_malformed_fault_is_a_usage_error(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    code, _, err = omnisim(capsys, "run", "abort_during_put", "--fault", spec)
    assert code == 2 and "fault" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args",
    [
        ["--fault", "put_fail@kye=R_1_0"],  # (its point carries key)
        ["--strategy", "ordered", "--order", "shm.put.begin[kye=R_1_0] < shm.put.end"],
    ],
)
def test_a_misspelt_attribute_is_a_usage_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    """A fault or an ordering that names an attribute its event never carries could never fire or
    match: the run would quietly test nothing."""
    code, _, err = omnisim(capsys, "run", "abort_during_put", *args)
    assert code == 2 and "has no attribute 'kye': it carries key" in err


def test_processes_and_a_ray_cluster_are_not_both_taken(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = omnisim(capsys, "explore", "abort_during_put", "--jobs", "2", "--ray", "local")
    assert code == 2 and "not allowed with" in err


@pytest.mark.parametrize(("field", "value"), [("faults", [123]), ("choices", [-1, 0])])
def test_an_artifact_edited_out_of_shape_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, field: str, value: object
) -> None:
    code, out, err = omnisim(capsys, "explore", "abort_during_put", "--mutant", "cleanup_on_scheduler_thread")
    found = Path(next(iter(re.findall(r"artifact (\S+\.json)", out))))
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(json.loads(found.read_text()) | {field: value}))
    code, _, err = omnisim(capsys, "replay", str(edited))
    assert code == 2 and f"'{field}' must be" in err


def test_dfs_says_when_its_bounded_space_is_exhausted(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["explore", "abort_during_put", "--strategy", "dfs", "--delays", "1", "--budget", "1000"]
    code, out, err = omnisim(capsys, *args, "--out", str(tmp_path))
    assert code == 0, err
    assert "bounded space exhausted: 48 schedules" in out  # the default schedule and its 47 one-step deviations
    # A budget that ends exactly where the space does has exhausted it too.
    code, out, err = omnisim(capsys, *args[:-1], "48", "--out", str(tmp_path))
    assert code == 0 and "bounded space exhausted: 48 schedules" in out, err
    # Without --budget a search runs until it is exhausted (the random walk's 200 would cut it short).
    code, out, err = omnisim(capsys, "explore", "abort_during_put", "--strategy", "dfs", "--out", str(tmp_path))
    assert code == 0 and "bounded space exhausted: 636 schedules" in out, err
    code, _, err = omnisim(capsys, "run", "abort_during_put", "--strategy", "dfs")
    assert code == 2 and "invalid choice: 'dfs'" in err


def test_explorations_in_processes_give_the_same_results(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def results(jobs: str) -> list[dict[str, Any]]:
        args = ["explore", "--all", "--budget", "3", "--out", str(tmp_path), "--jobs", jobs, "--json"]
        code, out, err = omnisim(capsys, *args)
        assert code == 0, err
        return [
            {k: v for k, v in r.items() if k not in ("seconds", "schedules_per_s")} for r in last_json(out)["results"]
        ]

    assert results("2") == results("1")


@pytest.mark.parametrize("workers", [("--jobs", "2"), ("--ray", "local")], ids=["processes", "ray"])
def test_explorations_in_workers_show_one_live_bar_on_a_terminal(tmp_path: Path, workers: tuple[str, str]) -> None:
    """On a terminal, ``--jobs N`` and ``--ray`` show the campaign's schedules, distinct traces
    and violations as the workers run them, and each finished exploration's lines above the bar."""
    if workers[0] == "--ray":
        pytest.importorskip("ray")
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    argv = [sys.executable, "-m", "omnisim.cli", "explore", "--all", "--budget", "4", *workers]
    argv += ["--out", str(tmp_path)]
    process = subprocess.Popen(argv, stdout=secondary, stderr=secondary, stdin=subprocess.DEVNULL, cwd=tmp_path)
    os.close(secondary)
    shown = bytearray()
    with contextlib.suppress(OSError):  # EIO once the process closed its end
        while chunk := os.read(primary, 65536):
            shown += chunk
    os.close(primary)
    assert process.wait(timeout=60) == 0, shown.decode(errors="replace")
    text = shown.decode(errors="replace")
    assert "explorations:" in text and "sched/s" in text
    assert re.search(r"done=\d+/\d+, traces=\d+, violations=0", text), text[-2000:]
    # (every scenario that runs on the memory store, the one explore --all uses here)
    assert text.count("no violation") == sum(s.unavailable("memory") is None for s in registry.SCENARIOS.values())


def test_explorations_on_ray_give_the_same_results(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("ray")

    def results(*how: str) -> list[dict[str, Any]]:
        args = ["explore", "--all", "--budget", "3", "--store", "posix", "--out", str(tmp_path), "--json", *how]
        code, out, err = omnisim(capsys, *args)
        assert code == 0, err
        return [
            {k: v for k, v in r.items() if k not in ("seconds", "schedules_per_s")} for r in last_json(out)["results"]
        ]

    on_ray = results("--ray", "local")
    assert len(on_ray) == len(registry.SCENARIOS)
    assert on_ray == results("--jobs", "1")


def test_hypothesis_tries_a_schedule_that_failed_before_first(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["id_reuse_after_cancel", "--strategy", "hypothesis", "--mutant", "accept_while_draining", "--budget", "300"]
    args += ["--out", str(tmp_path / "artifacts"), "--hypothesis-db", str(tmp_path / "db"), "--json"]
    for _ in range(2):
        code, out, err = omnisim(capsys, "explore", *args)
        assert code == 1, err
    assert last_json(out)["first_violation_after"] == 1  # the saved example, replayed first
