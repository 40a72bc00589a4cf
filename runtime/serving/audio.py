"""Audio as the wire carries it: 16-bit little-endian mono PCM, alone or in a RIFF/WAVE file."""

from __future__ import annotations

import struct

import numpy as np
import torch

#: The data size a streamed WAV header announces: unknown yet, so the largest (players read to EOF).
STREAMING_SIZE = 0xFFFFFFFF


def pcm16(audio: torch.Tensor) -> bytes:
    """Float samples in [-1, 1] (clipped) as 16-bit little-endian PCM."""
    samples = audio.detach().reshape(-1).to(torch.float32).cpu().numpy()
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte RIFF/WAVE header for mono PCM16; ``data_bytes=None``: a stream of unknown length."""
    size = STREAMING_SIZE if data_bytes is None else data_bytes
    riff = STREAMING_SIZE if data_bytes is None else 36 + data_bytes
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        riff,
        b"WAVE",
        b"fmt ",
        16,
        1,
        1,
        sample_rate,
        sample_rate * 2,
        2,
        16,
        b"data",
        size,
    )


def wav(audio: torch.Tensor, sample_rate: int) -> bytes:
    data = pcm16(audio)
    return wav_header(sample_rate, len(data)) + data


def encode(audio: torch.Tensor, fmt: str, sample_rate: int) -> bytes:
    """``wav`` (a whole file) or ``pcm``/``pcm16`` (raw samples)."""
    return wav(audio, sample_rate) if fmt == "wav" else pcm16(audio)
