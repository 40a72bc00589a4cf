"""``omnisim serve`` over the wire: a real server on 127.0.0.1, the official ``openai`` client, a
real WebSocket client, every serving rule of #7544 checked on what arrives, bad inputs refused
in OpenAI's error shape, and clients that vanish mid-stream leaving nothing behind."""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import soundfile
from conftest import left_behind, shm_names
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK
from websockets.sync.client import connect

from runtime.models.code2wav import TAIL, TOTAL_UPSAMPLE
from runtime.models.thinker import answer_token_ids, frames_for_text, prompt_token_ids

REPO = Path(__file__).resolve().parent.parent
TEXT = "hello world, this is omnisim"
RATE = 24000


class Running:
    def __init__(self, proc: subprocess.Popen[str], url: str, banner: str) -> None:
        self.proc = proc
        self.url = url
        self.banner = banner
        self.ws = url.replace("http://", "ws://") + "/v1/audio/speech/stream"

    def stop(self, sig: signal.Signals = signal.SIGINT) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(30)


def _sigint_as_at_a_terminal() -> None:
    """A job a non-interactive shell started in the background ignores SIGINT, and a child inherits
    that: the server these tests stop with SIGINT gets it as a terminal's Ctrl-C delivers it,
    however pytest itself was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


#: The servers a test started itself, until it ends (see ``no_server_outlives_its_test``).
_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def no_server_outlives_its_test() -> Iterator[None]:
    """A test that fails before it stopped the server it started leaves no server running (it
    would hold its port, its stage processes and its /dev/shm names for the rest of the run)."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_server(*extra: str) -> Running:
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnisim.cli", "serve", "--port", "0", *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_sigint_as_at_a_terminal,
    )
    _STARTED.append(proc)
    assert proc.stdout is not None
    banner = proc.stdout.readline()
    found = re.search(r"on (http://[\d.]+:\d+)", banner)
    if found is None:
        proc.kill()
        raise AssertionError(f"no banner: {banner!r} {proc.stdout.read()}")
    return Running(proc, found.group(1), banner)


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    before = shm_names()
    running = start_server()
    _STARTED.remove(running.proc)  # (it serves the whole module)
    print(running.banner)
    yield running
    assert running.stop() == 130
    assert not left_behind(before)


@pytest.fixture
def client(server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _pcm(wav_bytes: bytes) -> bytes:
    with wave.open(io.BytesIO(wav_bytes)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)
        return w.readframes(w.getnframes())


def _speech(server: Running, **body: object) -> httpx.Response:
    response = httpx.post(f"{server.url}/v1/audio/speech", json={"input": TEXT, **body}, timeout=60)
    return response


def _sse_events(server: Running, path: str, body: dict[str, object]) -> list[dict[str, object]]:
    events = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


# -- chat completions ------------------------------------------------------------------------------


def test_chat_completions_give_text_and_a_playable_wav(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="qwen3_omni",
        messages=[{"role": "user", "content": TEXT}],
        modalities=["text", "audio"],
        audio={"format": "wav", "voice": "default"},
    )
    assert answer.choices[0].message.content == TEXT  # the toy Thinker says what it read
    audio = answer.choices[1].message.audio
    assert audio is not None and audio.expires_at > time.time()
    assert len(_pcm(base64.b64decode(audio.data))) > RATE  # more than half a second of 16-bit samples
    assert answer.usage is not None and answer.usage.total_tokens > 0


def test_streamed_chat_chunks_carry_their_modality_and_end_with_usage_when_asked(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="qwen3_omni",
            messages=[{"role": "user", "content": TEXT}],
            modalities=["text", "audio"],
            audio={"format": "pcm16"},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    modality = [(c.model_extra or {}).get("modality") for c in chunks]
    text = "".join(c.choices[0].delta.content for c, m in zip(chunks, modality, strict=True) if m == "text")
    assert text == TEXT
    assert "audio" in modality
    audio = b"".join(
        base64.b64decode(c.choices[0].delta.content) for c, m in zip(chunks, modality, strict=True) if m == "audio"
    )
    whole = _speech_pcm_alone(client)
    assert audio == whole  # each sample once, in order
    assert chunks[-1].usage is not None and chunks[-2].choices[0].finish_reason == "stop"
    # Upstream's non-OpenAI ``metrics``: time since the request began, and each chunk's audio.
    metrics = [(c.model_extra or {})["metrics"] for c in chunks[:-1]]
    elapsed = [m["elapsed_s"] for m in metrics]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0
    heard = sum(m.get("audio_s", 0) for m in metrics)
    assert abs(heard - len(whole) / 2 / RATE) < 1e-3


def test_usage_counts_the_thinkers_tokens_and_max_tokens_cuts_the_answer_short(client: openai.OpenAI) -> None:
    """As vLLM's: ``usage`` counts the prompt's and the answer's tokens (the toy's tokens are
    byte pairs, EOS included), and ``max_tokens`` (or ``max_completion_tokens``) caps the answer,
    which then ends with ``"length"`` — streamed or not, in every modality."""
    prompt, answer = len(prompt_token_ids(TEXT)), len(answer_token_ids(TEXT))
    whole = client.chat.completions.create(model="qwen3_omni", messages=[{"role": "user", "content": TEXT}])
    assert whole.usage is not None and (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt, answer)
    assert [c.finish_reason for c in whole.choices] == ["stop", "stop"]
    for cap in ({"max_tokens": 5}, {"max_completion_tokens": 5}, {"max_tokens": 99, "max_completion_tokens": 5}):
        cut = client.chat.completions.create(model="qwen3_omni", messages=[{"role": "user", "content": TEXT}], **cap)
        assert cut.choices[0].message.content == TEXT[:10]  # five pieces of two bytes
        assert [c.finish_reason for c in cut.choices] == ["length", "length"]
        assert cut.usage is not None and (cut.usage.prompt_tokens, cut.usage.completion_tokens) == (prompt, 5)
    chunks = list(
        client.chat.completions.create(
            model="qwen3_omni",
            messages=[{"role": "user", "content": TEXT}],
            modalities=["text"],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == TEXT[:6]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    stopped = client.chat.completions.create(
        model="qwen3_omni", messages=[{"role": "user", "content": TEXT}], modalities=["text"], max_tokens=answer
    )
    assert stopped.choices[0].message.content == TEXT and stopped.choices[0].finish_reason == "stop"


def test_stop_ends_the_answer_before_the_first_stop_string_in_every_output(client: openai.OpenAI) -> None:
    """As vLLM's ``stop`` (``include_stop_str_in_output`` off): the answer ends just before the
    stop string completed first, which no output holds, streamed or not; its audio says only the
    shorter answer, every choice ends with ``"stop"``, and ``usage`` counts the tokens said, EOS
    included. A single string is a list of one; a stop string at the start leaves nothing."""
    prompt = len(prompt_token_ids(TEXT))
    message = [{"role": "user", "content": TEXT}]
    # ("is" ends first, in "this", though "omnisim" is listed first; any number of them, as vLLM)
    for stop, said in (("world", "hello "), (["omnisim", "is", "a", "b", "c"], "hello world, th")):
        whole = client.chat.completions.create(
            model="qwen3_omni", messages=message, modalities=["text", "audio"], audio={"format": "wav"}, stop=stop
        )
        assert whole.choices[0].message.content == said
        assert [c.finish_reason for c in whole.choices] == ["stop", "stop"]
        assert whole.usage is not None
        # (the tokens of an answer that ends by itself after the text said, EOS included)
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt, len(answer_token_ids(said)))
        audio = whole.choices[1].message.audio
        assert audio is not None
        assert len(_pcm(base64.b64decode(audio.data))) == 2 * (frames_for_text(said) * TOTAL_UPSAMPLE - TAIL)
    chunks = list(
        client.chat.completions.create(
            model="qwen3_omni",
            messages=message,
            modalities=["text"],
            stop=["is"],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta.content or "" for c in chunks[:-1]]
    assert "".join(deltas) == "hello world, th"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9  # 8 pieces and EOS
    nothing = client.chat.completions.create(model="qwen3_omni", messages=message, stop="hello")
    assert nothing.choices[0].message.content == ""
    audio = nothing.choices[1].message.audio
    assert audio is not None and _pcm(base64.b64decode(audio.data)) == b""  # a WAV of no samples
    assert [c.finish_reason for c in nothing.choices] == ["stop", "stop"]
    assert nothing.usage is not None and nothing.usage.completion_tokens == 1  # EOS alone
    chunks = list(client.chat.completions.create(model="qwen3_omni", messages=message, stop="hello", stream=True))
    # (no audio chunk either: one would carry its samples as content)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_an_empty_stop_string_is_a_400_as_in_vllm(server: Running) -> None:
    chat = {"messages": [{"role": "user", "content": TEXT}]}
    for stop in ("", ["world", ""]):
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat | {"stop": stop})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop"
        assert refused.json()["error"]["message"] == "'stop' cannot contain an empty string"
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat | {"stop": ["world", 3]})
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("'stop' must be a string")


def test_a_streamed_chat_has_a_usage_chunk_only_when_asked(client: openai.OpenAI) -> None:
    """As OpenAI's and upstream's: a client that reads ``chunk.choices[0]`` of every chunk of a
    plain stream (most do) never meets a usage-only chunk with no choices."""
    stream = client.chat.completions.create(
        model="qwen3_omni", messages=[{"role": "user", "content": TEXT}], modalities=["text"], stream=True
    )
    chunks = list(stream)
    assert all(c.choices and c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT


def _speech_pcm_alone(client: openai.OpenAI) -> bytes:
    return client.audio.speech.create(model="qwen3_omni", voice="default", input=TEXT, response_format="pcm").content


def test_a_request_for_another_model_is_404_in_openai_shape(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert [m.id for m in client.models.list()] == ["qwen3_omni"]


# -- speech ----------------------------------------------------------------------------------------


def test_speech_create_returns_a_wav(client: openai.OpenAI) -> None:
    wav = client.audio.speech.create(model="qwen3_omni", voice="alloy", input=TEXT).content
    assert _pcm(wav) == _speech_pcm_alone(client)


@pytest.mark.parametrize(
    ("fmt", "media", "lossless"),
    [("flac", "audio/flac", True), ("mp3", "audio/mpeg", False), ("opus", "audio/ogg", False)],
)
def test_speech_in_a_compressed_format_is_that_file_of_the_same_audio(
    client: openai.OpenAI, fmt: str, media: str, lossless: bool
) -> None:
    """As upstream writes them (libsndfile): FLAC gives back the very samples; MP3 and Opus, a
    file a decoder reads at the same rate and about the same length (their codecs add padding)."""
    response = client.audio.speech.create(model="qwen3_omni", voice="default", input=TEXT, response_format=fmt)  # type: ignore[arg-type]
    assert response.response.headers["content-type"] == media
    samples, rate = soundfile.read(io.BytesIO(response.content), dtype="int16")
    pcm = _speech_pcm_alone(client)
    if lossless:
        assert samples.tobytes() == pcm
    assert rate == RATE and abs(len(samples) - len(pcm) // 2) < RATE // 10


def test_chat_audio_in_flac_is_the_same_samples(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="qwen3_omni",
        messages=[{"role": "user", "content": TEXT}],
        modalities=["audio"],
        audio={"format": "flac", "voice": "default"},
    )
    audio = answer.choices[0].message.audio
    assert audio is not None
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio.data)), dtype="int16")
    assert rate == RATE and samples.tobytes() == _speech_pcm_alone(client)


def test_a_speech_batch_speaks_every_item_in_order_and_fails_one_alone(server: Running) -> None:
    """Upstream's batch: the batch's fields are every item's unless it sets its own; an input the
    speech endpoint would refuse fails its item alone; the results in the items' order."""
    items = [{"input": TEXT}, {"input": "  "}, {"input": "another sentence", "response_format": "flac"}]
    response = httpx.post(
        f"{server.url}/v1/audio/speech/batch", json={"items": items, "response_format": "pcm"}, timeout=60
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("speech-batch") and (body["total"], body["succeeded"], body["failed"]) == (3, 2, 1)
    first, empty, flac = body["results"]
    assert [r["index"] for r in body["results"]] == [0, 1, 2]
    assert first["status"] == "success" and first["media_type"] == "audio/pcm"
    assert base64.b64decode(first["audio_data"]) == _speech(server, response_format="pcm").content
    assert first["usage"]["output_tokens"] * 2 == len(base64.b64decode(first["audio_data"]))
    assert empty["status"] == "error" and "input" in empty["error"] and "audio_data" not in empty
    alone = _speech(server, input="another sentence", response_format="pcm").content
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(flac["audio_data"])), dtype="int16")
    assert flac["media_type"] == "audio/flac" and rate == RATE and samples.tobytes() == alone


@pytest.mark.parametrize(
    "body",
    [
        {"items": []},
        {"items": [{"input": "hi"}] * 33},
        {"items": [{"voice": "x"}]},
        {"items": ["hi"]},
        {"items": [{"input": "hi", "response_format": "aac"}]},
        {"items": [{"input": "hi"}], "speed": 9},
        {"input": "hi"},
    ],
)
def test_a_speech_batch_that_no_item_could_serve_is_refused_whole(server: Running, body: dict[str, object]) -> None:
    response = httpx.post(f"{server.url}/v1/audio/speech/batch", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("items")  # type: ignore[union-attr]


def test_speech_sse_sends_each_sample_once_then_done_with_usage(server: Running) -> None:
    events = _sse_events(server, "/v1/audio/speech", {"input": TEXT, "stream": True})
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"}
    streamed = b"".join(base64.b64decode(str(e["audio"])) for e in events[:-1])
    assert streamed == _speech(server, response_format="pcm").content
    assert events[-1]["usage"]["total_tokens"] > 0  # type: ignore[index]


def test_raw_audio_streaming_is_a_wav_of_the_same_samples(server: Running) -> None:
    with httpx.stream(
        "POST", f"{server.url}/v1/audio/speech", json={"input": TEXT, "stream_format": "audio"}, timeout=60
    ) as response:
        body = response.read()
    assert response.headers["content-type"] == "audio/wav"
    assert body[:4] == b"RIFF" and body[44:] == _speech(server, response_format="pcm").content


def test_http_streaming_with_word_timestamps_points_to_the_websocket(server: Running) -> None:
    response = _speech(server, stream=True, word_timestamps=True)
    assert response.status_code == 400
    assert "/v1/audio/speech/stream" in response.json()["error"]["message"]


def test_word_timestamps_header_covers_the_audio(server: Running) -> None:
    response = _speech(server, response_format="pcm", word_timestamps=True)
    stamps = json.loads(response.headers["X-Word-Timestamps"])
    assert [s["word"] for s in stamps] == TEXT.split()
    assert all(a["end_ms"] <= b["start_ms"] for a, b in itertools.pairwise(stamps))
    audio_ms = len(response.content) / 2 / RATE * 1000
    assert stamps[0]["start_ms"] == 0 and abs(stamps[-1]["end_ms"] - audio_ms) < 1


def test_speed_changes_the_duration(server: Running) -> None:
    normal = len(_speech(server, response_format="pcm").content)
    fast = len(_speech(server, response_format="pcm", speed=2.0).content)
    assert abs(fast - normal / 2) <= 2


# -- the WebSocket ---------------------------------------------------------------------------------


def _utterance(ws: object, text: str) -> tuple[list[dict[str, object]], bytes]:
    ws.send(json.dumps({"type": "input.text", "text": text}))  # type: ignore[attr-defined]
    ws.send(json.dumps({"type": "input.done"}))  # type: ignore[attr-defined]
    messages, audio = [], b""
    while True:
        message = ws.recv()  # type: ignore[attr-defined]
        if isinstance(message, bytes):
            audio += message
            continue
        event = json.loads(message)
        messages.append(event)
        if event["type"] == "audio.chunk":
            audio += base64.b64decode(event["audio_b64"])
        if event["type"] == "session.done":
            return messages, audio


def test_a_websocket_session_returns_audio_and_word_timestamps_covering_it(server: Running) -> None:
    whole = _speech(server, response_format="pcm").content
    with connect(server.ws) as ws:
        ws.send(json.dumps({"type": "session.config", "word_timestamps": True}))
        messages, audio = _utterance(ws, TEXT)
        kinds = [m["type"] for m in messages]
        assert kinds[0] == "audio.start" and kinds[-2:] == ["audio.done", "session.done"]
        assert audio == whole  # CUMULATIVE stage outputs, each sample sent once (the trim)
        stamps = messages[-3]["timestamps"]
        assert [s["word"] for s in stamps] == TEXT.split()  # type: ignore[union-attr]
        assert abs(stamps[-1]["end_ms"] - len(audio) / 2 / RATE * 1000) < 1  # type: ignore[index]
        assert all(isinstance(s[k], int) for s in stamps for k in ("start_ms", "end_ms"))  # type: ignore[union-attr]
        # Upstream's chunk fields (its client reads them): ids in order, spans that tile the audio.
        chunks = [m for m in messages if m["type"] == "audio.chunk"]
        assert [c["chunk_id"] for c in chunks[:-1]] == list(range(len(chunks) - 1))
        assert chunks[0]["chunk_start_ms"] == 0 and all(c["sample_rate"] == RATE for c in chunks)
        assert all(a["chunk_end_ms"] == b["chunk_start_ms"] for a, b in itertools.pairwise(chunks[:-1]))
        assert chunks[-1]["chunk_end_ms"] == round(len(audio) / 2 / RATE * 1000) == chunks[-2]["chunk_end_ms"]
        assert messages[-2]["total_bytes"] == len(audio) and messages[-2]["error"] is False
        # The config is sticky; a second utterance on the same connection, as binary frames.
        ws.send(json.dumps({"type": "session.config", "word_timestamps": False}))
        messages, audio = _utterance(ws, TEXT)
        assert audio == whole and messages[-1]["utterance_index"] == 1
        ws.send(json.dumps({"type": "session.close"}))


def test_a_websocket_flooded_while_speaking_is_told_and_closed(server: Running) -> None:
    with connect(server.ws) as ws:
        ws.send(json.dumps({"type": "input.text", "text": " ".join(["word"] * 20)}))
        ws.send(json.dumps({"type": "input.done"}))
        for _ in range(80):  # more than a session keeps while it speaks
            ws.send(json.dumps({"type": "input.text", "text": "z"}))
        ws.send(json.dumps({"type": "input.done"}))
        events = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                message = ws.recv(timeout=30)
                if isinstance(message, str):
                    events.append(json.loads(message))
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        assert [e["type"] for e in events][-2:] == ["session.done", "error"]
        assert "the session is closed" in events[-1]["message"]


def test_a_websocket_refuses_bad_messages_and_stays_open(server: Running) -> None:
    with connect(server.ws) as ws:
        for bad in ("not json", json.dumps({"type": "dance"}), json.dumps({"type": "session.config", "speed": 2})):
            ws.send(bad)
            assert json.loads(ws.recv())["type"] == "error"
        _, audio = _utterance(ws, "still here")
        assert audio


# -- health, metrics, the page ---------------------------------------------------------------------


def test_health_and_metrics(server: Running) -> None:
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "healthy" and set(health["stages"]) == {"thinker", "talker", "code2wav"}
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:omni_audio_ttfp_s", "vllm:omni_audio_rtf", "vllm:omni_audio_underrun_s", "omnisim_aborts"):
        assert name in metrics
    assert 'omnisim_stage_requests{stage="talker"}' in metrics


# -- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/chat/completions", b"[1, 2]", 400),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(),
            400,
        ),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 5}).encode(),
            400,
        ),
        ("/v1/audio/speech", json.dumps({"input": "hi", "task_type": "Clone"}).encode(), 400),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "modalities": ["video"]}).encode(),
            400,
        ),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "  "}]}).encode(), 400),
        # What a batch cannot honour is refused, not ignored (found by an outside audit)
        ("/v1/audio/speech/batch", json.dumps({"items": [{"input": "hi"}], "stream": True}).encode(), 400),
        ("/v1/audio/speech/batch", json.dumps({"items": [{"input": "hi", "word_timestamps": True}]}).encode(), 400),
        (
            "/v1/chat/completions",
            json.dumps(
                {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}
            ).encode(),
            400,
        ),
        # Out of range as vLLM checks them (found by an outside audit with the openai client: a 200)
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).encode(),
            400,
        ),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(),
            400,
        ),
        (
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}).encode(),
            400,
        ),
        ("/v1/audio/speech", json.dumps({"input": ""}).encode(), 400),
        ("/v1/audio/speech", json.dumps({"input": "x" * 20_001}).encode(), 400),
        ("/v1/audio/speech", json.dumps({"input": "hi", "speed": "fast"}).encode(), 400),
        ("/v1/audio/speech", json.dumps({"input": "hi", "response_format": "aac"}).encode(), 400),
        (
            "/v1/audio/speech",
            json.dumps({"input": "hi", "response_format": "mp3", "stream_format": "audio"}).encode(),
            400,
        ),
        ("/v1/audio/speech", json.dumps({"input": "hi", "stream": "yes"}).encode(), 400),
        ("/v1/audio/speech", json.dumps({"input": "hi", "stream": False, "stream_format": "sse"}).encode(), 400),
        ("/v1/audio/speech", json.dumps({"input": "hi", "max_new_tokens": True}).encode(), 400),
        ("/v1/audio/speech", json.dumps({"voice": "alloy"}).encode(), 400),
        ("/v1/audio/speech", b"x" * (2 << 20), 413),
        ("/v1/nowhere", b"{}", 404),
        ("/v1/audio/speech/stream", b"{}", 426),  # a WebSocket endpoint, asked over plain HTTP
        # (found by a review that spoke raw HTTP: these were 500s)
        ("/v1/audio/speech", b'{"input": "hi", "speed": ' + b"1" * 5000 + b"}", 400),
        ("/v1/audio/speech", b'{"input": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
        (
            "/v1/chat/completions",
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                    "stream_options": {"include_usage": "no"},
                }
            ).encode(),
            400,
        ),
    ],
)
def test_bad_input_gets_a_4xx_in_openai_shape(server: Running, path: str, body: bytes, status: int) -> None:
    response = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"


def test_upstream_clients_fields_are_accepted(server: Running) -> None:
    """What upstream vLLM-Omni's own clients send (its examples, its bench with ``--ignore-eos``):
    fields of its other models are ignored, as upstream's request models ignore them; ``speaker``
    and ``voice: {"id"}`` name the voice; ``pcm`` is a chat audio format."""
    chat = {
        "messages": [{"role": "user", "content": TEXT}],
        "modalities": ["audio"],
        "audio": {"format": "pcm", "voice": "Ethan"},
        "ignore_eos": True,
        "top_k": 20,
        "mm_processor_kwargs": {"use_audio_in_video": False},
        "sampling_params_list": [{"temperature": 0.4}],
    }
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert reply.status_code == 200, reply.text
    whole = _speech(server, response_format="pcm").content
    assert base64.b64decode(reply.json()["choices"][0]["message"]["audio"]["data"]) == whole
    for extra in (
        {"speaker": "Ethan", "task_type": "CustomVoice", "initial_codec_chunk_frames": 0},
        {"voice": {"id": "Ethan"}, "ref_audio": "data:audio/wav;base64,AAAA", "ref_text": "hi", "seed": 3},
        {"x_vector_only_mode": True, "non_streaming_mode": False, "extra_params": {"a": 1}},
    ):
        reply = _speech(server, response_format="pcm", **extra)
        assert reply.status_code == 200 and reply.content == whole, (extra, reply.text)


def _post_ascii(server: Running, path: str, body: dict[str, object]) -> httpx.Response:
    """A body as JSON escapes it (httpx would encode it as UTF-8 first, which a surrogate fails)."""
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), headers={"content-type": "application/json"})


def test_text_utf8_cannot_carry_is_refused_and_the_session_goes_on(server: Running) -> None:
    lone = "a lone \ud800 surrogate"  # what JSON's "\\ud800" decodes to
    speech = _post_ascii(server, "/v1/audio/speech", {"input": lone})
    assert speech.status_code == 400 and "lone surrogate" in speech.json()["error"]["message"]
    chat = _post_ascii(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": lone}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    with connect(server.ws) as ws:
        ws.send(json.dumps({"type": "input.text", "text": lone}))
        ws.send(json.dumps({"type": "input.done"}))
        assert "lone surrogate" in json.loads(ws.recv(timeout=30))["message"]
        _, audio = _utterance(ws, "still here")
        assert audio


def test_null_means_not_set_as_openai_clients_send_it(server: Running) -> None:
    nulls = {"speed": None, "stream": None, "stream_format": None, "response_format": None, "voice": None}
    speech = _speech(server, **nulls)
    assert speech.status_code == 200 and speech.headers["content-type"] == "audio/wav"
    asked = {"messages": [{"role": "user", "content": TEXT}], "n": None, "audio": None, "modalities": None}
    plain = asked | {"response_format": {"type": "text"}, "tools": None, "tool_choice": "none"}
    chat = httpx.post(f"{server.url}/v1/chat/completions", json=plain, timeout=60)
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == TEXT
    for field, value in (("tools", [{"type": "function"}]), ("response_format", {"type": "json_object"})):
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=asked | {field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field


def test_models_retrieve_and_a_wrong_method_as_clients_expect(client: openai.OpenAI, server: Running) -> None:
    assert client.models.retrieve("qwen3_omni").id == "qwen3_omni"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    wrong = httpx.get(f"{server.url}/v1/audio/speech")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    # A page served from elsewhere may call it (any origin, as upstream's server by default).
    asked = {"origin": "http://elsewhere.example", "access-control-request-method": "POST"}
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers=asked)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    listed = httpx.get(f"{server.url}/v1/models", headers={"origin": "http://elsewhere.example"})
    assert listed.headers["access-control-allow-origin"] == "*"


def _metric(server: Running, line_start: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics").text
    found = re.search(rf"^{re.escape(line_start)} (\S+)$", metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_refused_request_counts_as_refused_only(server: Running) -> None:
    accepted, refused = (
        'omnisim_requests_total{endpoint="speech"}',
        'omnisim_requests_rejected_total{endpoint="speech"}',
    )
    before = _metric(server, accepted), _metric(server, refused)
    assert _speech(server, model="gpt-4o").status_code == 404
    assert _speech(server, stream=True, word_timestamps=True).status_code == 400
    # A body refused before it is read as a request counts too.
    speech = f"{server.url}/v1/audio/speech"
    assert httpx.post(speech, content=b"{bad", headers={"content-type": "application/json"}).status_code == 400
    assert httpx.post(speech, content=b"x" * (2 << 20)).status_code == 413
    assert (_metric(server, accepted), _metric(server, refused)) == (before[0], before[1] + 4)


def test_json_that_only_python_reads_is_refused(server: Running) -> None:
    for body in (b'{"input": "hi", "speed": NaN}', b'{"input": "hi", "speed": Infinity}'):
        refused = httpx.post(f"{server.url}/v1/audio/speech", content=body)
        assert refused.status_code == 400 and "not a JSON number" in refused.json()["error"]["message"]


def test_an_error_names_the_field_as_the_client_wrote_it(server: Running) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (
        ({"audio": {"format": 3}}, "audio.format"),
        ({"stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
        ({"max_tokens": 0}, "max_tokens"),
    ):
        error = httpx.post(f"{server.url}/v1/chat/completions", json=chat | extra).json()["error"]
        assert error["param"] == param and f"'{param}'" in error["message"]
    # A number out of range is named by its value; a type by its JSON name.
    assert error["message"] == "'max_tokens' must be an integer >= 1, got 0"
    error = _speech(server, input=None).json()["error"]
    assert error["param"] == "input" and error["message"].endswith("not null")


def test_a_batch_item_naming_another_model_fails_alone(server: Running) -> None:
    items = [{"input": "one"}, {"input": "two", "model": "gpt-4o"}]
    body = httpx.post(f"{server.url}/v1/audio/speech/batch", json={"items": items}, timeout=60).json()
    assert [r["status"] for r in body["results"]] == ["success", "error"]
    assert "gpt-4o" in body["results"][1]["error"] and (body["succeeded"], body["failed"]) == (1, 1)


def test_audio_metrics_count_audio_requests_that_ended_well(server: Running) -> None:
    counts = "vllm:omni_audio_underrun_s_count", "vllm:omni_audio_ttfp_s_count"
    before = [_metric(server, c) for c in counts]
    chat = {"messages": [{"role": "user", "content": TEXT}], "modalities": ["text"]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    assert [_metric(server, c) for c in counts] == before  # (a text answer plays no audio)
    assert _speech(server).status_code == 200
    assert [_metric(server, c) for c in counts] == [b + 1 for b in before]


def test_usage_counts_samples_streamed_or_not(server: Running) -> None:
    done = _sse_events(server, "/v1/audio/speech", {"input": TEXT, "stream": True})[-1]
    whole = _speech(server, response_format="pcm")
    assert done["usage"]["output_tokens"] == int(whole.headers["x-vllm-omni-output-tokens"]) == len(whole.content) // 2  # type: ignore[index]


def test_a_websocket_takes_the_next_utterance_while_one_is_spoken(server: Running) -> None:
    with connect(server.ws) as ws:
        for text in ("the first one", "the second one"):  # sent before the first is spoken
            ws.send(json.dumps({"type": "input.text", "text": text}))
            ws.send(json.dumps({"type": "input.done"}))
        spoken, frames = [], 0
        while len(spoken) < 2:
            message = ws.recv(timeout=30)
            if isinstance(message, bytes):
                frames += 1  # stream_audio is off, as upstream's default: one frame per utterance
            elif (event := json.loads(message))["type"] == "session.done":
                spoken.append(event["utterance_index"])
        assert spoken == [0, 1] and frames == 2
        ws.send(json.dumps({"type": "input.text", "text": "x" * 20_000}))
        ws.send(json.dumps({"type": "input.text", "text": "y"}))  # over the limit: refused, the rest kept
        assert "limit is 20000" in json.loads(ws.recv(timeout=30))["message"]
        ws.send(json.dumps({"type": "session.close"}))
        with pytest.raises(ConnectionClosedOK):
            ws.recv(timeout=30)


def test_a_session_close_right_after_input_done_closes_once_the_utterance_is_spoken(server: Running) -> None:
    """As upstream's server takes a session's messages, in order (its streaming client sends
    ``input.done`` and ``session.close`` back to back): nothing is aborted."""
    aborts = _metric(server, "omnisim_aborts_total")
    received: list[str | bytes] = []
    with connect(server.ws) as ws:
        ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        ws.send(json.dumps({"type": "input.done"}))
        ws.send(json.dumps({"type": "session.close"}))
        with pytest.raises(ConnectionClosedOK):
            while True:
                received.append(ws.recv(timeout=30))
    assert ws.close_code == 1000
    events = [json.loads(m)["type"] if isinstance(m, str) else "pcm" for m in received]
    assert events == ["audio.start", "pcm", "audio.done", "session.done"]
    assert received[1] == _speech(server, response_format="pcm").content
    assert _metric(server, "omnisim_aborts_total") == aborts


def test_a_session_in_wav_sends_each_utterance_as_a_wav_file(server: Running) -> None:
    with connect(server.ws) as ws:
        ws.send(json.dumps({"type": "session.config", "response_format": "wav", "speaker": "Ethan"}))
        ws.send(json.dumps({"type": "input.text", "text": TEXT}))
        ws.send(json.dumps({"type": "input.done"}))
        start = json.loads(ws.recv(timeout=30))
        utterance = ws.recv(timeout=30)
        done = json.loads(ws.recv(timeout=30))
    assert start["type"] == "audio.start" and start["format"] == "wav"
    assert isinstance(utterance, bytes)
    assert done["type"] == "audio.done" and done["total_bytes"] == len(utterance)  # (its header too)
    whole = _speech(server, response_format="pcm").content
    with wave.open(io.BytesIO(utterance)) as w:
        assert w.getframerate() == RATE and w.readframes(w.getnframes()) == whole


def test_a_whole_response_is_aborted_when_its_client_goes(server: Running) -> None:
    aborts = _metric(server, "omnisim_aborts_total")
    with pytest.raises(httpx.TimeoutException):  # many seconds of audio: it is still running
        httpx.post(f"{server.url}/v1/audio/speech", json={"input": "word " * 3000}, timeout=1)
    deadline = time.monotonic() + 10
    while _metric(server, "omnisim_aborts_total") == aborts and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server, "omnisim_aborts_total") == aborts + 1
    assert _metric(server, 'omnisim_stage_requests{stage="code2wav"}') == 0


def test_a_signal_ends_a_stream_in_flight_with_an_error_event_at_once() -> None:
    before = shm_names()
    running = start_server()
    events: list[str] = []
    try:
        with httpx.stream(
            "POST", f"{running.url}/v1/audio/speech", json={"input": "word " * 3000, "stream": True}, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line.startswith("event: "):
                    if not events:
                        signalled = time.monotonic()
                        running.proc.send_signal(signal.SIGINT)
                    events.append(line[7:])
        ended = time.monotonic() - signalled
        assert events[-1] == "speech.audio.error" and ended < 2.5, (events[-1], ended)
    finally:
        assert running.proc.wait(30) == 130
    assert not left_behind(before)


def test_a_signal_ends_an_utterance_in_flight_with_an_error_event_then_audio_done() -> None:
    """Upstream's streaming client learns of a failed utterance from an ``error`` event; then
    every session, an idle one too, is closed as going away (1001), not dropped (1006) once the
    server's graceful wait ran out."""
    before = shm_names()
    running = start_server()
    events: list[dict[str, object]] = []
    try:
        with connect(running.ws) as idle, connect(running.ws) as ws:
            ws.send(json.dumps({"type": "input.text", "text": "word " * 3000}))
            ws.send(json.dumps({"type": "input.done"}))
            assert json.loads(ws.recv(timeout=30))["type"] == "audio.start"
            running.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(ConnectionClosed):
                while True:
                    message = ws.recv(timeout=30)
                    if isinstance(message, str):
                        events.append(json.loads(message))
            with pytest.raises(ConnectionClosed):
                idle.recv(timeout=30)
    finally:
        assert running.proc.wait(30) == 130
    assert not left_behind(before)
    kinds = [e["type"] for e in events]
    assert kinds == ["error", "audio.done", "session.done"], kinds
    assert "shut down" in str(events[0]["message"]) and events[1]["error"] is True
    assert (ws.close_code, idle.close_code) == (1001, 1001)


def _speech_in_flight(running: Running, *, words: int, held_by: str) -> tuple[threading.Thread, list[httpx.Response]]:
    """A whole speech request of ``words`` words, asked on a thread of its own; returns once the
    stage ``held_by`` holds it (the reply lands in the list when it comes)."""
    replies: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: replies.append(_speech(running, input="word " * words)), daemon=True)
    asking.start()
    while _metric(running, f'omnisim_stage_requests{{stage="{held_by}"}}') < 1:
        time.sleep(0.05)
    return asking, replies


def test_a_whole_response_pending_at_a_signal_is_a_503() -> None:
    """The engine stopped under the request: a client may retry later or elsewhere (not a 500)."""
    before = shm_names()
    running = start_server()
    try:
        asking, replies = _speech_in_flight(running, words=3000, held_by="thinker")
        running.proc.send_signal(signal.SIGINT)
        asking.join(30)
    finally:
        assert running.proc.wait(30) == 130
    assert not left_behind(before)
    [reply] = replies
    assert reply.status_code == 503, reply.text
    assert reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["type"] == "server_error" and "shut down" in reply.json()["error"]["message"]


# -- clients that vanish ---------------------------------------------------------------------------


def test_clients_disconnecting_at_random_moments_leave_nothing_behind(server: Running) -> None:
    rng = random.Random(7)
    ways = ["speech-sse", "speech-raw", "chat", "ws"]
    for i in range(200):
        way, cut = ways[i % len(ways)], rng.randint(0, 6)
        text = f"request {i} " + "words " * rng.randint(1, 30)
        if way == "ws":
            with connect(server.ws) as ws:
                ws.send(json.dumps({"type": "input.text", "text": text}))
                ws.send(json.dumps({"type": "input.done"}))
                for _ in range(cut):
                    message = ws.recv(timeout=30)
                    if isinstance(message, str) and "session.done" in message:
                        break
            continue
        path, body = (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "stream": True})
            if way == "chat"
            else ("/v1/audio/speech", {"input": text, "stream_format": "sse" if way == "speech-sse" else "audio"})
        )
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as response:
            for n, _ in enumerate(response.iter_raw(64)):
                if n >= cut:
                    break
    # Every abort and release sweep runs on the server's own tasks: give them a moment.
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(f"{server.url}/metrics").text
        live = [
            line for line in metrics.splitlines() if re.match(r"omnisim_(stage_requests|store_\w+)\b.* [1-9]", line)
        ]
        if not live or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not live, live
    aborts = float(re.search(r"^omnisim_aborts_total (\S+)", metrics, re.M).group(1))  # type: ignore[union-attr]
    assert aborts > 50  # most were cut before their end


def test_a_batch_whose_client_went_away_aborts_every_item(server: Running) -> None:
    def aborts() -> float:
        return float(re.search(r"^omnisim_aborts_total (\S+)", httpx.get(f"{server.url}/metrics").text, re.M).group(1))  # type: ignore[union-attr]

    before = aborts()
    items = [{"input": f"item {i} " + "words " * 400} for i in range(4)]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/audio/speech/batch", json={"items": items}, timeout=httpx.Timeout(60, read=0.5))

    def thinking() -> float:
        return _metric(server, 'omnisim_stage_requests{stage="thinker"}')

    # (the Thinker drops an aborted request at its next step: on a busy machine, a moment later)
    deadline = time.monotonic() + 10
    while (aborts() < before + len(items) or thinking()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborts() == before + len(items)
    assert thinking() == 0


# -- processes, the page -----------------------------------------------------------------------------


def test_serve_with_stage_processes() -> None:
    before = shm_names()
    running = start_server("--processes")
    try:
        assert "as processes" in running.banner
        # Text UTF-8 cannot carry is refused before a stage process sees it (it once ended the server).
        refused = _post_ascii(running, "/v1/audio/speech", {"input": "a\ud800b"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
        response = httpx.post(f"{running.url}/v1/audio/speech", json={"input": TEXT}, timeout=60)
        assert response.status_code == 200 and _pcm(response.content)
    finally:
        assert running.stop(signal.SIGTERM) == 143
    assert not left_behind(before)


def _stage_process(server: Running, stage_id: int) -> int:
    """The pid of the server's stage process ``stage_id``."""
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        ours = ppid == server.proc.pid and b"runtime.stage_process" in argv
        # (python -m runtime.stage_process DESCRIPTION FD)
        if ours and json.loads(argv[argv.index(b"runtime.stage_process") + 1])["stage_id"] == stage_id:
            return int(entry.name)
    raise AssertionError(f"no stage process {stage_id} under the server")


def test_a_stage_dying_under_a_whole_response_is_a_503_and_a_retry_succeeds() -> None:
    """The stage restarts by itself: the client is told to retry (503, Retry-After), not that its
    request was bad (500), and the retry succeeds."""
    before = shm_names()
    running = start_server("--processes")
    try:
        asking, replies = _speech_in_flight(running, words=2000, held_by="talker")
        os.kill(_stage_process(running, 1), signal.SIGKILL)
        asking.join(60)
        [reply] = replies
        assert reply.status_code == 503, reply.text
        assert reply.headers["retry-after"] == "1"
        assert "stage talker died" in reply.json()["error"]["message"]
        retried = _speech(running)
        assert retried.status_code == 200 and _pcm(retried.content)
    finally:
        assert running.stop(signal.SIGTERM) == 143
    assert not left_behind(before)


BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


def test_the_page_speaks_and_highlights_in_a_real_browser(server: Running, tmp_path: Path) -> None:
    """A real headless browser, driven by Playwright: type, press Speak, see each word light up
    while its audio plays, and the status say everything was played."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed")
    browser_path = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser_path is None:
        pytest.skip(f"no headless browser installed (looked for {', '.join(BROWSERS)}); CI installs one")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=browser_path, args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"]
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.fill("#text", "hello world from the browser")
            page.click("#speak")
            page.wait_for_selector("#words span.now", timeout=20_000)  # a word lights up as it plays
            page.wait_for_function("document.getElementById('status').textContent.startsWith('played')")
            shot = tmp_path / "page.png"
            page.screenshot(path=str(shot))
            print(f"screenshot: {shot}")
            assert page.inner_text("#status").startswith("played 5 words")
            assert page.inner_text("#words").split() == ["hello", "world", "from", "the", "browser"]
            assert errors == []
        finally:
            browser.close()


def test_a_bad_pipeline_or_a_taken_port_is_a_usage_error(server: Running) -> None:
    port = server.url.rsplit(":", 1)[1]
    for args, message in (
        (["--pipeline", "nope"], "no shipped pipeline"),
        (["--pipeline", "qwen3_tts_aligner"], "thinker -> talker -> code2wav"),
        (["--port", port], "cannot listen"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "omnisim.cli", "serve", *(["--port", "0"] if "--port" not in args else []), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("http", ["1.0", "1.1 close"])
def test_a_stream_ends_its_connection_when_the_client_asked_for_that(server: Running, http: str) -> None:
    """HTTP/1.0 and ``Connection: close`` clients (a proxy, by default) waited for good after the
    last event: the connection was never closed (found by a review that spoke raw HTTP)."""
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"input": "hi", "stream": True}).encode()
    version, close = ("HTTP/1.0", "") if http == "1.0" else ("HTTP/1.1", "Connection: close\r\n")
    head = f"POST /v1/audio/speech {version}\r\nHost: {host}\r\n{close}Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        received = b""
        while chunk := sock.recv(65536):  # (a timeout raises: the connection stayed open)
            received += chunk
    assert b"speech.audio.done" in received
