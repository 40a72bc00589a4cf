"""``code2wav2aligner``: the forced aligner's input, built once from Code2Wav's *finished*
output (spec §4.4). The aligner is a full-handoff consumer: it never sees a chunk, only the
complete waveform with the ground-truth text."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from runtime.models.aligner import DEFAULT_SAMPLE_RATE, segment_words

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AlignerInput:
    wav: torch.Tensor
    sample_rate: int
    words: list[str]

    @property
    def audio_duration_ms(self) -> float:
        return self.wav.numel() / self.sample_rate * 1000.0


def code2wav2aligner(
    audio: torch.Tensor | None, text: str, *, sample_rate: int = DEFAULT_SAMPLE_RATE
) -> AlignerInput | None:
    """The aligner input for Code2Wav's finished output (the orchestrator calls it once, at the
    end of the sentence), or None: an empty waveform has nothing to align."""
    if audio is None:
        return None
    wav = audio.reshape(-1).to(torch.float32)
    if wav.numel() == 0:
        log.warning("code2wav2aligner: empty waveform; no timestamps")
        return None
    return AlignerInput(wav, sample_rate, segment_words(text))
