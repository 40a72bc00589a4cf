"""``talker2code2wav_async_chunk``: the Talker's codec frames, cut into Code2Wav chunks (spec §4.1).

The Talker emits one ``[1, 16]`` codec frame per step. This processor keeps the valid ones per
request and, at each chunk boundary, sends the new frames together with up to
``codec_left_context_frames`` earlier frames as left context, so that Code2Wav can decode the
chunk alone and still produce the same audio as one offline decode (spec §6). Chunk 0 can be
shorter (``initial_codec_chunk_frames``) for an early first audio.

With IC = 4, C = 25, LC = 25 the chunks are emitted at 4, 29, 54, … valid frames and carry
4, 29 (4 of them context), 50 (25 context), 50, … frames. A flush (terminal or segment end)
sends the remainder; if nothing remains it returns None and the adapter sends an empty terminal.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.config.deploy import CodecChunking
from runtime.request import Request
from runtime.transfer.generations import GenerationContext

#: Codebook-0 value of the Talker's end-of-speech frame (spec §9).
STOP_TOKEN = 2150


def is_valid_frame(frame: object, stop_tokens: frozenset[int]) -> bool:
    """A frame worth decoding: a non-empty tensor, not the all-zero prefill placeholder, and not
    a post-end frame (codebook 0 holds a stop token)."""
    return (
        isinstance(frame, torch.Tensor)
        and frame.numel() > 0
        and bool(frame.any())
        and int(frame.reshape(-1, frame.shape[-1])[0, 0]) not in stop_tokens
    )


def codebook_major(frames: list[torch.Tensor]) -> torch.Tensor:
    """``[1, Q]`` frames as the wire's flat codebook-major layout: all frames of codebook 0, then
    codebook 1, … (frame-major bytes have a valid length too, and decode to garbage)."""
    return torch.cat(frames, dim=0).transpose(0, 1).reshape(-1)


class Talker2Code2WavAsyncChunk:
    """The processor, configured once per stage. Call signature as every processor's (spec §4)."""

    def __init__(self, chunking: CodecChunking, stop_tokens: frozenset[int] = frozenset({STOP_TOKEN})) -> None:
        self.chunking = chunking
        self.stop_tokens = stop_tokens

    def __call__(
        self, context: GenerationContext, multimodal_output: dict[str, Any], request: Request, is_finished: bool
    ) -> dict[str, Any] | None:
        frames: list[torch.Tensor] = context.codec_frames()
        frame = (multimodal_output.get("codes") or {}).get("audio")
        appended = is_valid_frame(frame, self.stop_tokens)
        if appended:
            frames.append(frame.reshape(-1, frame.shape[-1]))
        elif not is_finished:
            return None
        window = self.window(len(frames), context.chunk_id, is_finished, appended)
        if window is None:
            return None
        left, end = window
        codes = codebook_major(frames[len(frames) - end :])
        return {"codes": {"audio": codes}, "meta": {"left_context_size": left, "finished": torch.tensor(is_finished)}}

    def window(self, length: int, chunk_id: int, is_finished: bool, appended: bool) -> tuple[int, int] | None:
        """(left context frames, frames to send, counted from the newest) — or None: no chunk now."""
        initial = self.chunking.initial_codec_chunk_frames
        size = self.chunking.codec_chunk_frames
        if length <= 0:
            return None
        if initial > 0:
            if chunk_id == 0:
                size = initial
            else:
                length -= initial
        remainder = length % size
        if remainder and not is_finished:
            return None  # wait for the boundary
        if is_finished and not appended and remainder == 0:
            return None  # nothing new: the adapter sends an empty terminal
        new = remainder or size
        if initial > 0 and chunk_id == 1:
            return initial, length + initial  # chunk 1 re-sends the initial chunk as context
        left = max(0, min(length - new, self.chunking.codec_left_context_frames))
        return left, min(length, left + new)


def talker2code2wav_full_payload(frames: list[torch.Tensor]) -> dict[str, Any]:
    """``async_chunk`` off: every valid frame of a finished Talker request, forwarded whole by the
    orchestrator, in the chunk layout (codebook-major flat ids)."""
    codes = codebook_major(frames) if frames else torch.empty(0, dtype=torch.int64)
    return {"codes": {"audio": codes}}
