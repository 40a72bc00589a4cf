"""The serving side of a speech request (spec §7, #7544): output kinds, the CUMULATIVE clone for
streaming word timestamps, the ``emitted_samples`` trim, and the HTTP rejection.

A streaming request normally gets DELTA outputs: each Code2Wav update carries only its new
samples. A streaming request that also wants word timestamps needs the aligner to see the
*whole* waveform at the terminal, so its stage outputs are CUMULATIVE; the client must then get
only what it has not had yet, which the ``emitted_samples`` trim ensures. The CUMULATIVE setting
is made on clones of the default sampling parameters, never on the shared defaults.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

HTTP_STREAMING_TIMESTAMPS_GUIDANCE = (
    "word_timestamps with stream=true is not supported on /v1/audio/speech; use the WebSocket "
    "/v1/audio/speech/stream with session.config stream_audio=true and response_format='pcm'"
)


class OutputKind(enum.Enum):
    DELTA = "delta"
    CUMULATIVE = "cumulative"


@dataclasses.dataclass
class SamplingParams:
    """The per-stage parameters a request runs with (only what the audio path reads)."""

    output_kind: OutputKind = OutputKind.DELTA


#: The longest input text a request may carry (a 20,000-character text is ~3 min of audio).
MAX_INPUT_CHARS = 20_000


class RequestRejected(ValueError):
    """A request the serving layer refuses, with guidance for the client."""


def json_type(value: object) -> str:
    """What a client sent, named as JSON names it (``null``, not ``NoneType``); a number by its
    value where that is short (``-5``: it was out of range)."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    if type(value) in kinds:
        return kinds[type(value)]
    if isinstance(value, float) or (isinstance(value, int) and abs(value) < 10**15):
        return repr(value)
    return "a number"


def check_input_text(text: object) -> str:
    """A request's text must be a string with something to say, at most :data:`MAX_INPUT_CHARS`,
    and Unicode that UTF-8 can carry (JSON's ``"\\ud800"`` decodes to a lone surrogate, which
    no stage could tokenize or send)."""
    if not isinstance(text, str):
        raise RequestRejected(f"the input text must be a string, not {json_type(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestRejected(
            f"the input text is not valid Unicode: a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}"
        ) from None
    if not text.strip():
        raise RequestRejected("the input text is empty: there is nothing to say")
    if len(text) > MAX_INPUT_CHARS:
        raise RequestRejected(f"the input text has {len(text)} characters; the limit is {MAX_INPUT_CHARS}")
    return text


def check_http_speech_request(*, stream: bool, word_timestamps: bool, has_aligner: bool) -> None:
    """The HTTP speech endpoint's rules: timestamps need an aligner, and are not streamed there."""
    if word_timestamps and not has_aligner:
        raise RequestRejected("word_timestamps needs a server started with --forced-aligner")
    if stream and word_timestamps:
        raise RequestRejected(HTTP_STREAMING_TIMESTAMPS_GUIDANCE)


def request_params(defaults: list[SamplingParams], *, stream: bool, word_timestamps: bool) -> list[SamplingParams]:
    """The parameters of one request: DELTA while streaming, CUMULATIVE (on clones) for a
    streaming request with word timestamps."""
    if not stream:
        return defaults
    kind = OutputKind.CUMULATIVE if word_timestamps else OutputKind.DELTA
    return [dataclasses.replace(p, output_kind=kind) for p in defaults]


class StageAudio:
    """The final stage's audio output of one request, as its output kind presents it."""

    def __init__(self, kind: OutputKind) -> None:
        self.kind = kind
        self._chunks: list[torch.Tensor] = []

    def update(self, delta: torch.Tensor) -> torch.Tensor:
        """Add a decoded chunk; the output the stage reports for this update."""
        self._chunks.append(delta.reshape(-1))
        return self.total() if self.kind is OutputKind.CUMULATIVE else self._chunks[-1]

    def finish(self) -> torch.Tensor | None:
        """The stage's last output when its last update brought no samples: a CUMULATIVE output
        still carries everything so far, a DELTA output has nothing to carry."""
        return self.total() if self.kind is OutputKind.CUMULATIVE else None

    def total(self) -> torch.Tensor:
        """Every sample so far (what the aligner gets at the end)."""
        return torch.cat(self._chunks) if self._chunks else torch.empty(0)


class EmittedSamplesTrim:
    """Hand the client each sample once from a growing (cumulative) waveform. Trimmed before any
    resampling; an update with nothing new yields None (no WAV header, no first-audio mark)."""

    def __init__(self) -> None:
        self.emitted_samples = 0

    def __call__(self, cumulative: torch.Tensor) -> torch.Tensor | None:
        total = cumulative.shape[-1]
        new = cumulative[..., self.emitted_samples :]
        self.emitted_samples = total
        return new if new.numel() else None


def resample(audio: torch.Tensor, from_rate: int, to_rate: int) -> torch.Tensor:
    """Linear resampling of a 1-D chunk to ``round(len · to_rate / from_rate)`` samples."""
    if from_rate == to_rate or audio.numel() == 0:
        return audio
    size = max(1, round(audio.numel() * to_rate / from_rate))
    return torch.nn.functional.interpolate(
        audio.reshape(1, 1, -1), size=size, mode="linear", align_corners=False
    ).reshape(-1)


def client_audio(
    chunk: torch.Tensor, trim: EmittedSamplesTrim | None, *, from_rate: int, to_rate: int
) -> torch.Tensor | None:
    """What the client gets of one audio output: the new samples only (trimmed in the model's
    own samples, *before* resampling — the count is in those units), then resampled; None when
    nothing is new."""
    new = trim(chunk) if trim is not None else chunk
    if new is None:
        return None
    return resample(new, from_rate, to_rate)
