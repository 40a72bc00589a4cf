"""Mutants of the per-edge ring (omnisim issue 13): each undoes one of its rules, on the ``ring``
store, where the edge's chunks go on a ring.

Not here: "fallback reorders chunks". A receiver asks for each chunk by its key, whichever way
the chunk went, so the order it takes them in is the adapter's (chunk ids), never the transport's:
there is no decision in the ring's code whose mistake could reorder a request's chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from omnisim.registry import Patch, mutant
from runtime.connectors import ring as rings
from runtime.connectors import shm as shm_module
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.ring import FRAME, PAD, Frame, Ring
from runtime.connectors.shm import ShmConnector
from runtime.connectors.stores import MemoryStore
from runtime.connectors.wire import BufferIO
from runtime.kernel import current_kernel

RING_ISSUE = "omnisim issue 13 (the per-edge ring)"


@mutant(
    "ring_ack_before_copy",
    summary="a reader marks its frame done and lets go of the ring before it copies the bytes out: the producer "
    "reuses the space while they are being read",
    issue=RING_ISSUE,
    scenarios=("ring_full_slow_consumer", "ring_wrap_cancel"),
    # (bytes the producer wrote over meanwhile: another key's frame fails this key's checksum, and
    # its request fails for a corrupt chunk nothing in the world corrupted)
    expect=("no-corrupt-accept", "terminal-delivered", "failures-have-causes"),
    store="ring",
)
def ring_ack_before_copy() -> Iterator[Patch]:
    async def take(
        self: ShmConnector, ring: Ring, frame: Frame, claim: Callable[[], bool] | None, edge: str
    ) -> tuple[Any, int] | None:
        if claim is not None and not claim():
            return None
        ring.set_state(frame, rings.DONE)
        self._release(ring, edge)
        ring.memory.unlock()
        k = current_kernel()
        await k.point("shm.get.locked", key=frame.key)
        with ring.payload(frame) as view:
            io = BufferIO(view)
            try:
                obj, error = await self._decoded(io, frame.key)
            finally:
                io.close()
        await k.point("shm.get.consumed", key=frame.key)
        k.note("shm.get.unlocked", key=frame.key)
        return self._taken(frame.key, obj, frame.payload_len, error)

    yield Patch(ShmConnector, "_take_from_ring", take)


@mutant(
    "ring_published_before_written",
    summary="a put makes its ring frame readable when it reserves it, before the bytes are in place: a reader "
    "takes whatever the space held before",
    issue=RING_ISSUE,
    scenarios=("ring_eager_reader", "ring_full_slow_consumer"),
    # A reader takes the space's old bytes: accepted if they pass for a frame, else a corrupt
    # chunk that nothing caused. Read by no one first, the frame is found READY at the commit,
    # taken for one a cleanup cancelled, and lost: the put answered ok for a chunk that is nowhere.
    expect=("no-corrupt-accept", "terminal-delivered", "failures-have-causes", "answers-true"),
    store="ring",
)
def ring_published_before_written() -> Iterator[Patch]:
    reserve = Ring.reserve

    def published(self: Ring, key: str, payload_len: int) -> Frame | None:
        frame = reserve(self, key, payload_len)
        if frame is not None:
            self.set_state(frame, rings.READY)
        return frame

    yield Patch(Ring, "reserve", published)


@mutant(
    "ring_wrap_pad_short",
    summary="wrap-around off by one: the frame that fills the rest of the ring's end is one unit short, so a reader "
    "walking the ring steps into the middle of nowhere and never finds the frames after it",
    issue=RING_ISSUE,
    scenarios=("ring_full_slow_consumer", "ring_wrap_cancel"),
    expect=("liveness", "terminal-delivered"),
    store="ring",
)
def ring_wrap_pad_short() -> Iterator[Patch]:
    def pad(self: Ring, pos: int, nbytes: int) -> None:
        FRAME.pack_into(self.view, self._at(pos), PAD, 0, 0, nbytes - rings.ALIGN)  # the bug: one unit short

    yield Patch(Ring, "_pad", pad)


@mutant(
    "ring_cancel_never_reclaims",
    summary="a cleanup reports a ring frame cancelled but leaves it readable: an aborted request's chunks sit on "
    "the ring for good, holding its space",
    issue=RING_ISSUE,
    scenarios=("ring_wrap_cancel",),
    expect=("no-orphan-shm",),
    store="ring",
)
def ring_cancel_never_reclaims() -> Iterator[Patch]:
    def cancel(self: Ring, key: str, pos: int) -> bool:
        frame = self.frame(pos)
        return frame is not None and frame.key == key

    yield Patch(Ring, "cancel", cancel)


@mutant(
    "ring_identity_unchecked",
    summary="a reader keeps the ring it mapped whoever produces now: after its producer stage died and came back, "
    "it reads the dead producer's ring and never finds the new one's chunks",
    issue=RING_ISSUE,
    scenarios=("stage_crash",),
    expect=("liveness", "terminal-delivered"),
    store="ring",
)
def ring_identity_unchecked() -> Iterator[Patch]:
    receive_ring = ShmConnector._receive_ring

    def unchecked(self: ShmConnector, from_stage: str, to_stage: str) -> Ring | None:
        cached = self._receive_rings.get(rings.edge_name(from_stage, to_stage))
        return cached[1] if cached is not None else receive_ring(self, from_stage, to_stage)

    yield Patch(ShmConnector, "_receive_ring", unchecked)


@mutant(
    "ring_tail_never_moves",
    summary="a reader marks its frame done but the ring's tail never moves past it: the space of read frames is "
    "never reused, the ring fills up for good and every later chunk takes a segment of its own",
    issue=RING_ISSUE,
    scenarios=("ring_full_slow_consumer", "ring_wrap_cancel"),
    expect=("ring-before-segments",),
    store="ring",
)
def ring_tail_never_moves() -> Iterator[Patch]:
    def release_finished(self: Ring) -> None:
        pass  # the bug: the finished frames at the front are never released

    yield Patch(Ring, "release_finished", release_finished)


@mutant(
    "ring_room_never_wanted",
    summary="a put that finds the ring full never says so in the ring's header: the reader that frees room wakes "
    "nobody, and the put sits out its whole wait with room there (then takes a segment it did not need)",
    issue=RING_ISSUE,
    scenarios=("ring_full_slow_consumer",),
    expect=("no-lost-wakeup",),
    store="ring",
)
def ring_room_never_wanted() -> Iterator[Patch]:
    def want_room(self: Ring) -> None:
        pass  # the bug: the producer's wait is never announced

    yield Patch(Ring, "want_room", want_room)


@mutant(
    "ring_aborted_write_kept",
    summary="a put whose frame a cleanup aborted while it was being written leaves the frame aborted instead of "
    "cancelling it: the tail never passes it, and the ring's space behind it is lost for good",
    issue=RING_ISSUE,
    scenarios=("cleanup_during_put",),
    expect=("no-orphan-shm",),
    store="ring",
)
def ring_aborted_write_kept() -> Iterator[Patch]:
    def commit(self: Ring, frame: Frame) -> bool:
        if self._state(frame) == rings.WRITING:
            self.set_state(frame, rings.READY)
            return True
        return False

    yield Patch(Ring, "commit", commit)


@mutant(
    "ring_commit_revives_an_aborted_frame",
    summary="a put whose frame a cleanup aborted while it was being written commits it all the same: the chunk the "
    "cleanup answered it removed comes back, and a reader that looks after the cleanup takes it",
    issue="omnisim issue 11 (a bug the harness was not told about: a cleanup's answer was never compared with "
    "what gets found after it)",
    scenarios=("cleanup_during_put",),
    expect=("answers-true",),
    store="ring",
)
def ring_commit_revives_an_aborted_frame() -> Iterator[Patch]:
    def commit(self: Ring, frame: Frame) -> bool:
        if self._state(frame) in (rings.WRITING, rings.ABORTED):
            self.set_state(frame, rings.READY)
            return True
        self.set_state(frame, rings.CANCELLED)
        return False

    yield Patch(Ring, "commit", commit)


@mutant(
    "ring_find_matches_a_key_prefix",
    summary="a reader looking for its key on the ring compares only as many bytes as its key has: R's chunk R_1_1 "
    "matches R_1's frame R_1_1_0, and R takes R_1's chunk for its own",
    issue="omnisim issue 11 (a bug the harness was not told about: sibling ids were never both read on a ring)",
    scenarios=("sibling_ids_both_read",),
    # (the other key's frame fails this key's checksum: its request fails for a corrupt chunk that
    # nothing in the world corrupted, and R_1 never gets its chunk)
    expect=("no-corrupt-accept", "samples-exactly-once", "failures-have-causes"),
    store="ring",
)
def ring_find_matches_a_key_prefix() -> Iterator[Patch]:
    def find(self: Ring, key: str) -> Frame | None:
        encoded = key.encode("ascii")
        pos, head = self._bounds()
        while pos < head:
            state, key_len, payload_len, span = self._described(pos, head)
            at = self._at(pos)
            if state == rings.READY and self.view[at + FRAME.size : at + FRAME.size + len(encoded)] == encoded:
                return Frame(pos, state, key, at + rings._align(FRAME.size + key_len), payload_len, span)
            pos += span
        return None

    yield Patch(Ring, "find", find)


@mutant(
    "ring_tail_passes_an_aborted_write",
    summary="the ring's tail passes a frame a cleanup aborted while its put still writes it: the next put that "
    "wraps around reserves that space, and the late writer's bytes and commit land in the new chunk, which is lost",
    issue="issue 13 (a bug the harness was not told about: a ring's tail that passes a frame still being written)",
    scenarios=("cancelled_write_space",),
    expect=("liveness", "no-corrupt-accept", "failures-have-causes"),
    store="ring",
)
def ring_tail_passes_an_aborted_write() -> Iterator[Patch]:
    yield Patch(rings, "FINISHED", rings.FINISHED | {rings.ABORTED})


_cancel = Ring.cancel


@mutant(
    "cleanup_claims_a_consumed_frame",
    summary="a cleanup of a key whose ring frame a reader already took, and the tail already passed, answers that "
    "it removed an unread chunk: the count a release reports upstream is wrong",
    issue="omnisim issue 11 (a blind spot of the mutation score: nothing checked what a cleanup answered)",
    scenarios=("cleanup_during_put", "ring_wrap_cancel"),
    expect=("answers-true",),
    store="ring",
)
def cleanup_claims_a_consumed_frame() -> Iterator[Patch]:
    def cancel(self: Ring, key: str, pos: int) -> bool:
        return True if pos < self.tail else _cancel(self, key, pos)

    yield Patch(Ring, "cancel", cancel)


class _NoLock:
    """``locked`` that takes no lock."""

    def __init__(self, memory: object, *, wait_s: float, key: str) -> None:
        pass

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


@mutant(
    "ring_sections_unlocked",
    summary="a ring's producer reserves frames and its readers take them and release space without the ring's lock: "
    "across processes two writers of the head or the tail lose an update; on one thread every outcome is the same",
    issue="omnisim issue 11 (a lock the simulator's one thread cannot miss: the mutation score's remove-lock slips)",
    scenarios=("ring_full_slow_consumer", "ring_wrap_cancel"),
    expect=("ring-writes-locked",),
    store="ring",
)
def ring_sections_unlocked() -> Iterator[Patch]:
    yield Patch(shm_module, "locked", _NoLock)


class _LockOrNot(rings.locked):
    """``locked`` that, once its wait runs out, goes on without the lock instead of giving up."""

    async def __aenter__(self) -> None:
        with contextlib.suppress(rings.RingBusy):
            await super().__aenter__()


@mutant(
    "ring_held_lock_ignored",
    summary="a put that waited its while for a ring's lock goes on without it: a reader stopped mid-copy holds the "
    "lock, and the producer releases and reuses the space it is reading",
    issue="omnisim issue 11 (a survivor of the mutation score: the ring lock's give-up, deleted)",
    scenarios=("stalled_reader",),
    expect=("ring-writes-locked",),
    store="ring",
)
def ring_held_lock_ignored() -> Iterator[Patch]:
    yield Patch(shm_module, "locked", _LockOrNot)


_unlink_mem_ring, _unlink_posix_ring = MemoryStore.unlink_ring, PosixStore.unlink_ring


@mutant(
    "old_close_removes_successor_ring",
    summary="a producer's close removes whatever ring has its edge's name, a successor's that replaced its own "
    "included: the new producer's chunks go into a ring no new reader can find",
    issue="omnisim issue 13 (a ring a successor may make under the same name), found while reading this stop",
    scenarios=("producer_replaced",),
    expect=("exact-key-ownership",),
    store="ring",
)
def old_close_removes_successor_ring() -> Iterator[Patch]:
    yield Patch(MemoryStore, "unlink_ring", lambda self, edge, only=None: _unlink_mem_ring(self, edge))
    yield Patch(PosixStore, "unlink_ring", lambda self, edge, only=None: _unlink_posix_ring(self, edge))


@mutant(
    "lost_ring_chunks_left_silent",
    summary="a producer that drops a ring a stray write broke forgets the unread chunks it held without marking "
    "them lost: their reader finds nothing, and their request waits for its input deadline",
    issue=RING_ISSUE,
    scenarios=("hostile_keys_and_payloads",),
    expect=("bad-input-refused",),
    store="ring",
)
def lost_ring_chunks_left_silent() -> Iterator[Patch]:
    def unread_on_retired(ring: Ring, key: str, pos: int) -> bool:
        return False

    yield Patch(ShmConnector, "_unread_on_retired", staticmethod(unread_on_retired))
