"""Mutants of the codec edge: the processor's flush and its wire layout."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from omnisim.registry import Patch, mutant
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
