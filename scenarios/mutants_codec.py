"""Mutants of the codec edge: the processor's flush and its wire layout."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from omnisim.registry import Patch, mutant
from runtime.models import code2wav
from runtime.processors import talker2code2wav
from runtime.transfer.adapter import ChunkTransferAdapter as Adapter


@mutant(
    "flush_on_segment_only",
    summary="the processor's flush flag is only is_segment_finished: a terminal drops the buffered remainder",
    issue="#5413",
    scenarios=("codec_chunk_boundaries",),
)
def flush_on_segment_only() -> Iterator[Patch]:
    yield Patch(Adapter, "_flush_signal", staticmethod(lambda task: task.is_segment_finished))


@mutant(
    "no_codebook_major_transpose",
    summary="frames go on the wire frame-major: the length is valid, the codes are scrambled",
    issue="codebook-major layout (spec §4.1 step 7)",
    scenarios=("codec_chunk_boundaries",),
)
def no_codebook_major_transpose() -> Iterator[Patch]:
    def codebook_major(frames: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(frames, dim=0).reshape(-1)

    yield Patch(talker2code2wav, "codebook_major", codebook_major)


@mutant(
    "stream_slice_ignores_tail",
    summary="the streaming Code2Wav slice is [left·1920 : n·1920]: every chunk boundary loses the 555-sample tail",
    issue="#4706",
    scenarios=("code2wav_stream",),
)
def stream_slice_ignores_tail() -> Iterator[Patch]:
    def stream_slice(left_frames: int, n_frames: int, tail: int) -> tuple[int, int]:
        return left_frames * code2wav.TOTAL_UPSAMPLE, n_frames * code2wav.TOTAL_UPSAMPLE

    yield Patch(code2wav, "stream_slice", stream_slice)
