"""Mutants of the codec edge: the processor's flush and its wire layout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from omnisim.registry import Patch, mutant
from runtime import serving
from runtime.models import code2wav
from runtime.processors import talker2code2wav
from runtime.request import Request
from runtime.serving import EmittedSamplesTrim, OutputKind, SamplingParams
from runtime.transfer import receiver, rules


@mutant(
    "flush_on_segment_only",
    summary="the processor's flush flag is only is_segment_finished: a terminal drops the buffered remainder",
    issue="#5413",
    scenarios=("codec_chunk_boundaries", "pipeline_requests"),
    expect=("samples-exactly-once",),
)
def flush_on_segment_only() -> Iterator[Patch]:
    def flush_on_segment_end(*, is_segment_finished: bool, is_finished: bool) -> bool:
        return is_segment_finished

    yield Patch(rules, "processor_flushes", flush_on_segment_end)


_window = talker2code2wav.Talker2Code2WavAsyncChunk.window


@mutant(
    "left_context_one_frame_short",
    summary="a chunk past the first two carries one frame less of left context than spec §4.1 gives: the audio "
    "differs only where the decoder reaches that far back (the toy Code2Wav does not)",
    issue="spec §4.1 step 6 (a bug the harness was not told about: the left context was checked only by the audio)",
    scenarios=("code2wav_stream",),
    expect=("merged-as-spec",),
)
def left_context_one_frame_short() -> Iterator[Patch]:
    def window(
        self: talker2code2wav.Talker2Code2WavAsyncChunk, length: int, chunk_id: int, is_finished: bool, appended: bool
    ) -> tuple[int, int] | None:
        spec = _window(self, length, chunk_id, is_finished, appended)
        if spec is None or chunk_id < 2 or spec[0] == 0:
            return spec
        left, end = spec
        return left - 1, end - 1

    yield Patch(talker2code2wav.Talker2Code2WavAsyncChunk, "window", window)


@mutant(
    "no_codebook_major_transpose",
    summary="frames go on the wire frame-major: the length is valid, the codes are scrambled",
    issue="codebook-major layout (spec §4.1 step 7)",
    scenarios=("codec_chunk_boundaries", "pipeline_requests"),
    expect=("samples-exactly-once",),
)
def no_codebook_major_transpose() -> Iterator[Patch]:
    def codebook_major(frames: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(frames, dim=0).reshape(-1)

    yield Patch(talker2code2wav, "codebook_major", codebook_major)


@mutant(
    "stream_slice_ignores_tail",
    summary="the streaming Code2Wav slice is [left·1920 : n·1920]: every chunk boundary loses the 555-sample tail",
    issue="#4706",
    scenarios=("code2wav_stream", "pipeline_requests"),
    expect=("samples-exactly-once",),
)
def stream_slice_ignores_tail() -> Iterator[Patch]:
    def stream_slice(left_frames: int, n_frames: int, tail: int) -> tuple[int, int]:
        return left_frames * code2wav.TOTAL_UPSAMPLE, n_frames * code2wav.TOTAL_UPSAMPLE

    yield Patch(code2wav, "stream_slice", stream_slice)


@mutant(
    "no_cumulative_for_timestamps",
    summary="streaming word-timestamp requests stay DELTA: the aligner gets only the last delta",
    issue="#7544",
    scenarios=("streaming_word_timestamps", "pipeline_word_timestamps"),
    expect=("samples-exactly-once", "aligner-complete"),
)
def no_cumulative_for_timestamps() -> Iterator[Patch]:
    def request_params(defaults: list[SamplingParams], *, stream: bool, word_timestamps: bool) -> list[SamplingParams]:
        return defaults

    yield Patch(serving, "request_params", request_params)


@mutant(
    "cumulative_without_clone",
    summary="CUMULATIVE is set on the shared default parameters: later plain requests turn CUMULATIVE, untrimmed",
    issue="#7544",
    scenarios=("streaming_word_timestamps", "pipeline_word_timestamps"),
    expect=("samples-exactly-once",),
)
def cumulative_without_clone() -> Iterator[Patch]:
    def request_params(defaults: list[SamplingParams], *, stream: bool, word_timestamps: bool) -> list[SamplingParams]:
        if stream and word_timestamps:
            for p in defaults:
                p.output_kind = OutputKind.CUMULATIVE
        return defaults

    yield Patch(serving, "request_params", request_params)


@mutant(
    "no_emitted_samples_trim",
    summary="the client gets every cumulative update whole: samples arrive again and again (800 + 2000 + 2400)",
    issue="#7544",
    scenarios=("streaming_word_timestamps", "pipeline_word_timestamps"),
    expect=("samples-exactly-once",),
)
def no_emitted_samples_trim() -> Iterator[Patch]:
    yield Patch(EmittedSamplesTrim, "__call__", lambda self, cumulative: cumulative)


@mutant(
    "generation_merge_replaces_input",
    summary="a Code2Wav receiver takes each chunk for the request's whole input, as AR mode assigns it, instead of "
    "merging it into what earlier chunks left (spec §3.8 generation mode)",
    issue="spec §3.8 (the commit's merge)",
    scenarios=("codec_chunk_boundaries",),
    expect=("merged-as-spec",),
)
def generation_merge_replaces_input() -> Iterator[Patch]:
    merge = receiver.merge_generation_chunk

    def merge_into_nothing(request: Request, payload: dict[str, Any], meta: dict[str, Any], *flags: bool) -> bool:
        request.additional_information = None
        return merge(request, payload, meta, *flags)

    yield Patch(receiver, "merge_generation_chunk", merge_into_nothing)
