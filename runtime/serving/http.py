"""The OpenAI-compatible server: an ASGI application (Starlette) over one engine, with
upstream vLLM-Omni's endpoints, field names and events.

Every request goes through :func:`runtime.client.generate`, the client API the pipeline
scenarios explore under the simulator, so the serving rules (#7544: DELTA or CUMULATIVE, the
``emitted_samples`` trim, the HTTP streaming + timestamps rejection) are the ones verified there.
This module is the HTTP layer only: parsing, encoding, streaming, and noticing a client that went
away, which aborts its request at once (a cancelled stream closes ``generate``, whose ``finally``
is the abort). The HTTP layer itself is not simulated; it waits on the network through Starlette
and anyio, as any ASGI application does.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, TypeVar

import anyio
import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from runtime import serving
from runtime.client import ClientOutput, generate
from runtime.config.topology import OutputType
from runtime.connectors.stores import Store
from runtime.kernel import current_kernel
from runtime.models.aligner import WordTimestamp
from runtime.models.code2wav import SAMPLE_RATE
from runtime.orchestrator import ABORTED, Orchestrator, Unavailable
from runtime.serving.audio import COMPRESSED, MEDIA_TYPES, encode, pcm16, wav_header
from runtime.serving.metrics import Playback, ServingMetrics
from runtime.serving.requests import (
    ApiError,
    BatchItem,
    SessionConfig,
    SpeechRequest,
    parse_chat,
    parse_session_config,
    parse_speech,
    parse_speech_batch,
)
from runtime.stages import TextFinish

#: The largest request body read (a 20,000-character input is well under it).
MAX_BODY_BYTES = 1 << 20
#: Upstream's cap on the ``X-Word-Timestamps`` header; past it the header is omitted.
WORD_TIMESTAMPS_HEADER_CAP = 4096
#: How long a chat completion's audio stays fetchable, as OpenAI announces it (``expires_at``).
AUDIO_EXPIRES_S = 24 * 3600
#: The ``Retry-After`` of a 503: a new request waits for a stage that is restarting by itself,
#: so a client need not wait long before it retries.
RETRY_AFTER_S = 1
PAGE = Path(__file__).with_name("static") / "index.html"

log = logging.getLogger(__name__)
T = TypeVar("T")


class Server:
    """The endpoints of one engine, served under ``model_name``."""

    def __init__(self, engine: Orchestrator, store: Store, *, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = ServingMetrics(engine, store)
        self.created = int(_wall_clock())
        #: Set when the server stops: a WebSocket session waiting for its client's next message
        #: is closed (1001, going away) instead of being dropped at the graceful timeout.
        self._stopping = anyio.Event()

    def stop(self) -> None:
        """The server is stopping (the engine has ended every request in flight already)."""
        self._stopping.set()

    def app(self) -> Starlette:
        routes = [
            Route("/", self.page),
            Route("/v1/models", self.models),
            Route("/v1/models/{model:path}", self.model),
            Route("/health", self.health),
            Route("/metrics", self.prometheus),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/audio/speech", self.speech, methods=["POST"]),
            Route("/v1/audio/speech/batch", self.speech_batch, methods=["POST"]),
            WebSocketRoute("/v1/audio/speech/stream", self.speech_stream),
            Route("/v1/audio/speech/stream", _websocket_only, methods=["GET", "POST"]),
        ]
        handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
        # Any origin, as upstream's server allows by default: a page served elsewhere may call it.
        cors = Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
        return Starlette(routes=routes, exception_handlers=handlers, middleware=[cors])  # type: ignore[arg-type]

    # -- plain endpoints ----------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        return HTMLResponse(PAGE.read_text())

    def _card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "omnisim"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._card())

    async def health(self, request: Request) -> Response:
        stages = self.engine.health()
        failing = [name for name, h in stages.items() if not h.get("alive")]
        status = 503 if failing else 200
        # ("healthy", as upstream's server and the connector's health() say it)
        body = {"status": "unhealthy" if failing else "healthy", "failing": failing, "stages": stages}
        return JSONResponse(body, status_code=status)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    # -- chat completions ---------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        chat = await self._accept("chat", request, parse_chat)
        began = current_kernel().now()
        rid = _request_id("chatcmpl")
        outputs = self._outputs(
            chat.text,
            chat.modalities,
            stream=chat.stream,
            word_timestamps=False,
            rid=rid,
            max_tokens=chat.max_tokens,
            stop=chat.stop,
        )
        if chat.stream:
            return _sse(self._chat_chunks(rid, chat.audio_format, chat.include_usage, outputs, began))
        collected = await _unless_gone(request, lambda: _collect(outputs))
        if collected is None:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        text, audio, _, error, finish = collected
        if error is not None:
            raise _request_failed(error)
        # (an answer cut short by max_tokens or a stop string is cut short in every modality:
        # the audio says it too)
        reason = finish.reason if finish else "stop"
        choices: list[dict[str, Any]] = []
        if "text" in chat.modalities:
            message = {"role": "assistant", "content": text}
            choices.append({"index": len(choices), "message": message, "finish_reason": reason})
        if "audio" in chat.modalities:
            clip = {
                "id": f"audio-{rid}",
                "data": base64.b64encode(await _encoded(audio, chat.audio_format)).decode(),
                "expires_at": int(_wall_clock()) + AUDIO_EXPIRES_S,
                "transcript": "",
            }
            message = {"role": "assistant", "content": None, "audio": clip}
            choices.append({"index": len(choices), "message": message, "finish_reason": reason})
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(_wall_clock()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(finish),
                "metrics": _metrics(began, audio),
            }
        )

    async def _chat_chunks(
        self,
        rid: str,
        audio_format: str,
        include_usage: bool,
        outputs: AsyncIterator[ClientOutput],
        began: float,
    ) -> AsyncIterator[dict[str, Any]]:
        created = int(_wall_clock())

        def chunk(
            modality: str | None, delta: dict[str, Any], finish: str | None = None, audio: Any = None
        ) -> dict[str, Any]:
            body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created}
            body |= {"model": self.model_name, "modality": modality, "metrics": _metrics(began, audio)}
            return body | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        error: str | None = None
        finish: TextFinish | None = None
        async with aclosing(outputs) as stream:
            async for out in stream:
                if out.finished:
                    error, finish = out.error, out.text_finish
                elif out.kind is OutputType.TEXT:
                    yield chunk("text", {"role": "assistant", "content": out.data})
                elif out.kind is OutputType.AUDIO:
                    data = base64.b64encode(await _encoded(out.data, audio_format)).decode()
                    yield chunk("audio", {"role": "assistant", "content": data}, audio=out.data)
        if error is not None:
            yield _request_failed(error).body()
            return
        yield chunk(None, {}, finish.reason if finish else "stop")
        if include_usage:
            yield {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": _usage(finish),
            }

    # -- speech -------------------------------------------------------------------------------

    async def speech(self, request: Request) -> Response:
        speech = await self._accept("speech", request, parse_speech, self._check_speech)
        rid = _request_id("speech")
        outputs = self._outputs(
            speech.text, ("audio",), stream=speech.stream, word_timestamps=speech.word_timestamps, rid=rid
        )
        if speech.stream_format == "sse":
            return _sse(_speech_events(outputs), named=True)
        if speech.stream_format == "audio":
            media = MEDIA_TYPES[speech.response_format]
            return _Streamed(_raw_audio(speech.response_format, outputs), media_type=media)
        spoken = await _unless_gone(request, lambda: _spoken(speech, outputs))
        if spoken is None:
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        answer, error = spoken
        if error is not None:
            raise error
        headers = _usage_headers(answer)
        if speech.word_timestamps:
            value = json.dumps(_timestamps(answer.stamps), separators=(",", ":"))
            if len(value) <= WORD_TIMESTAMPS_HEADER_CAP:
                headers["X-Word-Timestamps"] = value
            else:
                omitted = f"oversize; bytes={len(value)}; limit={WORD_TIMESTAMPS_HEADER_CAP}"
                headers["X-Word-Timestamps-Omitted"] = omitted
        body = await _encoded(answer.audio, speech.response_format)
        return Response(body, media_type=MEDIA_TYPES[speech.response_format], headers=headers)

    async def speech_batch(self, request: Request) -> Response:
        """Every item spoken at once, as a whole speech request; 200 with each item's audio or
        error in the items' order (one that fails fails alone), unless the batch is refused."""
        batch = await self._accept("speech_batch", request, parse_speech_batch)
        results: list[dict[str, Any]] = [{} for _ in batch.items]

        async def speak(i: int, item: BatchItem) -> None:
            results[i] = {"index": i} | await self._batch_item(item)

        async def speak_all() -> list[dict[str, Any]]:
            async with anyio.create_task_group() as all_items:
                for i, item in enumerate(batch.items):
                    all_items.start_soon(speak, i, item)
            return results

        if await _unless_gone(request, speak_all) is None:
            return Response(status_code=499)
        failed = sum(r["status"] == "error" for r in results)
        body = {"id": _request_id("speech-batch"), "results": results, "total": len(results)}
        return JSONResponse(body | {"succeeded": len(results) - failed, "failed": failed})

    async def _batch_item(self, item: BatchItem) -> dict[str, Any]:
        """An item's result without its index: its audio (base64), media type and usage, or its error."""
        if item.speech is None:
            return {"status": "error", "error": item.error}
        speech = item.speech
        try:
            self._check_model(speech.model)
        except ApiError as e:
            return {"status": "error", "error": str(e)}
        outputs = self._outputs(speech.text, ("audio",), stream=False, word_timestamps=False, rid=_request_id("speech"))
        answer, error = await _spoken(speech, outputs)
        if error is not None:
            return {"status": "error", "error": str(error)}
        return {
            "status": "success",
            "audio_data": base64.b64encode(await _encoded(answer.audio, speech.response_format)).decode(),
            "media_type": MEDIA_TYPES[speech.response_format],
            "usage": _speech_usage(answer.text_finish, answer.audio.numel()),
        }

    # -- the WebSocket --------------------------------------------------------------------------

    async def speech_stream(self, ws: WebSocket) -> None:
        """``session.config`` (sticky), ``input.text`` (buffered), ``input.done`` (speak the
        buffer, keep the connection), ``session.close``. Messages that arrive while an utterance
        is spoken wait their turn, as on upstream's server (a client may stream the next
        sentence's text meanwhile; a ``session.close`` sent right after ``input.done`` closes
        once the utterance was spoken); a client that goes away mid-utterance aborts it at once."""
        await ws.accept()
        config = SessionConfig()
        buffered: list[str] = []
        chars = 0
        inbox: deque[dict[str, Any]] = deque()  # what came while an utterance was spoken
        utterance = 0
        try:
            while True:
                message = inbox.popleft() if inbox else await self._next_message_or_stop(ws)
                if message is None:
                    if self._stopping.is_set():
                        await ws.close(code=1001)
                    return
                kind = message.get("type")
                try:
                    if kind == "session.config":
                        if buffered:
                            raise ApiError("session.config while text is buffered: send input.done first")
                        config = parse_session_config(message)
                    elif kind == "input.text":
                        text = message.get("text")
                        if not isinstance(text, str):
                            raise ApiError("input.text needs a 'text' string", param="text")
                        if chars + len(text) > serving.MAX_INPUT_CHARS:
                            raise ApiError(
                                f"the buffered text would have {chars + len(text)} characters; the limit is "
                                f"{serving.MAX_INPUT_CHARS} (send input.done first)",
                                param="text",
                            )
                        buffered.append(text)
                        chars += len(text)
                    elif kind == "input.done":
                        text, buffered, chars = "".join(buffered), [], 0
                        if not await self._speak(ws, config, text, utterance, inbox):
                            return
                        utterance += 1
                    elif kind == "session.close":
                        await ws.close()
                        return
                    elif message is _OVERFLOWED:
                        # What the client meant after the dropped messages (an input.done, a
                        # close) is lost with them: the session ends here rather than wait for it.
                        await ws.send_json(
                            {
                                "type": "error",
                                "message": f"the session is closed: more than {MAX_QUEUED} messages or "
                                f"{MAX_QUEUED_CHARS} characters of text were sent while an utterance was spoken",
                            }
                        )
                        await ws.close(code=1008)
                        return
                    else:
                        raise ApiError(f"unknown message type {kind!r}", param="type")
                except ApiError as e:
                    await ws.send_json({"type": "error", "message": str(e)})
        except WebSocketDisconnect:
            return

    async def _next_message_or_stop(self, ws: WebSocket) -> dict[str, Any] | None:
        """The session's next message; None once the client disconnected or the server stops."""
        message: dict[str, Any] | None = None
        async with anyio.create_task_group() as race:

            async def receive() -> None:
                nonlocal message
                with contextlib.suppress(WebSocketDisconnect):  # (gone while told of a bad message)
                    message = await _next_message(ws)
                race.cancel_scope.cancel()

            race.start_soon(receive)
            await self._stopping.wait()
            race.cancel_scope.cancel()
        return message

    async def _speak(
        self, ws: WebSocket, config: SessionConfig, text: str, utterance: int, inbox: deque[dict[str, Any]]
    ) -> bool:
        """One utterance; False if the session ended meanwhile (its request is aborted). What
        else the client sends meanwhile goes to ``inbox``."""
        if not text.strip():
            await ws.send_json({"type": "session.done", "utterance_index": utterance, "total_sentences": 0})
            return True
        try:
            serving.check_input_text(text)
        except serving.RequestRejected as e:
            raise ApiError(str(e), param="text") from None
        where = {"utterance_index": utterance, "sentence_index": 0}
        await ws.send_json(
            {
                "type": "audio.start",
                **where,
                "sentence_text": text,
                "format": config.response_format,
                "sample_rate": SAMPLE_RATE,
                "word_timestamps": config.word_timestamps,
            }
        )
        sent = 0
        held: list[bytes] = []
        stamps: list[WordTimestamp] = []
        error: str | None = None
        gone = False
        chunks = 0
        outputs = self._outputs(
            text, ("audio",), stream=True, word_timestamps=config.word_timestamps, rid=_request_id("ws")
        )
        async with anyio.create_task_group() as watch:

            async def watch_for_the_end() -> None:
                nonlocal gone
                while (message := await _next_message(ws)) is not None:
                    if inbox and inbox[-1] is _OVERFLOWED:
                        continue  # (the session ends once the utterance was spoken)
                    if len(inbox) < MAX_QUEUED and _queued_chars(inbox) + _queued_chars([message]) <= MAX_QUEUED_CHARS:
                        inbox.append(message)
                    else:
                        inbox.append(_OVERFLOWED)  # (said once the utterance ended, in order)
                gone = True
                watch.cancel_scope.cancel()

            watch.start_soon(watch_for_the_end)
            async with aclosing(outputs) as stream:
                async for out in stream:
                    if out.finished:
                        error = out.error
                    elif out.kind is OutputType.TIMESTAMPS:
                        stamps = out.data
                    elif out.kind is OutputType.AUDIO:
                        data = pcm16(out.data)
                        if config.word_timestamps:
                            chunk = {
                                "type": "audio.chunk",
                                **where,
                                **_chunk_span(chunks, sent, len(data)),
                                "audio_b64": base64.b64encode(data).decode(),
                            }
                            await ws.send_json(chunk | {"timestamps": None})
                            chunks += 1
                        elif config.stream_audio:
                            await ws.send_bytes(data)
                        else:
                            held.append(data)
                        sent += len(data)
            watch.cancel_scope.cancel()
        if gone:
            return False
        if held:
            audio = b"".join(held)
            header = wav_header(SAMPLE_RATE, len(audio)) if config.response_format == "wav" else b""
            await ws.send_bytes(header + audio)
            sent += len(header)  # (the bytes the client got: its frame is a WAV file)
        if config.word_timestamps:
            final = {"type": "audio.chunk", **where, **_chunk_span(chunks, 0, sent), "audio_b64": ""}
            await ws.send_json(final | {"timestamps": _timestamps(stamps)})
        if error is not None:  # (upstream's client learns of a failed utterance from this event)
            await ws.send_json({"type": "error", **where, "message": f"the utterance failed: {error}"})
        done = {"type": "audio.done", **where, "total_bytes": sent, "error": error is not None}
        await ws.send_json(done | ({"message": error} if error else {}))
        await ws.send_json({"type": "session.done", "utterance_index": utterance, "total_sentences": 1})
        return True

    # -- shared -------------------------------------------------------------------------------

    async def _accept(self, endpoint: str, request: Request, parse: Any, check: Any = None) -> Any:
        """The request's body parsed, counted as accepted once every check passed, else (a body
        too large or not JSON included) as rejected."""
        try:
            parsed = parse(await _json_body(request))
            self._check_model(parsed.model)
            if check is not None:
                check(parsed)
        except ApiError:
            self.metrics.rejected.labels(endpoint=endpoint).inc()
            raise
        self.metrics.requests.labels(endpoint=endpoint).inc()
        return parsed

    def _check_speech(self, speech: Any) -> None:
        try:
            serving.check_http_speech_request(
                stream=speech.stream,
                word_timestamps=speech.word_timestamps,
                has_aligner=self.engine.aligner is not None,
            )
        except serving.RequestRejected as e:
            raise ApiError(str(e), param="word_timestamps") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )

    async def _outputs(
        self,
        text: str,
        modalities: tuple[str, ...],
        *,
        stream: bool,
        word_timestamps: bool,
        rid: str,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
    ) -> AsyncIterator[ClientOutput]:
        """``generate``, measured: how its audio would play, and whether it ran to its end."""
        k = current_kernel()
        playback = Playback(k.now())
        ended = False
        error: str | None = None
        try:
            try:
                async with aclosing(
                    generate(
                        self.engine,
                        text,
                        modalities,
                        stream=stream,
                        word_timestamps=word_timestamps,
                        request_id=rid,
                        max_tokens=max_tokens,
                        stop=stop,
                    )
                ) as stream_:
                    async for out in stream_:
                        if out.kind is OutputType.AUDIO and out.data is not None:
                            playback.packet(k.now(), out.data.numel() / SAMPLE_RATE)
                        if out.finished:
                            ended, error = True, out.error
                        yield out
            except Exception as e:
                # A bug of ours: this client gets an error terminal, as for any failed request,
                # and the server goes on (in a stream, after its headers, nothing else can say it).
                log.exception("request %s failed inside the server", rid)
                kind = OutputType.AUDIO if "audio" in modalities else OutputType.TEXT
                ended, error = True, f"internal error: {type(e).__name__}"
                yield ClientOutput(kind, None, finished=True, error=error)
        finally:
            if not ended or error == ABORTED:
                self.metrics.aborts.inc()
            elif error is not None:
                self.metrics.failed.inc()
            elif "audio" in modalities:
                self.metrics.finished(playback, k.now())


async def _speech_events(outputs: AsyncIterator[ClientOutput]) -> AsyncIterator[dict[str, Any]]:
    """``speech.audio.delta`` events (PCM, base64), then ``speech.audio.done`` with usage, or
    ``speech.audio.error``."""
    samples = 0
    error: str | None = None
    finish: TextFinish | None = None
    async with aclosing(outputs) as stream:
        async for out in stream:
            if out.finished:
                error, finish = out.error, out.text_finish
            elif out.kind is OutputType.AUDIO:
                samples += out.data.numel()
                audio = base64.b64encode(pcm16(out.data)).decode()
                yield {"type": "speech.audio.delta", "audio": audio, "response_format": "pcm"}
    if error is not None:
        yield {"type": "speech.audio.error", **_request_failed(error).body()}
    else:
        yield {"type": "speech.audio.done", "usage": _speech_usage(finish, samples)}


async def _raw_audio(fmt: str, outputs: AsyncIterator[ClientOutput]) -> AsyncIterator[bytes]:
    """The audio as it comes. A request that failed raises instead of ending the stream: the
    connection then drops without its last chunk, the one way a raw stream can tell its client
    that what it got is not all there is."""
    if fmt == "wav":
        yield wav_header(SAMPLE_RATE, None)
    async with aclosing(outputs) as stream:
        async for out in stream:
            if out.kind is OutputType.AUDIO and not out.finished:
                yield pcm16(out.data)
            elif out.finished and out.error is not None:
                raise StreamFailed(out.error)


class StreamFailed(Exception):
    """A streamed response's request failed after its headers were sent."""


class _Streamed(StreamingResponse):
    """Starlette's streaming response, whose last send is never cut short: under Hypercorn a
    client's ``Connection: close`` (or HTTP/1.0) makes the server report a disconnect during that
    send, and Starlette's cancellation then stopped Hypercorn half-way through closing — the
    connection stayed open after the last byte, and the client waited for good."""

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            data = chunk.encode(self.charset) if isinstance(chunk, str) else chunk
            await send({"type": "http.response.body", "body": data, "more_body": True})
        with anyio.CancelScope(shield=True):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class Answer(NamedTuple):
    """A whole (not streamed) answer: its text, audio and word timestamps; the error it failed
    with, or how its text ended."""

    text: str
    audio: Any
    stamps: list[WordTimestamp]
    error: str | None
    text_finish: TextFinish | None


async def _collect(outputs: AsyncIterator[ClientOutput]) -> Answer:
    text, audio, stamps, error, finish = "", torch.empty(0), [], None, None
    async with aclosing(outputs) as stream:
        async for out in stream:
            if out.finished:
                error, finish = out.error, out.text_finish
            elif out.kind is OutputType.TEXT:
                text = out.data
            elif out.kind is OutputType.AUDIO:
                audio = out.data
            elif out.kind is OutputType.TIMESTAMPS:
                stamps = out.data
    return Answer(text, audio, stamps, error, finish)


async def _spoken(speech: SpeechRequest, outputs: AsyncIterator[ClientOutput]) -> tuple[Answer, ApiError | None]:
    """The whole answer of a speech request, its audio and word timestamps at the speed it asked
    for; or the :class:`ApiError` that says how it failed (returned: raised inside a task group,
    it would arrive wrapped in an exception group)."""
    answer = await _collect(outputs)
    if answer.error is not None:
        return answer, _request_failed(answer.error)
    if speech.speed != 1.0:
        # Played faster or slower like tape: the same samples over a shorter or longer time.
        audio = serving.resample(answer.audio, round(speech.speed * 1000), 1000)
        stamps = [WordTimestamp(t.word, t.start_ms / speech.speed, t.end_ms / speech.speed) for t in answer.stamps]
        answer = answer._replace(audio=audio, stamps=stamps)
    return answer, None


async def _unless_gone(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """What ``work`` returns (never None), unless the client disconnects first: then None, and
    the work is cancelled at once (its requests are aborted: closing ``generate`` is the abort)."""
    done: list[T] = []
    async with anyio.create_task_group() as watch:

        async def until_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass  # (the body was read already: nothing else comes)
            watch.cancel_scope.cancel()

        watch.start_soon(until_gone)
        done.append(await work())
        watch.cancel_scope.cancel()
    return done[0] if done else None


def _sse(events: AsyncIterator[dict[str, Any]], *, named: bool = False) -> Response:
    """Server-sent events: ``data: {json}`` lines; ``named`` adds an ``event:`` line with each
    event's type (the speech events); chat chunks end with ``data: [DONE]``."""

    async def body() -> AsyncIterator[str]:
        async with aclosing(events) as stream:
            async for event in stream:
                head = f"event: {event['type']}\n" if named else ""
                yield f"{head}data: {json.dumps(event, separators=(',', ':'))}\n\n"
        if not named:
            yield "data: [DONE]\n\n"

    return _Streamed(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


#: What a speech session keeps of what its client sends while an utterance is spoken: the
#: messages, and the text they hold (a client that sends faster than it is answered cannot make
#: the server hold more). A client that sends more is told, and its session closed (1008).
MAX_QUEUED = 64
MAX_QUEUED_CHARS = 2 * serving.MAX_INPUT_CHARS
#: Stands in the inbox for the first message over those limits.
_OVERFLOWED: dict[str, Any] = {"type": None}


def _queued_chars(messages: Iterable[dict[str, Any]]) -> int:
    return sum(len(m["text"]) for m in messages if isinstance(m.get("text"), str))


async def _next_message(ws: WebSocket) -> dict[str, Any] | None:
    """The next JSON message; None when the client disconnected. A message that is not a JSON
    object is answered with an error event and skipped."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return None
        try:
            parsed = _strict_json(message["text"]) if message.get("text") is not None else None
        except (ValueError, RecursionError):  # (not JSON; or an integer too long, or nesting too deep)
            parsed = None
        if isinstance(parsed, dict):
            return parsed
        await ws.send_json({"type": "error", "message": "every client message must be a JSON object"})


def _strict_json(text: str | bytes) -> object:
    """``text`` parsed as JSON, refusing ``NaN`` and ``Infinity`` (Python's extensions, which
    no JSON client sends and no number check should meet) with a ValueError."""

    def refuse(constant: str) -> NoReturn:
        raise ValueError(f"{constant} is not a JSON number")

    return json.loads(text, parse_constant=refuse)


async def _json_body(request: Request) -> object:
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413)
    try:
        return _strict_json(body)
    except (ValueError, RecursionError) as e:
        raise ApiError(f"the request body is not valid JSON: {_why_not_json(e)}") from None


def _why_not_json(error: ValueError | RecursionError) -> str:
    """What was wrong with a body, in a client's terms (not Python's)."""
    if isinstance(error, json.JSONDecodeError):
        return str(error)  # (where it broke: "Expecting value: line 1 column 1 (char 0)")
    if isinstance(error, UnicodeDecodeError):
        return "it is not UTF-8"
    if isinstance(error, RecursionError):
        return "it is nested too deeply"
    if "integer string conversion" in str(error):
        return "a number in it has too many digits"
    return str(error)[:200]  # (NaN or Infinity, which JSON does not have)


def _chunk_span(chunk_id: int, start_byte: int, nbytes: int) -> dict[str, int]:
    """Where an ``audio.chunk`` of 16-bit samples lies in its utterance's audio (upstream's fields)."""
    ms_per_byte = 1000 / (2 * SAMPLE_RATE)
    return {
        "chunk_id": chunk_id,
        "chunk_start_ms": round(start_byte * ms_per_byte),
        "chunk_end_ms": round((start_byte + nbytes) * ms_per_byte),
        "sample_rate": SAMPLE_RATE,
    }


def _timestamps(stamps: Iterable[WordTimestamp]) -> list[dict[str, Any]]:
    """Word timestamps as upstream sends them: whole milliseconds."""
    return [{"word": t.word, "start_ms": round(t.start_ms), "end_ms": round(t.end_ms)} for t in stamps]


async def _encoded(audio: torch.Tensor, fmt: str) -> bytes:
    """``audio`` in ``fmt``; a compressed format off the event loop (seconds of Opus take a
    tenth of a second to write)."""
    if fmt in COMPRESSED:
        return await current_kernel().compute(lambda: encode(audio, fmt, SAMPLE_RATE))
    return encode(audio, fmt, SAMPLE_RATE)


def _request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:16]}"


def _wall_clock() -> float:
    import datetime

    return datetime.datetime.now(datetime.UTC).timestamp()


def _usage(finish: TextFinish | None) -> dict[str, int]:
    """The Thinker's token counts (none for a request that failed)."""
    prompt_tokens, completion_tokens = (finish.prompt_tokens, finish.completion_tokens) if finish else (0, 0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _metrics(began: float, audio: Any) -> dict[str, float]:
    """The non-OpenAI ``metrics`` of a chat completion or chunk (upstream's field): seconds since
    the request was accepted, and the seconds of audio it carries (``audio``: samples, if any)."""
    metrics = {"elapsed_s": round(current_kernel().now() - began, 6)}
    if audio is not None:
        metrics["audio_s"] = round(audio.numel() / SAMPLE_RATE, 6)
    return metrics


def _speech_usage(finish: TextFinish | None, output_tokens: int) -> dict[str, Any]:
    """The text's tokens in (the Thinker's prompt), the audio's samples out."""
    text_tokens = finish.prompt_tokens if finish else 0
    return {
        "input_tokens": text_tokens,
        "output_tokens": output_tokens,
        "total_tokens": text_tokens + output_tokens,
        "input_token_details": {"text_tokens": text_tokens, "audio_tokens": 0},
    }


def _usage_headers(answer: Answer) -> dict[str, str]:
    usage = _speech_usage(answer.text_finish, answer.audio.numel())
    return {
        "x-vllm-omni-input-tokens": str(usage["input_tokens"]),
        "x-vllm-omni-output-tokens": str(usage["output_tokens"]),
        "x-vllm-omni-total-tokens": str(usage["total_tokens"]),
        "x-vllm-omni-input-text-tokens": str(usage["input_tokens"]),
        "x-vllm-omni-input-audio-tokens": "0",
    }


async def _websocket_only(request: Request) -> Response:
    raise ApiError(f"{request.url.path} speaks WebSocket: connect with a WebSocket client", status=426)


def _request_failed(error: str) -> ApiError:
    """The error of a request that failed once started: 503 with ``Retry-After`` when the engine
    could not serve it (it stopped, or a stage died and restarts: the client may retry elsewhere
    or later), 500 for a failure of the request itself."""
    if isinstance(error, Unavailable):
        return ApiError(f"the request failed: {error}", status=503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return ApiError(f"the request failed: {error}", status=500)


async def _api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    body = ApiError(str(e.detail), status=e.status_code).body()
    return JSONResponse(body, status_code=e.status_code, headers=e.headers)


async def _server_error(request: Request, e: Exception) -> Response:
    return JSONResponse(ApiError(f"internal error: {type(e).__name__}", status=500).body(), status_code=500)
