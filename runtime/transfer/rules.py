"""The decisions of the chunk transfer protocol, each a small pure function (spec §3).

The sender and the receiver take every one of these decisions by calling it through this module
(``rules.may_send(...)``), never through a copy, so each rule is stated, documented and changed
in one place: replacing ``runtime.transfer.rules.may_send`` changes that decision everywhere the
runtime takes it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING

from runtime.transfer.generations import SenderGeneration

if TYPE_CHECKING:
    from runtime.transfer.receiver import LoadEntry


class Admission(enum.Enum):
    """What ``save_async`` does with a chunk (spec §3.3 step 5)."""

    #: Queued for sending.
    ACCEPT = "accept"
    #: Refused, and recorded as a send failure: the id's previous generation still drains.
    DRAINING = "draining"
    #: Dropped silently: a preemption replay of tokens already confirmed.
    REPLAY = "replay"


# == sender ====================================================================================


def is_draining(token: SenderGeneration | None) -> bool:
    """§3.3 step 5a, §3.5: an id whose generation was cancelled but not yet retired is draining
    (``token`` is the generation that owns the id, None if none does)."""
    return token is not None and token.cancelled


def admit_save(
    token: SenderGeneration | None, *, request_id: str, is_segment_finished: bool, confirmed: int, watermark: int
) -> Admission:
    """§3.3 step 5a–c: a draining id refuses new work — and so does one whose generation serves
    another request (the id reused while its previous request's terminal is still queued: its
    watermark would silently drop the new request's chunks as replays); then a chunk whose
    confirmed token count is below the id's watermark is a replay (equal counts pass; a segment
    end always passes)."""
    if is_draining(token) or (token is not None and token.request_id != request_id):
        return Admission.DRAINING
    if not is_segment_finished and confirmed < watermark:
        return Admission.REPLAY
    return Admission.ACCEPT


def segment_generation_after_end(kept: int | None, generation: int) -> int:
    """§3.3 step 5, #6816: the segment generation a segment end expects of the id's next save —
    the next one if the producer keeps segment generations (``kept``: the request's, None if it
    keeps none), else the same: a producer that keeps none saves every segment at 0, and moving
    on would drop each later save as late."""
    return generation if kept is None else generation + 1


def may_send(token: SenderGeneration, is_terminal: bool) -> bool:
    """§3.4 identity check and step 6 (the pre-put veto): a cancellation vetoes ordinary chunks
    but never a terminal (#6670); a failed put vetoes everything after it (#4855 R1.2)."""
    return not token.failed and (is_terminal or not token.cancelled)


def processor_flushes(*, is_segment_finished: bool, is_finished: bool) -> bool:
    """§3.4 step 3, the processor's ``is_finished``: a segment end *or* a terminal must flush its
    remainder (#5413; the wire's ``is_segment_finished`` stays False on a terminal)."""
    return is_segment_finished or is_finished


def cleanup_defers_retire(token: SenderGeneration) -> bool:
    """§3.5, §3.6: while a terminal is queued (the #6670 fence) or a put is in flight, cleanup only
    marks the generation cancelled — its id drains, new work for it is refused — and the terminal
    task or the put owes the retirement and the reclaim."""
    return token.terminal_pending or token.in_flight


def needs_reclaim(token: SenderGeneration) -> bool:
    """§3.5 ``_queue_shm_cleanup_locked``: a retired generation's keys are reclaimed if it may have
    created any, unless its terminal was sent: downstream still needs that chunk (#8082 d)."""
    return token.num_puts > 0 and not token.terminal_sent


# == receiver ==================================================================================


def stream_window_has_room(active: int, window: int) -> bool:
    """§5.2 step 5: one more stream may be taken up while fewer than ``window`` are active."""
    return active < window


def entry_is_current(registered: Mapping[str, LoadEntry], entry: LoadEntry) -> bool:
    """§3.7: identity, not membership — a re-registered id has a new entry, and a poll of the old
    one must neither consume nor commit what belongs to the new."""
    return registered.get(entry.request_id) is entry


def may_commit(registered: Mapping[str, LoadEntry], entry: LoadEntry) -> bool:
    """§3.7 step 4: cleanup is a commit barrier — a chunk whose registration was cleaned up while
    it was being read is consumed but never committed."""
    return entry_is_current(registered, entry)
