"""The whole pipeline on the real kernel: Thinker → Talker → Code2Wav through the orchestrator and
the client API. The streamed audio is the offline decode of the Talker's frames, the aligner
covers it, aborts and errors end the client's stream with one terminal, nothing is left behind."""

from __future__ import annotations

import dataclasses
import json
import wave
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from pathlib import Path

import pytest
import torch
import trio

from omnisim.cli import main
from runtime.client import ClientOutput, generate
from runtime.config.pipeline import PipelineConfig, load_pipeline
from runtime.config.topology import OutputType
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.stores import MemoryStore, Store
from runtime.models.code2wav import SAMPLE_RATE, TAIL, TOTAL_UPSAMPLE, frames_to_codes
from runtime.models.talker import conditioning_from_thinker, is_placeholder_frame, is_stop_frame
from runtime.models.thinker import EOS_ID, ToyTokenizer, answer_token_ids, prompt_token_ids
from runtime.orchestrator import Orchestrator
from runtime.pipeline import Models, build_engine, run_request

MODELS = Models.build()
OMNI = load_pipeline("qwen3_omni")


def config(async_chunk: bool) -> PipelineConfig:
    return dataclasses.replace(OMNI, deploy=dataclasses.replace(OMNI.deploy, async_chunk=async_chunk))


def offline_audio(text: str, max_tokens: int | None = None, stop: list[str] | None = None) -> torch.Tensor:
    """What the pipeline must produce for ``text``: every stage run whole, one after the other."""
    thought = MODELS.thinker.generate(text, max_tokens, stop)
    frames = [
        f
        for f in MODELS.talker.generate(conditioning_from_thinker(thought))
        if not is_placeholder_frame(f) and not is_stop_frame(f)
    ]
    if not frames:
        return torch.empty(0)
    return MODELS.code2wav(frames_to_codes(torch.stack(frames))).reshape(-1)


def with_engine(
    body: Callable[[Orchestrator], Awaitable[None]],
    *,
    async_chunk: bool = True,
    pipeline: PipelineConfig | None = None,
    store: Store | None = None,
    **kw: float,
) -> dict[str, list[str]]:
    """Run ``body`` against a running engine (of ``pipeline``, default: the shipped one with
    ``async_chunk``); the residue once every request was released."""
    store = store if store is not None else MemoryStore()
    engine = build_engine(pipeline or config(async_chunk), MODELS, store, **kw)

    async def main() -> dict[str, list[str]]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            await body(engine)
            await engine.drain()
            residue = {**engine.residue(), "segments": store.segments(), "lock_files": store.lock_files()}
            engine.shutdown()
        return {name: items for name, items in residue.items() if items}

    try:
        return trio.run(main)
    finally:
        store.sweep()


async def collect(engine: Orchestrator, text: str, **kw: object) -> list[ClientOutput]:
    return [out async for out in generate(engine, text, **kw)]  # type: ignore[arg-type]


def answered_together(
    texts: dict[str, str], pipeline: PipelineConfig | None = None
) -> tuple[dict[str, list[str]], dict[str, list[ClientOutput]]]:
    """Every text submitted at once, with its key as request id: the residue, and each answer."""
    answers: dict[str, list[ClientOutput]] = {}

    async def body(engine: Orchestrator) -> None:
        async def one(rid: str) -> None:
            answers[rid] = await collect(engine, texts[rid], request_id=rid)

        async with trio.open_nursery() as clients:
            for rid in texts:
                clients.start_soon(one, rid)

    return with_engine(body, pipeline=pipeline), answers


def audio_of(outputs: list[ClientOutput]) -> torch.Tensor:
    pieces = [o.data.reshape(-1) for o in outputs if o.kind is OutputType.AUDIO and o.data is not None]
    return torch.cat(pieces) if pieces else torch.empty(0)


def text_of(outputs: list[ClientOutput]) -> str:
    return "".join(o.data for o in outputs if o.kind is OutputType.TEXT and o.data is not None)


@pytest.mark.parametrize("store_kind", ["memory", "posix"])
@pytest.mark.parametrize("async_chunk", [True, False])
def test_streamed_audio_equals_the_offline_decode(store_kind: str, async_chunk: bool) -> None:
    text = "hello world, this is a streamed answer"
    store: Store = MemoryStore() if store_kind == "memory" else PosixStore()
    engine = build_engine(config(async_chunk), MODELS, store)
    try:
        result = trio.run(lambda: run_request(engine, store, text, word_timestamps=True))
    finally:
        store.sweep()
    offline = offline_audio(text)
    assert result.error is None
    assert result.text == ToyTokenizer.normalize(text)
    assert result.audio.numel() == (offline.numel() // TOTAL_UPSAMPLE + 1) * TOTAL_UPSAMPLE - TAIL == offline.numel()
    assert torch.allclose(result.audio, offline, atol=1e-5)
    assert result.residue == {}
    assert result.timestamps[0].start_ms == 0
    assert result.timestamps[-1].end_ms == pytest.approx(result.audio.numel() / SAMPLE_RATE * 1000, abs=1)
    if async_chunk:
        assert result.time_to_first_audio_s is not None and result.time_to_first_audio_s < result.total_s


@pytest.mark.parametrize("async_chunk", [True, False])
@pytest.mark.parametrize("max_tokens", [1, 2, 7, 18, 19, 100])
def test_max_tokens_cuts_the_answer_short_as_vllm_does(async_chunk: bool, max_tokens: int) -> None:
    """The answer has at most ``max_tokens`` tokens (EOS among them); one cut short ends with
    ``"length"``, its audio the whole pipeline's for that answer."""
    text = "hello world, this is a capped answer"  # 36 bytes: 18 pieces, 19 tokens with EOS
    whole = answer_token_ids(text)
    outputs: list[ClientOutput] = []

    async def body(engine: Orchestrator) -> None:
        outputs.extend(await collect(engine, text, max_tokens=max_tokens))

    assert with_engine(body, async_chunk=async_chunk) == {}
    said = whole[:max_tokens]
    end = outputs[-1]
    assert end.finished and end.error is None and end.text_finish is not None
    assert text_of(outputs) == ToyTokenizer.decode([t for t in said if t != EOS_ID])
    assert end.text_finish.reason == ("stop" if max_tokens >= len(whole) else "length")
    assert end.text_finish.completion_tokens == len(said)
    assert end.text_finish.prompt_tokens == len(prompt_token_ids(text))
    assert torch.allclose(audio_of(outputs), offline_audio(text, max_tokens), atol=1e-5)


@pytest.mark.parametrize("async_chunk", [True, False])
@pytest.mark.parametrize(
    ("stop", "max_tokens", "said", "reason"),
    [
        (["stopped", "is"], None, "hello world, th", "stop"),  # "is" ends first, in "this"
        (["hello"], None, "", "stop"),  # at the start: EOS alone, no audio
        (["answer"], 3, "hello ", "length"),  # max_tokens runs out first
        (["nowhere"], None, "hello world, this is a stopped answer", "stop"),
    ],
)
def test_stop_strings_end_the_answer_before_them_as_vllm_does(
    async_chunk: bool, stop: list[str], max_tokens: int | None, said: str, reason: str
) -> None:
    """The text ends just before the first stop string, which no output holds; the terminal
    says ``"stop"`` (unless ``max_tokens`` ran out first) and counts the tokens said, EOS
    included; the audio is the whole pipeline's for that shorter answer."""
    text = "hello world, this is a stopped answer"
    outputs: list[ClientOutput] = []

    async def body(engine: Orchestrator) -> None:
        outputs.extend(await collect(engine, text, max_tokens=max_tokens, stop=stop))

    assert with_engine(body, async_chunk=async_chunk) == {}
    end = outputs[-1]
    assert end.finished and end.error is None and end.text_finish is not None
    assert text_of(outputs) == said
    assert end.text_finish.reason == reason
    tokens = len(ToyTokenizer.encode(said)) + (reason == "stop")
    assert end.text_finish.completion_tokens == tokens
    audio = audio_of(outputs)
    assert torch.allclose(audio, offline_audio(text, max_tokens, stop), atol=1e-5)
    assert (audio.numel() == 0) == (said == "")


@pytest.mark.parametrize("stop", ["hello", [""], ["hello", ""], ["hello", 3], 5])
def test_a_stop_that_is_no_list_of_strings_is_refused_before_the_request_starts(stop: object) -> None:
    """A bare string is not taken for its characters, and an empty one would stop anywhere."""

    async def body(engine: Orchestrator) -> None:
        with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
            await collect(engine, "hello", stop=stop)

    assert with_engine(body) == {}


@pytest.mark.parametrize("window", [1, 2])
def test_an_active_stream_window_takes_streams_up_in_turn_and_answers_each_in_full(window: int) -> None:
    """#5349: with at most ``window`` streams active on the Talker and on Code2Wav, the others
    wait their turn, and a stream whose upstream finished first stays active until it ends."""
    stages = tuple(dataclasses.replace(s, active_stream_window=window) for s in OMNI.deploy.stages)
    windowed = dataclasses.replace(OMNI, deploy=dataclasses.replace(OMNI.deploy, stages=stages))
    texts = {f"R{i}": f"answer number {i} of four, said in turn" for i in range(4)}
    residue, outputs = answered_together(texts, pipeline=windowed)
    assert residue == {}
    for rid, text in texts.items():
        assert outputs[rid][-1].finished and outputs[rid][-1].error is None
        assert torch.allclose(audio_of(outputs[rid]), offline_audio(text), atol=1e-5)


@pytest.mark.parametrize("max_tokens", [0, -3, 2.0, True, "5"])
def test_a_max_tokens_that_is_no_count_is_refused_before_the_request_starts(max_tokens: object) -> None:
    async def body(engine: Orchestrator) -> None:
        with pytest.raises(ValueError, match="max_tokens must be an integer of at least 1"):
            await collect(engine, "hello", max_tokens=max_tokens)

    assert with_engine(body) == {}


@pytest.mark.parametrize("text", ["hi", "a b c", "one two"])
def test_a_request_that_ends_inside_the_initial_chunk(text: str) -> None:
    outputs: list[ClientOutput] = []

    async def body(engine: Orchestrator) -> None:
        outputs.extend(await collect(engine, text))

    assert with_engine(body) == {}
    assert torch.allclose(audio_of(outputs), offline_audio(text), atol=1e-5)
    assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished and outputs[-1].error is None


def test_concurrent_requests_each_get_their_own_answer() -> None:
    texts = {"a": "the first request is fairly long, several words", "b": "short one", "c": "third of three"}
    residue, got = answered_together(texts)
    assert residue == {}
    for rid, text in texts.items():
        assert text_of(got[rid]) == ToyTokenizer.normalize(text)
        assert torch.allclose(audio_of(got[rid]), offline_audio(text), atol=1e-5)


def test_text_only_request_runs_the_thinker_alone() -> None:
    outputs: list[ClientOutput] = []

    async def body(engine: Orchestrator) -> None:
        outputs.extend(await collect(engine, "just text please", modalities=("text",)))

    assert with_engine(body) == {}
    assert text_of(outputs) == "just text please"
    assert not audio_of(outputs).numel()
    assert outputs[-1].finished and outputs[-1].kind is OutputType.TEXT


def test_non_streaming_generate_yields_one_output_per_kind() -> None:
    outputs: list[ClientOutput] = []

    async def body(engine: Orchestrator) -> None:
        outputs.extend(await collect(engine, "hello there world", stream=False, word_timestamps=True))

    assert with_engine(body) == {}
    kinds = [o.kind for o in outputs[:-1]]
    assert sorted(kinds) == sorted([OutputType.TEXT, OutputType.AUDIO, OutputType.TIMESTAMPS])
    assert torch.allclose(audio_of(outputs), offline_audio("hello there world"), atol=1e-5)


def test_abort_before_any_output_still_ends_with_a_terminal_of_the_final_stage() -> None:
    """#7006: an audio client aborted before any engine output gets an audio abort terminal."""
    outputs: list[ClientOutput] = []

    async def body(engine: Orchestrator) -> None:
        async def consume() -> None:
            async for out in generate(engine, "a long answer " * 20, ("audio",), request_id="gone"):
                outputs.append(out)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            while "gone" not in engine.requests:  # submitted, and no stage has stepped yet
                await trio.sleep(0)
            await engine.abort("gone")

    assert with_engine(body) == {}
    assert len(outputs) == 1
    assert outputs[0].finished and outputs[0].error == "aborted" and outputs[0].kind is OutputType.AUDIO


def test_a_reused_request_id_waits_for_the_old_sweep() -> None:
    outputs: dict[int, list[ClientOutput]] = {}

    async def body(engine: Orchestrator) -> None:
        async def first() -> None:
            outputs[0] = await collect(engine, "first generation of this id " * 3, request_id="same")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            while "same" not in engine.requests:
                await trio.sleep(0)
            await engine.abort("same")
        outputs[1] = await collect(engine, "second generation", request_id="same")

    assert with_engine(body) == {}
    assert outputs[0][-1].error == "aborted"
    assert torch.allclose(audio_of(outputs[1]), offline_audio("second generation"), atol=1e-5)


def test_a_stalled_stage_fails_the_request_with_the_input_wait_error() -> None:
    """The Thinker never sends its chunks (its sender is mutated away here by hand): the Talker's
    input-wait deadline fails the request, and the client gets an error terminal, not a hang."""
    outputs: list[ClientOutput] = []

    async def body(engine: Orchestrator) -> None:
        thinker = engine.stages[0].adapter
        thinker.sends_chunks = False  # the Thinker's chunks go nowhere: a dead producer
        outputs.extend(await collect(engine, "nobody hears this", request_id="stalled"))

    residue = with_engine(body, input_wait_timeout_s=0.2)
    assert outputs[-1].finished and "Timed out waiting for connector input" in (outputs[-1].error or "")
    assert residue == {}


def test_a_stage_that_refuses_a_request_fails_it_and_frees_its_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage whose ``submit`` raises (a bug of ours, say) never hears of the request: it fails
    with an error terminal, every other stage lets it go, and the id is free again."""
    outputs: list[ClientOutput] = []

    async def body(engine: Orchestrator) -> None:
        talker = engine.stages[1]
        submit = talker.submit

        def refuse(*args: object, **kwargs: object) -> None:
            raise RuntimeError("cannot take it")

        monkeypatch.setattr(talker, "submit", refuse)
        outputs.extend(await collect(engine, "refused on the way", request_id="same"))
        monkeypatch.setattr(talker, "submit", submit)
        await engine.drain()
        outputs.extend(await collect(engine, "accepted now", request_id="same"))

    assert with_engine(body) == {}
    refused = next(o for o in outputs if o.finished)
    assert "talker refused the request: RuntimeError: cannot take it" in (refused.error or "")
    assert outputs[-1].finished and outputs[-1].error is None


def test_word_timestamps_without_audio_are_refused() -> None:
    async def body(engine: Orchestrator) -> None:
        with pytest.raises(ValueError, match="audio"):
            await collect(engine, "x", modalities=("text",), word_timestamps=True)
        with pytest.raises(ValueError, match="modalities"):
            await collect(engine, "x", modalities=("video",))

    assert with_engine(body) == {}


def test_cli_writes_a_playable_wav(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.wav"
    assert main(["pipeline", "run", "--text", "hello world", "--out", str(out), "--word-timestamps"]) == 0
    printed = capsys.readouterr().out
    assert "residue: none" in printed and "hello" in printed
    with wave.open(str(out)) as w:
        assert w.getframerate() == SAMPLE_RATE and w.getnchannels() == 1 and w.getnframes() > 0


def test_cli_max_tokens_cuts_the_answer_short_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["pipeline", "run", "--text", "a long answer, cut short", "--max-tokens", "4", "--json"]
    assert main([*args, "--out", str(tmp_path / "out.wav")]) == 0
    printed = capsys.readouterr().out
    payload = json.loads(printed.strip().splitlines()[-1])
    assert payload["text"] == "a long a" and payload["finish_reason"] == "length"
    assert "(cut short at --max-tokens 4)" in printed


def test_cli_stop_ends_the_answer_before_the_first_stop_string(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["pipeline", "run", "--text", "a long answer, cut short", "--stop", "cut", "--stop", ",", "--json"]
    assert main([*args, "--out", str(tmp_path / "out.wav")]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["text"] == "a long answer" and payload["finish_reason"] == "stop"


def test_shutdown_ends_requests_in_flight_with_an_error_terminal() -> None:
    store = PosixStore()
    engine = build_engine(config(True), MODELS, store)
    outputs: list[ClientOutput] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)

            async def client() -> None:
                outputs.extend(await collect(engine, "a long answer that will not finish " * 5, request_id="cut"))

            nursery.start_soon(client)
            while not any(s.finished_stages or s.stage_requests for s in engine.requests.values()):
                await trio.sleep(0)
            await trio.sleep(0.01)
            engine.shutdown()

    try:
        trio.run(main)
        assert outputs[-1].finished and outputs[-1].error == "the engine shut down"
        assert store.segments() == [] and store.lock_files() == []
    finally:
        store.sweep()


def test_a_client_that_stops_listening_aborts_its_request() -> None:
    got: list[ClientOutput] = []

    async def body(engine: Orchestrator) -> None:
        async with aclosing(generate(engine, "a long answer " * 10, request_id="gone")) as stream:
            async for out in stream:
                got.append(out)
                if out.kind is OutputType.AUDIO:
                    break  # the client disconnects after its first audio
        assert engine.requests["gone"].closed  # the abort ran at once and ended it for the client

    assert with_engine(body) == {}  # and every stage let go of it
    assert got and not got[-1].finished
