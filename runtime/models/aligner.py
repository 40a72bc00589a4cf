"""The toy forced aligner: a complete waveform plus its words → per-word start/end in ms.

Contract (spec §4.4, §7): the aligner only ever sees a *complete* waveform (it is not a chunk
consumer). Its answer covers the whole audio: spans are contiguous and in word order, the first
starts at 0 ms and the last ends at the audio's duration, every other boundary lies on the
:data:`BIN_MS` = 80 ms grid (Qwen3-ForcedAligner's timestamp bin).

Method (deterministic, and it does use the waveform): the audio is cut into 80 ms bins and each
bin's energy (mean square) is measured; a small floor keeps silent stretches splitting by time.
Words are given shares of the total energy in proportion to their length in characters, and each
word boundary goes to the bin edge where the cumulative energy is closest to the cumulative share
(ties to the earlier edge). So loud stretches take more words than quiet ones.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

#: Width of a timestamp bin in milliseconds (spec §9).
BIN_MS = 80
#: Fallback sample rate when a caller has none (spec §4.4).
DEFAULT_SAMPLE_RATE = 24000
#: Energy floor, relative to the mean bin energy: silence still gets (a little) weight per bin.
_ENERGY_FLOOR = 1e-3


class WordTimestamp(NamedTuple):
    word: str
    start_ms: float
    end_ms: float


def segment_words(text: str) -> list[str]:
    """The words the aligner is asked for (upstream ``segment_words`` for space-separated languages)."""
    return text.split()


class ForcedAligner(nn.Module):
    """Energy-based aligner. No weights; an ``nn.Module`` so the pipeline places it like the others."""

    def __init__(self, *, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.register_buffer("_anchor", torch.zeros(0, device=device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    @torch.no_grad()
    def forward(self, wav: torch.Tensor, sample_rate: int = DEFAULT_SAMPLE_RATE) -> torch.Tensor:
        """Mean-square energy per 80 ms bin of a 1-D waveform: float64 ``[ceil(len / bin)]``.

        The last, partial bin is averaged over the samples it has.
        """
        samples = wav.reshape(-1).to(self.device, torch.float64)
        bin_len = self._bin_len(sample_rate)
        bins = math.ceil(samples.numel() / bin_len)
        padded = torch.nn.functional.pad(samples, (0, bins * bin_len - samples.numel()))
        sums = padded.square().view(bins, bin_len).sum(dim=1)
        counts = torch.full((bins,), float(bin_len), dtype=torch.float64, device=self.device)
        if bins:
            counts[-1] = samples.numel() - (bins - 1) * bin_len
        return sums / counts

    @staticmethod
    def _bin_len(sample_rate: int) -> int:
        if sample_rate <= 0:
            raise ValueError(f"sample_rate must be positive; got {sample_rate}")
        return max(1, round(sample_rate * BIN_MS / 1000))

    @torch.no_grad()
    def align(self, wav: torch.Tensor, words: list[str], sample_rate: int = DEFAULT_SAMPLE_RATE) -> list[WordTimestamp]:
        """Per-word ``(word, start_ms, end_ms)`` for a complete waveform (1-D float, any device).

        Spans are contiguous (``end_ms`` of a word is ``start_ms`` of the next), non-decreasing,
        start at 0 and end at ``len(wav) / sample_rate · 1000``. When there are more words than
        bins some spans are empty (start == end): an 80 ms grid cannot do better. No words → ``[]``.
        """
        if not words:
            return []
        duration_ms = wav.numel() / sample_rate * 1000.0
        energy = self(wav, sample_rate)
        bin_ms = self._bin_len(sample_rate) / sample_rate * 1000.0
        if energy.numel() == 0:
            return [WordTimestamp(w, 0.0, 0.0) for w in words]
        energy = energy + _ENERGY_FLOOR * energy.mean() + 1e-12
        cumulative = torch.cat([energy.new_zeros(1), energy.cumsum(0)]) / energy.sum()  # at bin edges
        weights = torch.tensor([max(1, len(w)) for w in words], dtype=torch.float64, device=self.device)
        shares = (weights.cumsum(0) / weights.sum())[:-1]  # interior boundaries
        # Nearest bin edge to each share: the first edge at or above it, or the one just before.
        upper = torch.searchsorted(cumulative, shares).clamp(max=cumulative.numel() - 1)
        lower = (upper - 1).clamp(min=0)
        nearer_lower = (shares - cumulative[lower]) <= (cumulative[upper] - shares)
        edges = torch.where(nearer_lower, lower, upper).cummax(dim=0).values.tolist()
        boundaries = [0.0, *(min(edge * bin_ms, duration_ms) for edge in edges), duration_ms]
        return [WordTimestamp(w, boundaries[i], boundaries[i + 1]) for i, w in enumerate(words)]
