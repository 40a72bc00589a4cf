"""Audio as the wire carries it: 16-bit little-endian mono PCM, alone or in a RIFF/WAVE file, or
compressed (MP3, FLAC, Opus in Ogg) as upstream's server writes them, with libsndfile."""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile
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


#: Each compressed format this libsndfile writes: its container and subtype. (One built without
#: MP3 or Opus, before 1.1 or by choice, leaves them out: asked for, they are a clear 400.)
COMPRESSED: dict[str, tuple[str, str]] = {
    name: (container, subtype)
    for name, container, subtype in (
        ("mp3", "MP3", "MPEG_LAYER_III"),
        ("flac", "FLAC", "PCM_16"),
        ("opus", "OGG", "OPUS"),
    )
    if soundfile.check_format(container, subtype)
}

#: The media type of a response in each format (upstream's).
MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "pcm16": "audio/pcm",
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "opus": "audio/ogg",
}


def encode(audio: torch.Tensor, fmt: str, sample_rate: int) -> bytes:
    """``wav`` (a whole file), ``pcm``/``pcm16`` (raw samples), or a whole file of a
    :data:`COMPRESSED` format."""
    if fmt == "wav":
        return wav(audio, sample_rate)
    if fmt not in COMPRESSED:
        return pcm16(audio)
    container, subtype = COMPRESSED[fmt]
    # The same 16-bit samples every other format carries, so that all of them sound alike.
    samples = np.frombuffer(pcm16(audio), "<i2")
    with io.BytesIO() as out:
        soundfile.write(out, samples, sample_rate, format=container, subtype=subtype)
        return out.getvalue()
