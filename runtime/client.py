"""The async Python client API: ``generate(engine, text, …)`` yields text deltas, audio chunks
and word timestamps, ending with exactly one terminal output.

It applies the serving rules of spec §7 (#7544): DELTA outputs by default; a streaming request
with word timestamps runs its stages CUMULATIVE (on cloned parameters) and the client gets each
sample once through the ``emitted_samples`` trim. Only outputs of the request's final-output
stages reach the client; an output of any other stage is dropped — which is why an abort terminal
must be built for the final stage (#7006).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from runtime import serving
from runtime.config.topology import OutputType
from runtime.models.code2wav import SAMPLE_RATE
from runtime.orchestrator import EngineOutput, EngineStopped, Orchestrator, StagesDown, Unavailable
from runtime.serving import EmittedSamplesTrim, OutputKind
from runtime.stages import TextFinish

_request_ids = itertools.count()


@dataclass(frozen=True)
class ClientOutput:
    """One item of a ``generate`` stream. ``data`` is a ``str`` (text), a 1-D float tensor at
    24 kHz (audio) or a list of :class:`~runtime.models.aligner.WordTimestamp`. The last item has
    ``finished`` set; ``error`` says why a request ended early ("aborted" after :func:`abort`;
    an :class:`~runtime.orchestrator.Unavailable` when the engine stopped or a stage died under
    it, which a retry may get past)."""

    kind: OutputType
    data: Any
    finished: bool = False
    error: str | None = None
    #: On the last item of a request answered in full: how its text ended (``"length"``: cut
    #: short by ``max_tokens``; ``"stop"``: by itself or before a stop string) and its token counts.
    text_finish: TextFinish | None = None


def parse_modalities(modalities: Iterable[str]) -> frozenset[OutputType]:
    wanted = set(modalities)
    if not wanted or not wanted <= {"text", "audio"}:
        raise ValueError(f"modalities must be text and/or audio, got {sorted(wanted)}")
    return frozenset(OutputType(m) for m in wanted)


async def generate(
    engine: Orchestrator,
    text: str,
    modalities: Iterable[str] = ("text", "audio"),
    *,
    stream: bool = True,
    word_timestamps: bool = False,
    request_id: str | None = None,
    sample_rate: int = SAMPLE_RATE,
    max_tokens: int | None = None,
    stop: list[str] | None = None,
) -> AsyncIterator[ClientOutput]:
    """Run ``text`` through ``engine``. With ``stream`` every delta is yielded as it comes;
    without, one item per output type at the end. Word timestamps need audio; audio is
    delivered at ``sample_rate`` (resampled from the model's 24 kHz). ``max_tokens`` caps the
    answer's tokens and the answer ends before the first of the ``stop`` strings in it, as
    vLLM's do."""
    if sample_rate <= 0:
        raise ValueError(f"sample_rate must be positive, got {sample_rate}")
    outputs = parse_modalities(modalities)
    if word_timestamps and OutputType.AUDIO not in outputs:
        raise ValueError("word_timestamps needs the audio modality")
    # The engine always streams; ``stream=False`` only changes what this client is handed.
    params = serving.request_params(engine.default_sampling_params, stream=True, word_timestamps=word_timestamps)
    rid = request_id if request_id is not None else f"req-{next(_request_ids)}"
    try:
        results = await engine.submit(
            rid,
            text,
            outputs=outputs,
            output_kind=params[-1].output_kind,
            word_timestamps=word_timestamps,
            max_tokens=max_tokens,
            stop=stop,
        )
    except (EngineStopped, StagesDown) as e:
        # (a stage that stayed down says which, and why; the engine may well be running)
        error = Unavailable(str(e)) if isinstance(e, StagesDown) else engine.shutdown_error
        kind = OutputType.AUDIO if OutputType.AUDIO in outputs else OutputType.TEXT
        yield ClientOutput(kind, None, finished=True, error=error)
        return
    final_stages = {s.stage_id for s in engine.config.stages if s.final_output in outputs}
    trim = EmittedSamplesTrim() if params[-1].output_kind is OutputKind.CUMULATIVE else None
    pending: list[ClientOutput] = []
    ended = False
    try:
        while not ended:
            item = await results.get()
            # The outer "finished" ends the loop, whether or not its output was accepted.
            ended = item.request_finished
            for out in _client_outputs(item, final_stages, trim, sample_rate):
                if stream:
                    yield out
                elif out.finished:
                    for merged in _merged(pending):
                        yield merged
                    yield out
                else:
                    pending.append(out)
    finally:
        if not ended:
            await engine.abort(rid)  # the client went away before the end: a disconnect is an abort


def _merged(outputs: list[ClientOutput]) -> list[ClientOutput]:
    """A non-streaming answer: one output per kind (text joined, audio concatenated)."""
    by_kind: dict[OutputType, list[Any]] = {}
    for out in outputs:
        by_kind.setdefault(out.kind, []).append(out.data)
    merged = []
    for kind, parts in by_kind.items():
        if kind is OutputType.TEXT:
            merged.append(ClientOutput(kind, "".join(parts)))
        elif kind is OutputType.AUDIO:
            merged.append(ClientOutput(kind, torch.cat([p.reshape(-1) for p in parts])))
        else:
            merged.append(ClientOutput(kind, parts[-1]))
    return merged


def _client_outputs(
    item: EngineOutput, final_stages: set[int], trim: EmittedSamplesTrim | None, sample_rate: int
) -> list[ClientOutput]:
    """What the client gets of one engine output (``_process_single_result``)."""
    if item.stage_id not in final_stages:
        return []  # not a final-output stage of this request: dropped
    data = item.data
    if item.output_type is OutputType.AUDIO and isinstance(data, torch.Tensor):
        data = serving.client_audio(data, trim, from_rate=SAMPLE_RATE, to_rate=sample_rate)
    out = []
    if data is not None and not (isinstance(data, str) and not data):
        out.append(ClientOutput(item.output_type, data))
    if item.request_finished:
        out.append(ClientOutput(item.output_type, None, finished=True, error=item.error, text_finish=item.text_finish))
    return out
