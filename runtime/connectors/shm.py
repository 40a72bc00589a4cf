"""ShmConnector: a stage edge over shared-memory segments with per-key lock files (spec §2.3–§2.10).

Who creates and who removes:

* the writer (``put``) takes the key's lock file, creates the segment, reserves it, writes the
  frame and **commits it last** (the frame's trailer), then releases the lock; the lock file stays;
* the reader (``get``) takes the lock without blocking, copies the payload out, takes the
  segment's name away (a large one is kept as a spare whose pages the producer's next put
  reuses, see :mod:`runtime.connectors.stores`), and removes the lock file whenever it consumed
  the bytes, **whether or not they decoded** (#8082 / #4414); bytes that are not a committed,
  intact frame — a writer killed mid-write, a zero-length or truncated segment, corrupt bytes —
  are a :class:`CorruptChunk`, never "not arrived yet";
* ``cleanup(key)`` removes exactly ``key`` (never a prefix) on the abort path;
* ``reap_consumed`` forgets, in bounded rotating sweeps, keys a consumer in another process took
  (and the lock file such a consumer may have left if it died before removing it);
* ``close`` removes every key this connector still tracks, and the spares of its namespace.

With a ring (``send_ring``), a payload up to a fraction of the ring goes on the edge's ring
(:mod:`runtime.connectors.ring`) instead of a segment of its own, by the same steps: a frame
reserved (``shm.put.created``), written, then committed last; a reader takes it while it holds the
ring's lock, so no cleanup or later frame can touch it mid-copy; ``cleanup`` cancels it. A put
that finds the ring full waits a moment for room and then takes a segment: never dropped, never
blocked for long. A key lives in one place at a time: a put replaces the unread payload of its
key wherever it is.

Nothing here waits without a bound (a lock file held by someone else is waited for at most
``lock_timeout_s``) and no storage error escapes as a raw exception: a put that meets one reports
failure with its cause and leaves nothing behind; a get never loses a payload it consumed.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from runtime.connectors import ring as rings
from runtime.connectors.base import CorruptChunk, PutResult
from runtime.connectors.keys import InvalidKeyError, validate_key, validate_stage
from runtime.connectors.ring import Ring, RingSettings, locked
from runtime.connectors.stores import LockFile, Segment, SegmentId, SparseSegment, Store, StoreError
from runtime.connectors.wakeup import Wakeups
from runtime.connectors.wire import (
    BufferIO,
    EncodedFrame,
    FrameDecoder,
    FrameIO,
    LostChunk,
    WireDecodeError,
    WireEncodeError,
    committed_generation,
    frame_seed,
)
from runtime.kernel import current_kernel, wait_until

log = logging.getLogger(__name__)

#: Keys examined per reap sweep (spec §2.7): bounds the work, not the size of the pending set.
REAP_BUDGET = 64
#: The small sweep at the start of every put (L1).
PUT_REAP_BUDGET = 4
#: Back-off while another party holds a key's lock file (a reader holds it only while it copies
#: the payload out): 1 ms, doubling up to 50 ms.
LOCK_RETRY_S = 0.001
LOCK_RETRY_MAX_S = 0.05
#: The longest a put waits for a key's lock file before it fails.
LOCK_TIMEOUT_S = 10.0
#: A cleanup that failed to remove its segment (spec §2.12) keeps the key; the reap tries again
#: this many times at most, after 0.1 s, then 0.2 s between tries; the close once more.
CLEANUP_RETRIES = 3
CLEANUP_RETRY_S = 0.1
#: From this size on a put computes the frame's checksum beside the copy, not after it.
PARALLEL_CHECKSUM_BYTES = 4 << 20


class LockTimeout(StoreError):
    """The key's lock file stayed held by someone else for longer than the put may wait."""


class ConnectorClosed(StoreError):
    """A put on a connector that is closed, or was closed before the put ended."""


class PutId(NamedTuple):
    """Which put's payload a handle names: the file it went to (a segment, or its edge's ring)
    and its frame there (the frame's generation in the segment, its position on the ring). A
    later put may reuse the file (a consumed segment kept as a spare, a ring), never the pair.
    A ring frame's put names its ring's edge too, so a get by its handle finds the ring whatever
    stages the get names (spec §2.4: the handle is used directly)."""

    on_ring: bool
    file: SegmentId
    frame: int
    edge: str | None = None

    def handle(self) -> dict[str, Any]:
        """How a put's handle names it: ``"file"`` (a segment) or ``"frame"`` (a ring, with its
        ``"edge"``), each ``[device, inode, frame]``."""
        if self.on_ring:
            return {"frame": [*self.file, self.frame], "edge": self.edge}
        return {"file": [*self.file, self.frame]}

    def is_ring_frame(self, ring: Ring, frame: rings.Frame) -> bool:
        """Whether this put's payload is ``frame`` of ``ring`` (not a later put's at the same
        position of a ring made again)."""
        return self.on_ring and self.file == ring.memory.identity and self.frame == frame.pos


def resolve_get(get_key: str, metadata: object) -> tuple[str, PutId | None]:
    """The key a get reads (spec §2.4), and which put's payload it may take (None: any).

    Metadata keyed by ``get_key`` is unwrapped; a put's handle (``{"shm": {"name": key}}``) names
    the key, and the segment frame or ring frame that put made (a handle of an older put of the
    key finds nothing: its payload was consumed or replaced); anything else, a handle naming no
    valid key included, falls back to ``get_key``."""
    if isinstance(metadata, dict) and isinstance(get_key, str) and get_key in metadata:
        metadata = metadata[get_key]
    shm = metadata.get("shm") if isinstance(metadata, dict) else None
    if not isinstance(shm, dict) or shm.get("name") is None:
        return get_key, None
    try:
        key = validate_key(shm["name"])
    except InvalidKeyError:
        return get_key, None
    for kind in ("file", "frame"):
        named = shm.get(kind)
        if isinstance(named, list) and len(named) == 3 and all(type(n) is int for n in named):
            edge = shm.get("edge") if kind == "frame" and isinstance(shm.get("edge"), str) else None
            return key, PutId(kind == "frame", (named[0], named[1]), named[2], edge)
    return key, None


def _holds(segment: Segment, put: PutId) -> bool:
    """Whether ``segment`` holds the frame of the put ``put`` names (not a later put's frame in
    the same file, a spare reused; a trailer that cannot be read names no put)."""
    if put.on_ring or segment.identity != put.file:
        return False
    try:
        return committed_generation(segment) == put.frame
    except WireDecodeError:
        return False


class ShmConnector:
    """The shared-memory connector of one stage process."""

    def __init__(
        self,
        store: Store,
        *,
        stage_id: int = -1,
        wakeups: Wakeups | None = None,
        lock_timeout_s: float = LOCK_TIMEOUT_S,
        upstream: Store | None = None,
        upstream_alive: Callable[[], bool] | None = None,
        send_ring: RingSettings | None = None,
        receive_ring: bool = False,
    ) -> None:
        """``store``: where this stage's puts go (its own namespace). ``upstream``: where the
        stage it receives from puts (default: the same store, stages of one process);
        ``upstream_alive`` says whether that producer still lives (default: it always does).
        ``send_ring``: put small payloads on a ring per edge; ``receive_ring``: look for the
        payloads this stage gets on its producer's ring first."""
        self.store = store
        self.send_ring = send_ring
        self.receive_ring = receive_ring
        #: This connector's rings, by edge name, and the ones it reads, with the store they are in.
        self._send_rings: dict[str, Ring] = {}
        self._receive_rings: dict[str, tuple[Store, Ring]] = {}
        #: Where each tracked key that went on a ring is: (edge, frame position).
        self._ring_keys: dict[str, tuple[str, int]] = {}
        #: Keys a put of this connector is placing right now.
        self._putting: set[str] = set()
        self.upstream = upstream if upstream is not None else store
        self._upstream_alive = upstream_alive
        self.stage_id = stage_id
        if not 0 <= lock_timeout_s < math.inf:  # (also refuses nan: no wait may be unbounded)
            raise ValueError(f"lock_timeout_s must be a finite number of seconds >= 0, got {lock_timeout_s}")
        self.lock_timeout_s = lock_timeout_s
        self._wakeups = wakeups
        #: The keys this connector put that may be unread, with the segment each put made (None:
        #: on a ring, or not known): a cleanup removes that segment, never a later put's.
        self._pending_keys: OrderedDict[str, SegmentId | None] = OrderedDict()
        #: Pending keys whose cleanup failed to remove their segment: the retries made, and when
        #: the reap may try again.
        self._failed_cleanups: dict[str, tuple[int, float]] = {}
        #: Keys whose lock file this connector had to leave because someone held it (a reader
        #: in another process): removed by a later reap, once it is free.
        self._held_locks: dict[str, None] = {}
        self._closed = False
        self._puts = 0
        self._gets = 0
        self._bytes = 0
        self._ring_puts = 0
        self._ring_fallbacks = 0

    # -- put ---------------------------------------------------------------------------------

    async def put(self, from_stage: str, to_stage: str, put_key: str, data: object) -> PutResult:
        """Store ``data`` under ``put_key``, replacing unread data of the same key.

        Never raises (spec §2.1): storage and encoding failures (a full /dev/shm, a name that is
        not ours, a lock file held too long, a connector closed before the put ended) and bad
        arguments (an invalid key, a stage that is neither a string nor an int) return ``(False,
        0, {"error": cause})`` and leave neither segment nor lock file.
        """
        k = current_kernel()
        try:
            validate_key(put_key)
            from_stage = validate_stage(from_stage, "from_stage")
            to_stage = validate_stage(to_stage, "to_stage")
        except (InvalidKeyError, TypeError) as e:
            log.warning("put refused: %s", e)
            return PutResult(False, 0, {"error": str(e)})
        try:
            if self._closed:
                raise ConnectorClosed("the connector is closed")
            await k.point("shm.put.begin", key=put_key)
            self.reap_consumed(max_keys=PUT_REAP_BUDGET)
            frame = EncodedFrame(data)
            await self._take_turn(put_key)
            try:
                placed = await self._put_on_ring(from_stage, to_stage, put_key, frame)
                if placed is None:
                    try:
                        placed = await self._write_locked(put_key, frame)
                    except (StoreError, WireEncodeError):
                        raise  # (a failure it reports: it left nothing)
                    except BaseException as e:
                        # It may have left its segment (a bug, an interrupted call): tracked (as
                        # the segment it made, once made), so a prefix cleanup or the close
                        # removes it if no exact cleanup does — or removed now, if the close ran
                        # already (not by a process being killed: it does nothing more).
                        self._pending_keys.setdefault(put_key, None)
                        if self._closed and isinstance(e, Exception):
                            self._remove_payload(put_key)
                        raise
                self._pending_keys[put_key] = None if placed.on_ring else placed.file
                self._failed_cleanups.pop(put_key, None)  # (what a failed cleanup left, this put replaced)
            finally:
                self._putting.discard(put_key)
            if self._closed:
                # The close ran while this put was placing its payload, and removed what it
                # tracked then: what this put placed is removed here (nobody reads it now).
                self._remove_payload(put_key)
                raise ConnectorClosed("the connector was closed during the put")
        except (StoreError, WireEncodeError) as e:
            log.warning("put of %s failed: %s", put_key, e)
            k.note("shm.put.failed", key=put_key, error=type(e).__name__)
            return PutResult(False, 0, {"error": str(e)})
        if self._wakeups is not None:
            k.note("shm.put.wake", key=put_key, to=to_stage)
            self._wakeups.notify(to_stage)
        self._puts += 1
        self._ring_puts += placed.on_ring
        self._bytes += frame.size
        await k.point("shm.put.end", key=put_key)
        handle = {"name": put_key, "size": frame.size, **placed.handle()}
        return PutResult(True, frame.size, {"shm": handle, "size": frame.size})

    async def _take_turn(self, key: str) -> None:
        """Wait until no other put of ``key`` is in flight in this process — one key's payload
        is in one place, which two puts deciding at once (ring or segment) could break — at most
        ``lock_timeout_s``, as long as for a key's lock file; then :class:`LockTimeout`."""
        if not await wait_until(
            lambda: key not in self._putting,
            what="put",
            key=key,
            limit_s=self.lock_timeout_s,
            first_s=LOCK_RETRY_S,
            max_s=LOCK_RETRY_MAX_S,
        ):
            raise LockTimeout(f"another put of {key!r} stayed in flight for more than {self.lock_timeout_s:g}s")
        self._putting.add(key)

    async def _put_on_ring(self, from_stage: str, to_stage: str, key: str, frame: EncodedFrame) -> PutId | None:
        """Put ``frame`` on the edge's ring: where it went (a cleanup may cancel it meanwhile); None
        if it goes to a segment instead (no ring, too large, the key's unread payload is in a
        segment, or the ring stayed full or held). Either way the key's unread ring frame, if any,
        is cancelled first: the new payload replaces it."""
        k = current_kernel()
        # Where the key's unread payload is must be asked before its ring frame is cancelled:
        # cancelling forgets the frame, and the key would then look as if it were in a segment.
        in_segment = key in self._pending_keys and key not in self._ring_keys
        self._cancel_ring_frame(key)
        settings = self.send_ring
        ring = self._send_ring(from_stage, to_stage) if settings is not None else None
        if ring is None or settings is None or in_segment or frame.size > settings.max_payload:
            return None
        await k.point("shm.put.locked", key=key)
        edge = rings.edge_name(from_stage, to_stage)
        deadline = k.now() + settings.full_wait_s
        reserved = None
        while reserved is None:
            room = self._wakeups.generation(rings.room_channel(edge)) if self._wakeups is not None else None
            held = True
            with contextlib.suppress(rings.RingBusy):
                async with locked(ring.memory, wait_s=max(0.0, deadline - k.now()), key=key):
                    held = False
                    try:
                        reserved = ring.reserve(key, frame.size)
                    except rings.RingCorrupt as e:
                        self._retire_corrupt(ring, edge, e)
                        return None
                    if reserved is None:
                        ring.want_room()
            if reserved is None:
                if k.now() >= deadline:
                    self._ring_fallbacks += 1
                    # What the harness checks the decision against: the frame, and whether the
                    # ring was full (its last look) or held by a reader.
                    k.note("ring.full", key=key, edge=edge, bytes=frame.size, held=held)
                    return None
                # At least one back-off step: a remainder of a few ulps would never let time move.
                if not await self._wait_for_room(edge, room, max(deadline - k.now(), rings.LOCK_RETRY_S)):
                    k.note("ring.room_wait_timed_out", key=key, edge=edge, bytes=frame.size)
        self._ring_keys[key] = (edge, reserved.pos)
        try:
            await k.point("shm.put.created", key=key, via="ring")
            await k.point("shm.put.reserved", key=key, bytes=frame.size)
            with ring.payload(reserved) as view:
                io = BufferIO(view)
                try:
                    checksum = await self._write_body(frame, io, frame_seed(key, 0))
                    await k.point("shm.put.written", key=key)
                    frame.commit(io, checksum)
                finally:
                    io.close()
            await k.point("shm.put.committed", key=key)
        except BaseException as e:
            if not ring.memory.closed:  # (closed: this process died, or closed the ring: it writes nothing more)
                ring.abandon(reserved)
            self._ring_keys.pop(key, None)
            if self._closed and isinstance(e, Exception):
                # The connector closed under this put and let go of the ring's memory it wrote into.
                raise ConnectorClosed("the connector was closed during the put") from e
            raise
        if ring.memory.closed:
            self._ring_keys.pop(key, None)  # (the connector closed under it: its close took the key)
        elif not ring.commit(reserved):
            # Cancelled while it was being written: the cleanup wins, as it does over a segment
            # it unlinked under a writer. Its space is free only now (the cleanup could not
            # release it), so a put waiting for room is told now, not at its deadline.
            self._ring_keys.pop(key, None)
            self._release_if_free(ring, edge)
        return PutId(True, ring.memory.identity, reserved.pos, edge)

    async def _wait_for_room(self, edge: str, generation: int | None, timeout: float) -> bool:
        """Until a reader of ``edge``'s ring released space (or ``timeout``); without wakeups,
        a short sleep. True if a reader said it released space."""
        if self._wakeups is None or generation is None:
            await current_kernel().sleep(min(timeout, rings.LOCK_RETRY_MAX_S))
            return False
        return await self._wakeups.wait_for_change(rings.room_channel(edge), generation, timeout=timeout)

    def _send_ring(self, from_stage: str, to_stage: str) -> Ring | None:
        """The ring of this edge, made on its first use; None if it cannot be made (the puts
        of the edge then take segments, and the next put tries again). :class:`ConnectorClosed`
        once the connector closed."""
        if self._closed:  # (closed while this put waited: a ring made now would outlive its connector)
            raise ConnectorClosed("the connector was closed during the put")
        edge = rings.edge_name(from_stage, to_stage)
        ring = self._send_rings.get(edge)
        if ring is not None and ring.retired:  # found corrupt (by its reader, or by a put): replaced
            self._drop_send_ring(edge, ring)
            ring = None
        if ring is not None or self.send_ring is None:
            return ring
        try:
            validate_key(edge)
            predecessor = self.store.open_ring(edge)
            old = Ring.attach(predecessor) if predecessor is not None else None
            if old is not None:  # a consumer may still map it: tell it to let go
                old.retire()
                old.close()
            memory = self.store.create_ring(edge, self.send_ring.capacity)
        except (StoreError, InvalidKeyError) as e:
            log.warning("no ring for the edge %s -> %s (its puts take segments): %s", from_stage, to_stage, e)
            current_kernel().note("ring.unavailable", edge=edge, error=type(e).__name__)
            return None
        ring = self._send_rings[edge] = Ring.made(memory, self.store.owner())
        return ring

    def _drop_send_ring(self, edge: str, ring: Ring) -> set[str]:
        """Forget a retired ring of ours, and the keys whose frames it held; remove its name.
        Each key still unread there will never be read: it is marked lost (the keys returned)."""
        del self._send_rings[edge]
        lost: set[str] = set()
        for key in [key for key, (e, _) in self._ring_keys.items() if e == edge]:
            _, pos = self._ring_keys.pop(key)
            gone_with = f"its frame went with the corrupt ring of {edge}"
            if self._unread_on_retired(ring, key, pos) and self._mark_lost(key, gone_with):
                lost.add(key)
        try:
            self.store.unlink_ring(edge, only=ring.memory)
        except StoreError as e:
            log.warning("could not remove the ring %s: %s", edge, e)
        ring.close()
        return lost

    @staticmethod
    def _frame_unread(ring: Ring, key: str, pos: int) -> bool:
        """Whether ``key``'s frame at ``pos`` is still being written or unread (raises
        :class:`~runtime.connectors.ring.RingCorrupt` if the ring's bytes cannot tell)."""
        frame = ring.frame(pos)  # (None: taken and released already, by now)
        return frame is not None and frame.key == key and frame.state in (rings.WRITING, rings.READY)

    @classmethod
    def _unread_on_retired(cls, ring: Ring, key: str, pos: int) -> bool:
        """Whether ``key``'s frame on a retired ring was never taken: it never will be (a reader
        leaves a retired ring). A ring whose bytes cannot tell counts it unread, and one cut short
        is not looked at."""
        if ring.cut_short():
            return True
        try:
            return cls._frame_unread(ring, key, pos)
        except rings.RingCorrupt:
            return True

    def _mark_lost(self, key: str, reason: str) -> bool:
        """Put, under ``key``, a committed frame that says its payload was lost (a segment): the
        reader's get of it raises :class:`CorruptChunk` naming the reason, so its request fails
        now, not at its input deadline. The key stays tracked (a cleanup, or the reader, removes
        the segment). Never waits: if the key's lock file is held, nothing is put. True if it was
        put."""
        current_kernel().note("shm.lost", key=key)
        log.error("the chunk %s is lost: %s", key, reason)
        frame = EncodedFrame(LostChunk(reason))
        try:
            lock = self.store.open_lock(key, create=True)
        except StoreError as e:
            log.warning("%s is not marked lost: %s", key, e)
            return False
        assert lock is not None
        created = False
        try:
            if not (lock.try_acquire() and lock.is_current()):
                log.warning("%s is not marked lost: its lock file is held", key)
                return False
            segment = self.store.create_segment(key)
            created = True
            try:
                segment.reserve(frame.size)
                frame.write_to(segment)
            finally:
                segment.close()
            return True
        except StoreError as e:
            log.warning("%s is not marked lost: %s", key, e)
            self._roll_back(key, created=created)
            return False
        finally:
            lock.close()

    def _retire_corrupt(self, ring: Ring, edge: str, error: rings.RingCorrupt) -> set[str]:
        """``ring``'s bytes are not a ring's: retired (see :mod:`runtime.connectors.ring`). If
        it is ours, it is dropped: the keys marked lost."""
        log.error("the ring of %s is corrupt and retired (the chunks it held are lost): %s", edge, error)
        current_kernel().note("ring.corrupt", edge=edge)
        ring.retire()
        if self._send_rings.get(edge) is not ring:
            return set()
        # Ours: nothing on it is read any more, so its name goes now, not at the edge's next put
        # (there may be none).
        return self._drop_send_ring(edge, ring)

    def _cancel_ring_frame(self, key: str) -> bool:
        """Cancel the ring frame of ``key`` this connector put, if it is still being written or
        unread; True if it did. Never waits (see :meth:`Ring.cancel`); the space is released
        now if the ring is free, else by whoever releases next."""
        placed = self._ring_keys.pop(key, None)
        if placed is None:
            return False
        edge, pos = placed
        ring = self._send_rings[edge]
        try:
            if ring.memory.closed or not ring.cancel(key, pos):
                return False
        except rings.RingCorrupt as e:
            self._retire_corrupt(ring, edge, e)
            return False
        self._release_if_free(ring, edge)
        return True

    def _release_if_free(self, ring: Ring, edge: str) -> None:
        """:meth:`_release` if the ring's lock is free now (never waits: a reader holding it
        releases when it lets go)."""
        if ring.memory.try_lock():
            try:
                self._release(ring, edge)
            finally:
                ring.memory.unlock()

    def _release(self, ring: Ring, edge: str) -> None:
        """With the ring's lock held: release the finished frames at its front, and wake the
        producer if it waits for room."""
        try:
            ring.release_finished()
        except rings.RingCorrupt as e:
            self._retire_corrupt(ring, edge, e)
            return
        if ring.room_was_wanted() and self._wakeups is not None:
            self._wakeups.notify(rings.room_channel(edge))

    async def _write_locked(self, key: str, frame: EncodedFrame) -> PutId:
        """Write ``frame`` to a new segment of ``key``; where it went."""
        # The lock file is taken *before* the segment exists and released only once the frame is
        # committed, so a non-blocking reader never finds a writer at work; and the commit
        # trailer goes last, so a reader after a writer that died mid-frame finds no commit.
        k = current_kernel()
        lock = await self._acquire_lock_file(key)
        segment: Segment | None = None
        try:
            await k.point("shm.put.locked", key=key)
            segment = self.store.create_segment(key)
            await k.point("shm.put.created", key=key, via="segment")
            created = segment
            created.reserve(frame.size)
            self._pending_keys[key] = created.identity  # (a put that raises from here on left it)
            await k.point("shm.put.reserved", key=key, bytes=frame.size)
            checksum = await self._write_body(frame, created, frame_seed(key, created.generation))
            await k.point("shm.put.written", key=key)
            frame.commit(created, checksum, created.generation)
            await k.point("shm.put.committed", key=key)
            return PutId(False, created.identity, created.generation)
        except StoreError:
            self._roll_back(key, created=segment is not None)
            raise
        finally:
            if segment is not None:
                segment.close()
            lock.close()

    @staticmethod
    async def _write_body(frame: EncodedFrame, segment: FrameIO, seed: int) -> int:
        """Copy the frame's body into the segment; its checksum (seeded with ``seed``). A large
        frame's checksum is computed beside the copy (it reads only the payload's memory), not
        after it."""
        k = current_kernel()
        if frame.size < PARALLEL_CHECKSUM_BYTES:
            return await k.run_blocking(lambda: (frame.write_body(segment), frame.checksum(seed))[1], cost=frame.size)
        checksum: list[int] = []

        async def compute() -> None:
            checksum.append(await k.run_blocking(lambda: frame.checksum(seed), cost=frame.size))

        async def copy() -> None:
            await k.run_blocking(lambda: frame.write_body(segment), cost=frame.size)

        async with k.task_group() as both:
            both.start_soon(compute, name="shm.put.checksum")
            both.start_soon(copy, name="shm.put.copy")
        return checksum[0]

    def _roll_back(self, key: str, *, created: bool) -> None:
        """Undo a failed put while still holding the key's lock (no reader can be inside)."""
        if created:  # (its segment replaced any older one of the key: nothing of it is left to track)
            self._pending_keys.pop(key, None)
        try:
            if created:
                self.store.unlink_segment(key)
            self.store.remove_lock(key)
        except StoreError as e:
            log.warning("rolling back the failed put of %s: %s", key, e)

    async def _acquire_lock_file(self, key: str) -> LockFile:
        """Create-or-open the key's lock file and take it, waiting at most ``lock_timeout_s``.

        A reader that consumed the previous payload removes the lock file while holding it, so a
        lock won on a file that lost its name protects nothing: retry on the new file."""
        taken: list[LockFile] = []

        def take() -> bool:
            lock = self.store.open_lock(key, create=True)
            assert lock is not None
            if lock.try_acquire() and lock.is_current():
                taken.append(lock)
                return True
            lock.close()
            return False

        limit_s = self.lock_timeout_s
        if not await wait_until(
            take, what="lock", key=key, limit_s=limit_s, first_s=LOCK_RETRY_S, max_s=LOCK_RETRY_MAX_S
        ):
            raise LockTimeout(f"the lock file of {key!r} stayed held for more than {limit_s:g}s")
        return taken[0]

    # -- get ---------------------------------------------------------------------------------

    async def get(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        claim: Callable[[], bool] | None = None,
    ) -> tuple[Any, int] | None:
        """Take the payload of ``get_key`` if it is complete now; None if it has not arrived.

        Raises :class:`CorruptChunk` when the bytes taken were not a committed, intact frame
        (they are consumed all the same) or the key's names are not ours; :class:`InvalidKeyError`
        for a key that names no chunk, :class:`TypeError` for a stage neither a string nor an int.

        ``claim`` is asked once the key's lock is held and before anything is consumed: False
        leaves the payload where it is. A reader whose request was cleaned up while its get was
        in flight says no there, so it can never eat a chunk that a later generation of the
        same id wrote under the same key — no writer of the key can slip in between the answer
        and the consumption, in this process or another.
        """
        k = current_kernel()
        key, put = resolve_get(get_key, metadata)
        validate_key(key)
        from_stage = validate_stage(from_stage, "from_stage")
        to_stage = validate_stage(to_stage, "to_stage")
        await k.point("shm.get.begin", key=key)
        if self._closed:
            return None  # (a closed connector maps nothing again: what it mapped, it let go)
        # (a ring frame's handle finds its ring whether or not this connector reads rings)
        by_ring_handle = put is not None and put.on_ring
        edge = put.edge if put is not None and put.edge is not None else rings.edge_name(from_stage, to_stage)
        ring = self._receive_ring(edge) if self.receive_ring or by_ring_handle else None
        if ring is not None and not ring.lacks(key):
            try:
                async with locked(ring.memory, wait_s=rings.LOCK_WAIT_S, key=key):
                    frame = ring.find(key)
                    if frame is not None:
                        if put is not None and not put.is_ring_frame(ring, frame):
                            return None  # the key's payload now is a later put's
                        return await self._take_from_ring(ring, frame, claim, edge)
            except rings.RingBusy:
                pass  # another reader is copying out: the key may be in a segment all the same
            except rings.RingCorrupt as e:
                self._retire_corrupt(ring, edge, e)
        # One store for the whole get: a producer restarted meanwhile moves ``upstream`` to its
        # new namespace, and the lock and segment of this key are the old one's.
        store = self.upstream
        try:
            lock = store.open_lock(key, create=False)
        except StoreError as e:
            raise CorruptChunk(key, str(e)) from None
        if lock is None:
            return None
        try:
            if not lock.try_acquire() or not lock.is_current():
                return None  # a writer is at work (or a reader just took it)
            try:
                segment = store.open_segment(key)
            except SparseSegment as e:
                # Ours, and not what a put of ours leaves: a corrupt chunk, consumed like one.
                if claim is not None and not claim():
                    return None
                self._drop_sparse(store, key, lock)
                raise CorruptChunk(key, str(e)) from None
            except StoreError as e:
                raise CorruptChunk(key, str(e)) from None
            if segment is None or (put is not None and not _holds(segment, put)) or (claim is not None and not claim()):
                if segment is not None:
                    segment.close()
                return None
            obj, size, error = await self._consume(store, key, segment, lock)
        finally:
            lock.close()
        return self._taken(key, obj, size, error)

    def _drop_sparse(self, store: Store, key: str, lock: LockFile) -> None:
        """Remove a sparse segment (never kept as a spare) and its lock file, as a get removes a
        consumed one; the caller holds the lock."""
        log.warning("dropped the sparse segment %s", key)
        current_kernel().note("shm.get.corrupt", key=key)
        try:
            store.unlink_segment(key)
        except StoreError as e:
            log.warning("could not remove the sparse segment %s: %s", key, e)
        self._remove_lock_after_read(store, key, lock)

    def _taken(self, key: str, obj: Any, size: int, error: Exception | None) -> tuple[Any, int]:
        """What a get that consumed ``key``'s bytes returns: the payload, or (bytes that were
        not an intact frame) a :class:`CorruptChunk` naming the key."""
        if error is not None:
            log.warning("dropped the corrupt chunk %s: %s", key, error)
            current_kernel().note("shm.get.corrupt", key=key)
            raise CorruptChunk(key, str(error))
        self._pending_keys.pop(key, None)
        self._gets += 1
        return obj, size

    async def get_with_deadline(
        self,
        from_stage: str,
        to_stage: str,
        get_key: str,
        metadata: dict[str, Any] | None = None,
        *,
        deadline: float,
    ) -> tuple[Any, int] | None:
        """:meth:`get`, or None once the kernel's clock (``time.monotonic`` outside the simulator)
        has reached ``deadline`` (upstream's API, spec §2.1)."""
        if current_kernel().now() >= deadline:
            return None
        return await self.get(from_stage, to_stage, get_key, metadata)

    def abandon_get(self, get_key: str) -> None:
        """Upstream's API (spec §2.1): a get here holds nothing between calls, so there is
        nothing to let go of."""

    async def _take_from_ring(
        self, ring: Ring, frame: rings.Frame, claim: Callable[[], bool] | None, edge: str
    ) -> tuple[Any, int] | None:
        """With the ring's lock held: copy ``frame`` out, then mark it DONE — decoded or not."""
        k = current_kernel()
        key = frame.key
        if claim is not None and not claim():
            return None
        await k.point("shm.get.locked", key=key)
        with ring.payload(frame) as view:
            io = BufferIO(view)
            try:
                obj, error = await self._decoded(io, key)
            finally:
                io.close()
        if not ring.memory.closed:  # (closed: the connector closed under this get)
            ring.set_state(frame, rings.DONE)
            self._release(ring, edge)
        try:
            await k.point("shm.get.consumed", key=key)
        except WireDecodeError as e:
            error = e
        k.note("shm.get.unlocked", key=key)
        return self._taken(key, obj, frame.payload_len, error)

    def _receive_ring(self, edge: str) -> Ring | None:
        """The producer's ring of ``edge``, if it has one this connector may read: made by the
        owner of the producer's namespace and not retired (a replaced producer's old ring)."""
        cached = self._receive_rings.get(edge)
        if cached is not None:
            store, ring = cached
            if store is self.upstream and not ring.retired:
                return ring
            ring.close()
            del self._receive_rings[edge]
        try:
            memory = self.upstream.open_ring(validate_key(edge))
        except (StoreError, InvalidKeyError):
            return None
        if memory is None:
            return None
        ring = Ring.attach(memory, retire_malformed=True)
        owner = self.upstream.owner()
        if ring is None or ring.retired or (owner is not None and ring.producer() != (owner.pid, owner.start_ticks)):
            current_kernel().note("ring.refused", edge=edge)
            if ring is not None:
                # Not the producer's (a replaced producer's, or a stray write over its identity):
                # retired, so that its producer, if it still puts there, makes a new one.
                ring.retire()
                ring.close()
            return None
        self._receive_rings[edge] = (self.upstream, ring)
        return ring

    async def _consume(
        self, store: Store, key: str, segment: Segment, lock: LockFile
    ) -> tuple[Any, int, Exception | None]:
        """Copy the payload out, then remove the segment and lock file — decoded or not."""
        k = current_kernel()
        size = segment.size
        try:
            await k.point("shm.get.locked", key=key)
            obj, error = await self._decoded(segment, key)
        finally:
            segment.close()
        try:
            store.retire_segment(key)
        except StoreError as e:
            log.warning("could not remove the consumed segment %s: %s", key, e)
        try:
            try:
                await k.point("shm.get.consumed", key=key)
            except WireDecodeError as e:
                error = e
        finally:
            self._remove_lock_after_read(store, key, lock)
        return obj, size, error

    @classmethod
    async def _decoded(cls, source: FrameIO, key: str) -> tuple[Any, WireDecodeError | None]:
        """The decoded payload of ``key``'s frame, or the reason the bytes are not an intact frame
        of that key."""
        try:
            return await cls._decode(source, key), None
        except WireDecodeError as e:
            return None, e
        except StoreError:
            raise  # an I/O error of the moment: nothing is consumed, and the reader tries again
        except Exception as e:  # a decoder that broke on these bytes would break on them again
            return None, WireDecodeError(f"the decoder failed on it: {type(e).__name__}: {e}")

    @staticmethod
    async def _decode(segment: FrameIO, key: str | None) -> Any:
        """Decode ``key``'s frame (None: a frame encoded on its own). Its checksum is of the bytes
        copied out, never of a second read of the segment beside the copy: a process outside the
        protocol (which takes no lock) may write to it between two reads (found by an outside
        audit: 32 MiB chunks came back wrong and unflagged)."""
        decoder = FrameDecoder(segment, key)  # the header: small, checked before anything is allocated
        return await current_kernel().run_blocking(decoder.decode, cost=decoder.nbytes)

    def _remove_lock_after_read(self, store: Store, key: str, lock: LockFile) -> None:
        """The bytes were taken and the segment unlinked: the lock file goes too, decoded or not
        (#8082 i; before, a falsy or undecodable payload leaked its lock file).

        It is removed while still held, and only if the name still refers to it: after the
        release, the name may already belong to the next writer of this key. A failure to
        remove it loses nothing: the payload is returned all the same.
        """
        try:
            if lock.is_current():
                store.remove_lock(key)
            current_kernel().note("shm.get.unlocked", key=key)
        except StoreError as e:
            log.warning("could not remove the lock file of the consumed chunk %s: %s", key, e)

    # -- cleanup and reap --------------------------------------------------------------------

    async def cleanup(self, key: str) -> bool:
        """Remove exactly ``key`` (segment and lock file); True if a segment was unlinked."""
        k = current_kernel()
        validate_key(key)
        await k.point("shm.cleanup.begin", key=key)
        return self._remove_payload(key)

    def _remove_payload(self, key: str) -> bool:
        """Forget ``key`` and remove its unread payload: its ring frame, or the segment its put
        made (not a later put's of the same name) and the idle lock file. True if there was one.

        A segment that cannot be removed (an error of the file system) keeps its key and its lock
        file: the reap tries again (:data:`CLEANUP_RETRIES`), and so does the close."""
        k = current_kernel()
        if key in self._ring_keys:
            self._pending_keys.pop(key, None)
            removed = self._cancel_ring_frame(key)
            if removed:
                k.note("shm.cleanup.unlinked", key=key)
            return removed
        identity = self._pending_keys.get(key)
        try:
            removed = self.store.unlink_segment(key, only=identity)
        except StoreError as e:
            log.warning("cleanup of %s: %s", key, e)
            if identity is not None:
                self._cleanup_failed(key)
            else:  # (not a segment this connector knows it made: nothing to try again with)
                self._pending_keys.pop(key, None)
            return False
        self._pending_keys.pop(key, None)
        self._failed_cleanups.pop(key, None)
        if removed:
            k.note("shm.cleanup.unlinked", key=key)
        if removed or identity is None or not self.store.segment_exists(key):
            self._remove_idle_lock(key)  # (a later put's segment keeps the lock file it goes with)
        return removed

    def _cleanup_failed(self, key: str) -> None:
        k = current_kernel()
        retries, _ = self._failed_cleanups.get(key, (-1, 0.0))
        retries += 1
        self._failed_cleanups[key] = (retries, k.now() + CLEANUP_RETRY_S * 2 ** min(retries, 1))
        k.note("shm.cleanup.failed", key=key, retries=retries)

    def _remove_idle_lock(self, key: str) -> None:
        """Remove the key's lock file unless someone holds it. A holder is a reader, which
        removes the file itself once it consumed the bytes; removing a held file by name would
        let the next writer of the key create a new one and run unexcluded past that reader.
        A held file is looked at again by later reaps (its holder may die without removing it)."""
        try:
            lock = self.store.open_lock(key, create=False)
            if lock is None:
                self._held_locks.pop(key, None)
                return
            try:
                if lock.try_acquire() and lock.is_current():
                    self.store.remove_lock(key)
                    self._held_locks.pop(key, None)
                else:
                    self._held_locks[key] = None
            finally:
                lock.close()
        except StoreError as e:
            log.warning("could not remove the idle lock file of %s: %s", key, e)

    async def cleanup_prefix(self, key_prefix: str) -> int:
        """Clean up the tracked keys ``key_prefix + digits`` (``R_1_`` matches ``R_1_12``, not
        ``R_1_2_0``, which belongs to request ``R_1_2``). Never scans the directory."""
        matching = [
            key for key in self._pending_keys if key.startswith(key_prefix) and key[len(key_prefix) :].isdigit()
        ]
        removed = 0
        for key in matching:
            removed += await self.cleanup(key)
        return removed

    def reap_consumed(self, *, max_keys: int = REAP_BUDGET) -> None:
        """Examine at most ``max_keys`` of the oldest tracked keys; forget those already consumed
        (and the lock file a consumer that died before removing it left) and rotate those still
        unread to the back, so unread keys never starve the rest."""
        for _ in range(min(max_keys, len(self._pending_keys))):
            key, identity = self._pending_keys.popitem(last=False)
            if key in self._ring_keys:
                if self._on_ring(key):
                    self._pending_keys[key] = None
            elif key in self._failed_cleanups:
                self._pending_keys[key] = identity
                self._retry_cleanup(key)
            elif self.store.segment_exists(key):
                self._pending_keys[key] = identity
            else:
                self._remove_idle_lock(key)
        for key in list(self._held_locks)[:max_keys]:
            if key not in self._pending_keys and not self.store.segment_exists(key):
                self._remove_idle_lock(key)

    def _retry_cleanup(self, key: str) -> None:
        """Try again to remove the segment a failed cleanup of ``key`` left, once its back-off
        is over and while it has retries left (after those, the close tries once more)."""
        retries, due = self._failed_cleanups[key]
        if retries < CLEANUP_RETRIES and current_kernel().now() >= due:
            self._remove_payload(key)

    def _on_ring(self, key: str) -> bool:
        """Whether ``key`` is still unread: its ring frame, or the frame marking it lost if its
        ring went; forgets the frame if not. (Read without the lock: only this process reuses
        the ring's space, and a frame taken meanwhile is simply looked at again by the next
        sweep.)"""
        edge, pos = self._ring_keys[key]
        ring = self._send_rings[edge]
        try:
            if ring.retired:  # its reader found it corrupt
                return key in self._drop_send_ring(edge, ring)
            if self._frame_unread(ring, key, pos):
                return True
        except rings.RingCorrupt as e:
            return key in self._retire_corrupt(ring, edge, e)
        del self._ring_keys[key]
        return False

    # -- wakeups, health, residue, close -----------------------------------------------------

    def _wakeup_stage(self) -> str | None:
        """This receiver's stage as wakeups name it; None (keep polling) for a stage id that is
        not a non-negative int, as upstream's connector accepts any stage id at its API edge."""
        if self._wakeups is None or self._closed or not isinstance(self.stage_id, int) or self.stage_id < 0:
            return None
        return str(self.stage_id)

    def get_wakeup_generation(self) -> int | None:
        stage = self._wakeup_stage()
        return None if stage is None or self._wakeups is None else self._wakeups.generation(stage)

    def poke(self) -> None:
        stage = self._wakeup_stage()
        if stage is not None and self._wakeups is not None:
            self._wakeups.poke(stage)

    async def wait_for_change(
        self, generation: int, *, timeout: float, ready: Callable[[], bool] | None = None
    ) -> bool:
        stage = self._wakeup_stage()
        if stage is None or self._wakeups is None:
            return False
        return await self._wakeups.wait_for_change(stage, generation, timeout=timeout, ready=ready)

    def producer_alive(self) -> bool:
        """Whether the stage this one receives from still lives (a dead one sends nothing more)."""
        return self._upstream_alive is None or self._upstream_alive()

    def health(self) -> dict[str, Any]:
        return {
            "status": "healthy",
            "puts": self._puts,
            "gets": self._gets,
            "bytes_transferred": self._bytes,
            "ring_puts": self._ring_puts,
            "ring_fallbacks": self._ring_fallbacks,
        }

    def residue(self) -> dict[str, list[str]]:
        return {
            "pending_keys": list(self._pending_keys),
            "held_locks": list(self._held_locks),
            "ring_keys": list(self._ring_keys),
            "putting": sorted(self._putting),
        }

    async def __aenter__(self) -> ShmConnector:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """``async with`` closes the connector (upstream's ``__exit__``: closing may wait here)."""
        await self.close()

    def __enter__(self) -> ShmConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        """A plain ``with`` closes the connector too (spec §2.1), for code that cannot await: what
        :meth:`close` removes, without its yield point before each key."""
        for key in self._closing():
            self._remove_payload(key)

    async def close(self) -> None:
        """Remove every tracked key, unread ones included. Idempotent."""
        for key in self._closing():
            await self.cleanup(key)

    def _closing(self) -> Iterator[str]:
        """A close: each tracked key for the caller to remove, then (once it removed them all) the
        spares, the rings and the wakeups are let go. Nothing if the connector is closed already."""
        if self._closed:
            return
        self._closed = True
        yield from list(self._pending_keys)
        # A lock file a reader held when its key was cleaned up: gone by now if the reader
        # finished (it removes the file itself), and removed here if it is idle. One still held is
        # its reader's to remove (or a sweep's, if the reader died): nothing here looks again.
        for key in list(self._held_locks):
            self._remove_idle_lock(key)
        self._held_locks.clear()
        for name in self.store.spares():
            try:
                self.store.remove_spare(name)
            except StoreError as e:
                log.warning("could not remove the spare segment %s: %s", name, e)
        for edge, ring in self._send_rings.items():
            ring.retire()  # a reader still mapping it lets go (a successor may make one of that name)
            try:
                # (only while the name is still this ring's: a successor's of that name stays)
                self.store.unlink_ring(edge, only=ring.memory)
            except StoreError as e:
                log.warning("could not remove the ring %s: %s", edge, e)
            ring.close()
        for _, ring in self._receive_rings.values():
            ring.close()
        self._send_rings.clear()
        self._receive_rings.clear()
        self._ring_keys.clear()
        if self._wakeups is not None:
            self._wakeups.close()
