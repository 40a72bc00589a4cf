"""Sender generations and the sender's tables, keyed by external id (spec §3.1, §3.2).

A :class:`SenderGeneration` is one generation of an external id: created by the first chunk
queued for the id, retired by its cleanup, compared by identity so that a late completion of an
aborted generation never touches its successor. :class:`SenderTables` maps each id to the
generation that owns it and to what that generation has sent; a processor sees its part of them
through a :class:`GenerationContext`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class SenderGeneration:
    """The sender state of one generation of an external id (spec §3.2). Compared by identity."""

    serial: int
    #: The stage request it serves: a save of another request of the same external id (the id
    #: reused while this generation still sends its terminal) is not this generation's.
    request_id: str
    in_flight: bool = False
    cancelled: bool = False
    terminal_pending: bool = False
    num_puts: int = 0
    terminal_sent: bool = False
    #: A put of this generation failed: it sends nothing more (a later chunk would go out under
    #: the failed key and the receiver would take a gapped stream for a whole one).
    failed: bool = False


class SenderTables:
    """The sender's per-external-id state (spec §3.1), guarded by the sender's lock.

    Everything but ``sender_tokens`` goes at once when a generation retires (:meth:`clear`).
    """

    def __init__(self) -> None:
        self.sender_tokens: dict[str, SenderGeneration] = {}
        #: The next chunk id; advances only after a successful put.
        self.put_req_chunk: dict[str, int] = {}
        #: The watermark: the confirmed computed-token count at the last enqueue.
        self.requests_num_chunks_sent: dict[str, int] = {}
        #: The Thinker processor's chunk-0 buffer.
        self.request_payload: dict[str, Any] = {}
        #: The codec processor's frames of the current segment.
        self.code_prompt_token_ids: dict[str, list[Any]] = {}
        self.segment_generation: dict[str, int] = {}

    def owns(self, ext: str, token: SenderGeneration) -> bool:
        """True while ``token`` is the generation that owns ``ext``."""
        return self.sender_tokens.get(ext) is token

    def clear(self, ext: str) -> None:
        """Forget what was sent for ``ext`` (``_clear_sender_state_locked``, spec §3.5); the caller
        pops the generation itself."""
        for table in (
            self.put_req_chunk,
            self.requests_num_chunks_sent,
            self.request_payload,
            self.code_prompt_token_ids,
            self.segment_generation,
        ):
            table.pop(ext, None)

    def end_segment(self, ext: str) -> None:
        """A segment end was sent: its codec frames are spent (spec §3.4 step 10)."""
        self.code_prompt_token_ids.pop(ext, None)


class GenerationContext:
    """What a processor knows and keeps of the sender generation it makes a chunk for (spec §4).

    Made for one processor call, while that generation owns ``ext`` and its put is in flight: no
    other code touches these entries meanwhile, and they go when the generation retires.
    """

    def __init__(self, tables: SenderTables, ext: str) -> None:
        self._tables = tables
        self._ext = ext

    @property
    def chunk_id(self) -> int:
        """The id of the chunk this call would produce: how many chunks of the id went out."""
        return self._tables.put_req_chunk.get(self._ext, 0)

    def codec_frames(self) -> list[Any]:
        """The codec frames kept for the current segment (the list itself: append to it)."""
        return self._tables.code_prompt_token_ids.setdefault(self._ext, [])

    def take_cached_payload(self) -> dict[str, Any] | None:
        """The payload an earlier call cached (once), or None."""
        return self._tables.request_payload.pop(self._ext, None)

    def cache_payload(self, payload: dict[str, Any]) -> None:
        """Keep ``payload`` for the next call instead of sending it now."""
        self._tables.request_payload[self._ext] = payload
