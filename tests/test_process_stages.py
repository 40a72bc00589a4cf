"""Stages as OS processes (issue 10): the same answers as one process gives, a killed stage fails
only the requests it held and comes back, and nothing is left in /dev/shm afterwards."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest
import torch
import trio
import yaml
from conftest import left_behind, shm_names

from runtime import orchestrator
from runtime.client import ClientOutput, generate
from runtime.config.pipeline import PipelineConfig, load_pipeline
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.wire import decode, encode
from runtime.orchestrator import SHUT_DOWN, Orchestrator, Unavailable
from runtime.pipeline import Models, PipelineResult, build_engine, run_request
from runtime.process_stage import ProcessStage
from runtime.sched.base import StageOutput
from runtime.stage_process import decode_output, encode_output
from runtime.stages import TextFinish, ThinkerDelta

ROOT = Path(__file__).resolve().parent.parent
MODELS = Models.build()
LONG_TEXT = "streaming audio should start before the whole sentence is done, and go on for a while"
# The kill below must land while the Talker still holds its request. It lands when the first audio
# reaches the client, four frames in; with LONG_TEXT's 43 frames a busy machine once let the
# Talker finish first (CI, stop 23). Four times the text gives it 170 frames to go instead of 40.
KILL_TEXT = " ".join([LONG_TEXT] * 4)


def engine_on(store: PosixStore, *, processes: bool, config: PipelineConfig | None = None) -> Orchestrator:
    return build_engine(config or load_pipeline("qwen3_omni"), MODELS, store, processes=processes)


def run_alone(text: str, *, processes: bool, config: PipelineConfig | None = None) -> PipelineResult:
    store = PosixStore()
    try:
        return trio.run(run_request, engine_on(store, processes=processes, config=config), store, text)
    finally:
        store.sweep()


async def answer(engine: Orchestrator, text: str, modalities: tuple[str, ...], rid: str) -> list[ClientOutput]:
    return [out async for out in generate(engine, text, modalities, request_id=rid)]


def test_the_process_engine_gives_the_in_process_audio_and_leaves_nothing() -> None:
    alone = run_alone("hello world", processes=False)
    split = run_alone("hello world", processes=True)
    assert split.error is None and split.residue == {}
    assert split.audio.numel() > 0
    assert torch.equal(split.audio, alone.audio)
    assert split.text == alone.text


@pytest.mark.parametrize("finish", [None, TextFinish("length", 3, 5)])
def test_a_thinker_output_crosses_the_control_plane_whole(finish: TextFinish | None) -> None:
    out = StageOutput("R#0", ThinkerDelta("hi", None, finish), finished=finish is not None)
    assert decode_output(decode(encode(encode_output(out)))) == out


@pytest.mark.parametrize("finish", [["length", "3", 5], ["length", 3], 7, ["length", 3, True]])
def test_a_thinker_output_with_a_malformed_finish_is_refused(finish: object) -> None:
    message = encode_output(StageOutput("R#0", ThinkerDelta("hi"), finished=True))
    message["data"]["finish"] = finish
    with pytest.raises(TypeError, match="finish must be"):
        decode_output(message)


def test_stage_processes_run_the_config_file_the_head_read(tmp_path: Path) -> None:
    """Not a shipped pipeline of the same name: a file's own pipeline (one no shipped config
    is named after), which each stage process rebuilds from what the head parsed."""
    shipped = yaml.safe_load(resources.files("runtime.config").joinpath("configs/qwen3_omni.yaml").read_text())
    shipped["pipeline"]["name"] = "my_own_omni"
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(shipped))
    config = load_pipeline(path)
    alone = run_alone("hello world", processes=False, config=config)
    split = run_alone("hello world", processes=True, config=config)
    assert split.error is None and split.residue == {}
    assert torch.equal(split.audio, alone.audio)


def test_a_request_for_a_stage_that_stays_down_is_told_which_and_the_engine_runs_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request waits for a stage that is down (dead, its next life not up yet) at most the
    restart wait; then it fails as unavailable naming the stage, not "the engine shut down" (found
    by an outside audit: a server that went on serving told it that), and the engine takes the
    next request."""
    monkeypatch.setattr(orchestrator, "RESTART_WAIT_S", 0.2)
    store = PosixStore()
    engine = engine_on(store, processes=False)
    talker = engine.stages[1]
    outcome: dict[str, list[ClientOutput]] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            await engine.wait_ready()
            up = talker.health
            monkeypatch.setattr(talker, "health", lambda: {**up(), "alive": False})
            outcome["down"] = await answer(engine, "hello world", ("audio",), "R")
            monkeypatch.setattr(talker, "health", up)
            outcome["again"] = await answer(engine, "hello world", ("audio",), "R")
            engine.shutdown()

    try:
        trio.run(main)
    finally:
        store.sweep()
    (told,) = [out.error for out in outcome["down"] if out.finished]
    assert isinstance(told, Unavailable) and told == "stage talker is down: not up after 0.2 s"
    assert [out.error for out in outcome["again"] if out.finished] == [None]


def test_a_killed_talker_fails_only_its_requests_and_comes_back() -> None:
    store = PosixStore()
    engine = engine_on(store, processes=True)
    talker = engine.stages[1]
    assert isinstance(talker, ProcessStage)
    outcome: dict[str, object] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            await engine.wait_ready()
            first_pid = outcome["first_pid"] = talker.pid
            killed_at: list[float] = []

            async def audio_request() -> None:
                outputs: list[ClientOutput] = []
                async for out in generate(engine, KILL_TEXT, ("audio",), request_id="R"):
                    outputs.append(out)
                    if not killed_at and out.data is not None:
                        assert first_pid is not None
                        os.kill(first_pid, signal.SIGKILL)  # mid-stream: it has sent audio
                        killed_at.append(time.perf_counter())
                outcome["failed_after_s"] = time.perf_counter() - killed_at[0]
                outcome["R"] = outputs

            async def text_request() -> None:
                outcome["T"] = await answer(engine, LONG_TEXT, ("text",), "T")

            async with trio.open_nursery() as clients:
                clients.start_soon(audio_request)
                clients.start_soon(text_request)
            await engine.wait_ready()  # the Talker, restarted
            outcome["restarted_pid"] = talker.pid
            outcome["again"] = await answer(engine, "hello world", ("audio",), "R")  # the same id, reused
            await engine.drain()
            outcome["residue"] = await engine.residue_now()
            outcome["shm"] = store.segments() + store.lock_files()
            engine.shutdown()

    try:
        trio.run(main)
    finally:
        store.sweep()
    failed = outcome["R"]
    assert isinstance(failed, list)
    terminals = [out for out in failed if out.finished]
    assert len(terminals) == 1 and terminals[0].error is not None
    assert "stage talker died" in terminals[0].error and isinstance(terminals[0].error, Unavailable)
    # Noticed by the closed control socket, not by a missed heartbeat (which would take a second).
    assert isinstance(outcome["failed_after_s"], float) and outcome["failed_after_s"] < 1.0
    text_only = outcome["T"]
    assert isinstance(text_only, list) and [o.error for o in text_only if o.finished] == [None]
    assert outcome["restarted_pid"] not in (None, outcome["first_pid"])
    again = outcome["again"]
    assert isinstance(again, list) and [o.error for o in again if o.finished] == [None]
    audio = torch.cat([o.data.reshape(-1) for o in again if o.data is not None])
    assert torch.equal(audio, run_alone("hello world", processes=False).audio)
    assert talker.restarts == 1
    assert outcome["residue"] == {} and outcome["shm"] == []


def _stage_processes() -> set[int]:
    found = set()
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"runtime.stage_process" in f.read():
                    found.add(int(pid))
        except (OSError, ValueError):
            continue
    return found


HEADS = {
    "soak": ["soak", "--processes", "--requests", "100000", "--concurrency", "4"],
    # (its stages start: a signal then once ended the start-up with an internal error, exit 4)
    "serve": ["serve", "--processes", "--port", "0"],
}


@pytest.mark.parametrize("head_command", HEADS)
@pytest.mark.parametrize("settle_s", [0.0, 2.0], ids=["while-starting", "while-serving"])
def test_sigterm_to_the_head_stops_the_stages_and_leaves_dev_shm_clean(settle_s: float, head_command: str) -> None:
    shm_before = shm_names()
    stages_before = _stage_processes()
    head = subprocess.Popen(
        [sys.executable, "-m", "omnisim.cli", *HEADS[head_command]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Restore SIGTERM's and SIGINT's defaults in case this test runs in a background job.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        ends = time.monotonic() + 60
        while len(_stage_processes() - stages_before) < 3 and time.monotonic() < ends:
            time.sleep(0.1)
        assert len(_stage_processes() - stages_before) == 3, "the stages never started"
        time.sleep(settle_s)  # 0: the stages are still loading their models; 2: requests are in flight
        head.send_signal(signal.SIGTERM)
        output, _ = head.communicate(timeout=30)
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()
    assert head.returncode == 143, output
    time.sleep(0.2)
    assert _stage_processes() - stages_before == set()
    # (what other runs on this machine made meanwhile, and still own, is theirs)
    assert left_behind(shm_before) == [], output


def test_a_short_soak_with_kills_is_clean() -> None:
    from omnisim.soak import clean, soak

    requests, concurrency = 300, 6
    # Kills come by the clock (every 2.5 s, longer than a restart takes on a slow machine), so a
    # fast machine sees fewer of them in a run: soaks until three kills have struck.
    kills = restarts = 0
    for seed in itertools.count(3):
        report = soak(requests, concurrency, processes=True, kill_every=2.5, seed=seed)
        assert clean(report), report.as_dict()
        # What must hold at any speed: a kill fails only requests in flight when it struck, at
        # most one per client.
        failed = report.outcomes["failed: its stage died"] + report.outcomes["failed: a stage was restarting"]
        assert failed <= report.kills * concurrency, report.as_dict()
        assert report.outcomes["finished"] + report.outcomes["left"] + failed == requests, report.as_dict()
        assert report.outcomes["finished"] > 0, report.as_dict()
        assert max(report.noticed_s) < 1.0, report.noticed_s
        kills, restarts = kills + report.kills, restarts + sum(report.restarts.values())
        if kills >= 3:
            break
    assert restarts >= 3


def test_a_soak_asked_to_kill_that_killed_nothing_says_so() -> None:
    from omnisim.soak import clean, soak

    report = soak(2, 2, processes=True, kill_every=600.0, seed=0)
    assert report.kills == 0 and not clean(report)
    assert any("before the first kill" in problem for problem in report.problems), report.problems


def test_with_restart_fail_a_dead_stage_takes_the_engine_down() -> None:
    config = load_pipeline("qwen3_omni")
    config = dataclasses.replace(config, deploy=dataclasses.replace(config.deploy, restart="fail"))
    store = PosixStore()
    engine = build_engine(config, MODELS, store, processes=True)
    code2wav = engine.stages[2]
    assert isinstance(code2wav, ProcessStage)
    late: list[ClientOutput] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            await engine.wait_ready()
            assert code2wav.pid is not None
            os.kill(code2wav.pid, signal.SIGKILL)
            with trio.fail_after(10):
                while engine.stages[0].health()["alive"]:  # the others are stopped too
                    await trio.sleep(0.05)
            late.extend(await answer(engine, "hello world", ("audio",), "late"))

    try:
        trio.run(main)
    finally:
        store.sweep()
    assert [o.finished for o in late] == [True]
    assert late[0].error.startswith(f"{SHUT_DOWN}: stage code2wav died: ")  # (why, not only that it did)
    assert isinstance(late[0].error, Unavailable)
    assert code2wav.restarts == 0
    assert store.segments() == [] and store.lock_files() == []


EVIL_STAGE = """
import json, os, sys
import runtime.stage_process as sp

spec = sys.argv[-2]  # (then the control connection's descriptor)
original = sp.StageServer._report_loop

async def report(self):
    if json.loads(spec)["stage_id"] == 1 and not os.path.exists(MARKER):  # the Talker's first life only
        open(MARKER, "w").close()
        await self.channel.send(MESSAGE)
        if MESSAGE["ev"] == "bye":
            os._exit(0)
    await original(self)

sp.StageServer._report_loop = report
sp.main(sys.argv[-2:])
"""


@pytest.mark.parametrize(
    "message",
    [{"ev": "output"}, {"ev": "released", "token": ["x"], "removed": 0}, {"ev": "bye", "residue": {}}],
    ids=["fields missing", "unhashable token", "goodbye unasked"],
)
def test_a_stage_that_sends_what_no_stage_sends_is_dead_to_the_head_which_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, message: dict[str, object]
) -> None:
    """A malformed message (or a goodbye nobody asked for) from a stage process ends that life,
    which is restarted; it used to end the head, with every request in flight."""
    child = tmp_path / "child.py"
    child.write_text(f"MARKER = {str(tmp_path / 'sent')!r}\nMESSAGE = {message!r}\n" + EVIL_STAGE)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} {child} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr("runtime.process_stage.sys", type(sys)("sys_with_another_python"))
    monkeypatch.setattr("runtime.process_stage.sys.executable", str(wrapper), raising=False)
    store = PosixStore()
    engine = engine_on(store, processes=True)
    outputs: list[ClientOutput] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            with trio.fail_after(60):
                while engine.stages[1].health()["restarts"] < 1 or not engine.stages[1].health()["alive"]:
                    await trio.sleep(0.05)
            outputs.extend(await answer(engine, "hello world", ("audio",), "after"))
            engine.shutdown()

    try:
        trio.run(main)
        assert outputs[-1].finished and outputs[-1].error is None
    finally:
        store.sweep()
