"""What a client may send, checked field by field before anything runs: the bodies of
``/v1/chat/completions``, ``/v1/audio/speech`` and the WebSocket ``session.config``, with
upstream vLLM-Omni's field names. A bad body is an :class:`ApiError` carrying OpenAI's error
shape and a 4xx status, never a 500 and never a half-started request."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.serving import RequestRejected, check_input_text, json_type
from runtime.serving.audio import COMPRESSED

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request the server refuses: ``status`` and OpenAI's ``{"error": {…}}`` body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_object(v: Any) -> bool:
    return isinstance(v, dict)


def _is_stop(v: Any) -> bool:
    """vLLM's ``stop``: a string, or a list of strings."""
    return _is_str(v) or (isinstance(v, list) and all(map(_is_str, v)))


def _number_in(low: float, high: float = math.inf, *, above: bool = False) -> Callable[[Any], bool]:
    """A number from ``low`` (or above it) up to ``high`` (a NaN is in no range)."""
    return lambda v: _is_number(v) and (low < v if above else low <= v) and v <= high


def _int_from(low: int) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and v >= low


#: Sampling and bookkeeping fields OpenAI's and vLLM's clients send that this pipeline has no use
#: for: accepted (a client setting ``temperature`` must not fail) with their types and ranges
#: checked, as vLLM checks them (an out-of-range value is a client's mistake: a 400 says so),
#: and without effect.
_CHAT_IGNORED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (_number_in(0), "a number >= 0"),
    "top_p": (_number_in(0, 1, above=True), "a number in (0, 1]"),
    "top_k": (lambda v: _is_int(v) and (v >= 1 or v in (0, -1)), "an integer >= 1 (0 or -1: off)"),
    "min_p": (_number_in(0, 1), "a number in [0, 1]"),
    "min_tokens": (_int_from(0), "an integer >= 0"),
    "seed": (_is_int, "an integer"),
    "user": (_is_str, "a string"),
    "presence_penalty": (_number_in(-2, 2), "a number in [-2, 2]"),
    "frequency_penalty": (_number_in(-2, 2), "a number in [-2, 2]"),
    "repetition_penalty": (_number_in(0, above=True), "a number > 0"),
    "ignore_eos": (_is_bool, "a boolean"),
    "logit_bias": (_is_object, "an object"),
    "logprobs": (_is_bool, "a boolean"),
    "top_logprobs": (lambda v: _is_int(v) and 0 <= v <= 20, "an integer in [0, 20]"),
    "metadata": (_is_object, "an object"),
    "store": (_is_bool, "a boolean"),
    "service_tier": (_is_str, "a string"),
    "parallel_tool_calls": (_is_bool, "a boolean"),
    "reasoning_effort": (_is_str, "a string"),
}
#: ``pcm`` is upstream's other name for ``pcm16``.
CHAT_AUDIO_FORMATS = ("wav", "pcm16", "pcm", *COMPRESSED)
SPEECH_FORMATS = ("wav", "pcm", *COMPRESSED)
#: What a stream of samples can be: a compressed file is written whole.
STREAMED_FORMATS = ("wav", "pcm")
#: Formats OpenAI's clients may ask for that this libsndfile cannot write: a clear 400, not a surprise.
_UNENCODED = tuple(name for name in ("mp3", "flac", "opus", "aac") if name not in COMPRESSED)


@dataclass(frozen=True)
class ChatRequest:
    text: str
    modalities: tuple[str, ...]
    audio_format: str
    stream: bool
    include_usage: bool
    model: str | None
    #: The most tokens the answer may have (None: as many as it takes).
    max_tokens: int | None
    #: The strings the answer ends before (vLLM's ``stop``; a single one is made a list of one
    #: here, so the engine takes one type); None: none.
    stop: list[str] | None


@dataclass(frozen=True)
class SpeechRequest:
    text: str
    voice: str
    response_format: str
    speed: float
    stream: bool
    #: "sse" (``speech.audio.*`` events) or "audio" (raw bytes as they are decoded).
    stream_format: str | None
    word_timestamps: bool
    model: str | None
    extensions: Mapping[str, Any] = field(default_factory=dict)


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, not {json_type(body)}")
    return body


def _field(
    body: Mapping[str, Any], name: str, check: Callable[[Any], bool], want: str, default: Any, *, within: str = ""
) -> Any:
    """An optional field: ``default`` when it is absent or null (OpenAI's schemas make every
    optional field nullable, and its clients send null for "not set"). ``within``: the object
    ``body`` is a field of, which an error's ``param`` names first (``audio.format``)."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        path = f"{within}.{name}" if within else name
        raise ApiError(f"'{path}' must be {want}, got {json_type(value)}", param=path)
    return value


def _check_types(body: Mapping[str, Any], fields: Mapping[str, tuple[Callable[[Any], bool], str]]) -> None:
    """Each of ``fields`` (name -> check, what it must be) is absent, null, or passes its check."""
    for name, (check, want) in fields.items():
        _field(body, name, check, want, None)


def _ignore_unknown(body: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    """Fields this server does not know are ignored, as upstream's request models ignore them
    (its clients send model-specific ones: ``ref_audio``, ``mm_processor_kwargs``, …); the log
    names them, as vLLM's does."""
    unknown = sorted(set(body) - known)
    if unknown:
        log.warning("%s: ignored the fields it does not know: %s", where, ", ".join(map(repr, unknown)))


def _text(text: object, param: str) -> str:
    try:
        return check_input_text(text)
    except RequestRejected as e:
        raise ApiError(str(e), param=param) from None


def _message_text(message: object, i: int) -> str | None:
    """The text of a user message (a string, or the ``text`` parts of a content list)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
    if message["role"] != "user":
        return None
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ApiError(f"messages[{i}].content parts must be objects with a 'type'", param=f"messages[{i}]")
            if part["type"] != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{i}]: only text content is understood here", param=f"messages[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"messages[{i}].content must be a string or a list of parts", param=f"messages[{i}]")


_CHAT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "modalities",
        "audio",
        "stream",
        "stream_options",
        "n",
        "response_format",
        "tools",
        "tool_choice",
        "max_tokens",
        "max_completion_tokens",
        "stop",
    }
)


def _refuse_what_is_not_built(body: Mapping[str, Any]) -> None:
    """OpenAI fields a client may send with their "nothing asked" values (plain text, no tools),
    and that this pipeline cannot honour otherwise: a clear 400, never a silent ignore."""
    response_format = _field(body, "response_format", lambda v: isinstance(v, dict), "an object", {"type": "text"})
    if response_format.get("type") != "text":
        raise ApiError("only response_format {'type': 'text'} is served: the answer is text", param="response_format")
    if _field(body, "tools", lambda v: isinstance(v, list), "an array", []):
        raise ApiError("tools are not served: this pipeline calls no tools", param="tools")
    choice = _field(body, "tool_choice", lambda v: isinstance(v, dict | str), "a string or an object", "none")
    if choice != "none":
        raise ApiError("tool_choice must be 'none': this pipeline calls no tools", param="tool_choice")


def parse_chat(raw: object) -> ChatRequest:
    body = _object(raw)
    _ignore_unknown(body, _CHAT_FIELDS | set(_CHAT_IGNORED), "a chat completion")
    _check_types(body, _CHAT_IGNORED)
    if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    _refuse_what_is_not_built(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty array", param="messages")
    said = [t for i, m in enumerate(messages) if (t := _message_text(m, i)) is not None]
    if not said:
        raise ApiError("'messages' has no user message to answer", param="messages")
    modalities = _field(body, "modalities", lambda v: isinstance(v, list), "an array", ["text", "audio"])
    if not modalities or not all(m in ("text", "audio") for m in modalities) or len(set(modalities)) != len(modalities):
        raise ApiError(f"'modalities' must be some of ['text', 'audio'], got {modalities!r}", param="modalities")
    audio = _field(body, "audio", _is_object, "an object", {})
    _ignore_unknown(audio, frozenset({"format", "voice"}), "a chat completion's audio")
    audio_format = _field(audio, "format", _is_str, "a string", "wav", within="audio")
    if audio_format not in CHAT_AUDIO_FORMATS:
        raise ApiError(f"audio.format must be one of {', '.join(CHAT_AUDIO_FORMATS)}", param="audio.format")
    if _field(body, "n", lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", 1) != 1:
        raise ApiError("'n' must be 1: one answer per request", param="n")
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    # (OpenAI's and upstream's default: a stream has no usage-only chunk unless asked)
    include_usage = _field(options, "include_usage", _is_bool, "a boolean", False, within="stream_options")
    stream = _field(body, "stream", _is_bool, "a boolean", False)
    if options and not stream:  # (as OpenAI and vLLM refuse it)
        raise ApiError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    # (as many as a client sends, as vLLM takes them: OpenAI's limit of 4 is not kept)
    stop = _field(body, "stop", _is_stop, "a string or strings", None)
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and "" in stop:  # (it would be found everywhere: vLLM refuses it too)
        raise ApiError("'stop' cannot contain an empty string", param="stop")
    # (OpenAI's newer name wins, as in vLLM)
    max_tokens = _field(body, "max_tokens", _int_from(1), "an integer >= 1", None)
    return ChatRequest(
        text=_text(said[-1], "messages"),
        modalities=tuple(modalities),
        audio_format=audio_format,
        stream=stream,
        include_usage=include_usage,
        model=_field(body, "model", _is_str, "a string", None),
        max_tokens=_field(body, "max_completion_tokens", _int_from(1), "an integer >= 1", max_tokens),
        stop=stop,
    )


def _is_count(value: Any) -> bool:
    """A positive integer (``true`` is an ``int`` to Python, never a count to a client)."""
    return _is_int(value) and value > 0


#: Upstream's extensions of the speech request: accepted with their types checked; the toy
#: pipeline has one voice, one language and its own chunking, so they change nothing here.
_SPEECH_EXTENSIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "task_type": (lambda v: v in ("CustomVoice", "VoiceDesign", "Base"), "'CustomVoice', 'VoiceDesign' or 'Base'"),
    "language": (_is_str, "a string"),
    "instructions": (_is_str, "a string"),
    "initial_codec_chunk_frames": (lambda v: _is_int(v) and v >= 0, "an integer of at least 0 (0: the default)"),
    "max_new_tokens": (_is_count, "a positive integer"),
    "sample_rate": (lambda v: v == 24000, "24000 (the model's rate)"),
}


def _voice(body: Mapping[str, Any]) -> str:
    """``voice`` (a name, or upstream's ``{"id": name}``), or upstream's older ``speaker``."""
    voice = body.get("voice")
    if isinstance(voice, dict):
        return _field(voice, "id", _is_str, "a string", "default")
    if voice is None:
        return _field(body, "speaker", _is_str, "a string", "default")
    return _field(body, "voice", _is_str, "a string or an object with an 'id'", "default")


def parse_speech(raw: object) -> SpeechRequest:
    body = _object(raw)
    known = {"model", "input", "voice", "speaker", "response_format", "speed", "stream", "stream_format"}
    known |= {"word_timestamps", *_SPEECH_EXTENSIONS}
    _ignore_unknown(body, frozenset(known), "a speech request")
    if "input" not in body:
        raise ApiError("'input' is required: the text to speak", param="input")
    text = _text(body["input"], "input")
    response_format = _field(body, "response_format", _is_str, "a string", "wav")
    if response_format in _UNENCODED:
        raise ApiError(
            f"response_format {response_format!r} is not encoded here; use one of {', '.join(SPEECH_FORMATS)}",
            param="response_format",
        )
    if response_format not in SPEECH_FORMATS:
        raise ApiError(f"response_format must be one of {', '.join(SPEECH_FORMATS)}", param="response_format")
    speed = float(_field(body, "speed", _is_number, "a number", 1.0))
    if not 0.25 <= speed <= 4.0:
        raise ApiError("'speed' must be between 0.25 and 4.0", param="speed")
    stream = _field(body, "stream", _is_bool, "a boolean", False)
    stream_format = _field(body, "stream_format", lambda v: v in ("sse", "audio"), "'sse' or 'audio'", None)
    if body.get("stream") is False and stream_format is not None:
        raise ApiError(f"'stream_format' {stream_format!r} asks for a stream, and 'stream' is false", param="stream")
    streaming = stream or stream_format is not None
    if streaming and speed != 1.0:
        raise ApiError("a streamed response plays at speed 1.0 only", param="speed")
    if stream_format == "audio" and response_format not in STREAMED_FORMATS:
        raise ApiError(
            f"streamed audio is {' or '.join(STREAMED_FORMATS)}; {response_format} is written whole",
            param="response_format",
        )
    _check_types(body, _SPEECH_EXTENSIONS)
    return SpeechRequest(
        text=text,
        voice=_voice(body),
        response_format=response_format,
        speed=speed,
        stream=streaming,
        stream_format=(stream_format or "sse") if streaming else None,
        word_timestamps=_field(body, "word_timestamps", _is_bool, "a boolean", False),
        model=_field(body, "model", _is_str, "a string", None),
        extensions={k: body[k] for k in _SPEECH_EXTENSIONS if k in body},
    )


#: The most items one ``/v1/audio/speech/batch`` request may hold (upstream's default limit).
MAX_BATCH_ITEMS = 32
#: What an item of a batch can never ask for: each is spoken whole, without headers to carry
#: timestamps. Asked for anyway, the batch is refused (a silent ignore would surprise a client).
_NOT_IN_BATCH = ("stream", "stream_format", "word_timestamps")


def _refuse_in_batch(fields: Mapping[str, Any], where: str) -> None:
    for name in _NOT_IN_BATCH:
        if fields.get(name) not in (None, False):
            param = f"{where}.{name}" if where else name
            raise ApiError(f"'{param}': a batch answers each item whole, without streams or timestamps", param=param)


@dataclass(frozen=True)
class BatchItem:
    """One item of a batch: its request (None if it fails alone), or why it fails."""

    speech: SpeechRequest | None
    error: str | None = None


@dataclass(frozen=True)
class SpeechBatch:
    items: tuple[BatchItem, ...]
    model: str | None


def parse_speech_batch(raw: object) -> SpeechBatch:
    """``items`` (1 to :data:`MAX_BATCH_ITEMS` objects, each with an ``input``) and the fields
    every item takes unless it sets its own, as upstream's batch merges them. A field that no
    speech request may hold refuses the whole batch; an input the speech endpoint would refuse
    (empty, too long) fails its item alone, with the endpoint's message."""
    body = _object(raw)
    items = body.get("items")
    if not isinstance(items, list) or not items:
        raise ApiError("'items' must be a non-empty array of speech requests", param="items")
    if len(items) > MAX_BATCH_ITEMS:
        raise ApiError(f"the batch holds {len(items)} items; at most {MAX_BATCH_ITEMS} are allowed", param="items")
    shared = {k: v for k, v in body.items() if k != "items" and v is not None}
    _refuse_in_batch(shared, "")
    parsed = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "input" not in item:
            raise ApiError(f"items[{i}] must be an object with an 'input'", param=f"items[{i}]")
        _refuse_in_batch(item, f"items[{i}]")
        merged = shared | {k: v for k, v in item.items() if v is not None}
        for name in _NOT_IN_BATCH:
            merged.pop(name, None)
        try:
            parsed.append(BatchItem(parse_speech(merged)))
        except ApiError as e:
            if e.param != "input":
                param = f"items[{i}]" + (f".{e.param}" if e.param else "")
                raise ApiError(f"{param}: {e}", param=param) from None
            parsed.append(BatchItem(None, str(e)))
    return SpeechBatch(tuple(parsed), _field(body, "model", _is_str, "a string", None))


@dataclass(frozen=True)
class SessionConfig:
    """A WebSocket session's settings; sticky across utterances until the next ``session.config``."""

    voice: str = "default"
    #: ``pcm``: raw 16-bit samples; ``wav``: each utterance's one binary frame is a WAV file.
    response_format: str = "pcm"
    #: Each decoded chunk as its own binary frame; off (upstream's default): one frame per utterance.
    stream_audio: bool = False
    word_timestamps: bool = False


def parse_session_config(raw: Mapping[str, Any]) -> SessionConfig:
    known = {"type", "model", "voice", "speaker", "response_format", "stream_audio", "word_timestamps", "speed"}
    _ignore_unknown(raw, frozenset(known | set(_SPEECH_EXTENSIONS)), "a session.config")
    response_format = _field(raw, "response_format", _is_str, "a string", "pcm")
    stream_audio = _field(raw, "stream_audio", _is_bool, "a boolean", False)
    word_timestamps = _field(raw, "word_timestamps", _is_bool, "a boolean", False)
    if response_format not in STREAMED_FORMATS:
        raise ApiError(f"response_format must be one of {', '.join(STREAMED_FORMATS)}", param="response_format")
    if response_format == "wav" and (stream_audio or word_timestamps):
        raise ApiError(
            "streamed audio (stream_audio, word_timestamps) is raw PCM: response_format must be 'pcm'",
            param="response_format",
        )
    if _field(raw, "speed", _is_number, "a number", 1.0) != 1.0:
        raise ApiError("a streamed session plays at speed 1.0 only", param="speed")
    _check_types(raw, _SPEECH_EXTENSIONS)
    return SessionConfig(
        voice=_voice(raw),
        response_format=response_format,
        stream_audio=stream_audio,
        word_timestamps=word_timestamps,
    )
