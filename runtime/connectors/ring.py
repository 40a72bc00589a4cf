"""The per-edge ring: the small chunks of one stage edge in one shared, pre-reserved region.

A fresh segment per chunk pays for two file creations, a reservation and the page faults of new
memory on every chunk; the Thinker → Talker edge sends one small chunk per token. A ring pays
those once per edge (upstream's ``HostRingTransport`` is the same idea). Payloads larger than a
fraction of the ring go to per-key segments as before; a chunk is found by its key either way, so
which way a chunk went never changes the order a receiver takes them in.

Layout (little endian)::

    header, 64 bytes: b"OMRG" | u32 version | u64 capacity | u64 head | u64 tail
                      | u32 producer pid | u32 retired | u64 producer start ticks
                      | u32 room wanted | zeros
    frames after it, each 64-byte aligned:
        u32 state | u32 key length | u64 payload length | u64 span | key | zeros | payload

The payload is a whole wire frame (:mod:`runtime.connectors.wire`), commit trailer and checksum
included. ``head`` and ``tail`` count the bytes ever reserved and released (they only grow); a
frame lives at ``64 + pos % (capacity - 64)``. A frame that would run past the end is preceded by
a PAD frame filling the rest, so every frame is contiguous.

States, and the moves between them::

    WRITING --commit--> READY --take--> DONE
       |                  |
       |                  +--cancel---> CANCELLED
       +--cancel--> ABORTED --commit or abandon--^
       +--abandon-----------------------^

The producer writes a WRITING frame's payload without the lock (no one reads a WRITING frame)
and commits only once every byte is in place: a producer killed mid-write leaves a WRITING frame,
never a READY one. The consumer holds the lock from the moment it finds its frame until it marked
it DONE, the copy-out included, so neither a cancel nor the producer's next frame can touch the
bytes being read; a consumer killed mid-copy releases the lock with its death and leaves the frame
READY, as a reader killed mid-copy leaves a segment. ``tail`` moves past a frame only once it is
DONE, CANCELLED or PAD: space is reused only when nothing in it can be read any more.

A put that finds no room says so in the header (*room wanted*, under the lock) and waits on the
edge's room wakeup; a reader that releases space under the lock and finds room wanted clears it
and wakes the producer. (The lock orders the two, so the wakeup is never lost; and the wait is
bounded all the same, after which the put takes a segment.)

Nobody waits long for the lock. A reader stopped mid-copy (SIGSTOP) holds it until it goes on
or dies; meanwhile puts take segments and gets look in segments. A get first looks for its key
without the lock (:meth:`Ring.lacks`), so a poll for a chunk not there yet takes no lock at all.

A cancel never waits for the lock: only the producer's process cancels, and only the producer
reuses space, so between its check of a frame and its one-byte store nothing can reuse that
frame; a reader in the middle of taking it marks it DONE afterwards (it was taken before the
cancel, as a segment unlinked under a reader still reaches it). A frame cancelled while its
producer still writes into it becomes ABORTED, which no reader takes and the tail does not pass:
its space is released only once its producer is done with it. A WRITING frame's other moves are
its producer's alone, made without the lock. Head and tail are each stored with one aligned
8-byte write, so a process killed mid-store never leaves half of one.

The producer records its identity (pid and start time) in the header; a consumer attaches only to
a ring whose producer is its namespace's owner, and a producer that replaces a ring marks the old
one *retired*, so a consumer still mapping it lets go.

Whoever finds that a ring's bytes are not a ring's (a header, a head, a tail or a frame that no
producer of ours writes: a stray write of another process) retires it the same way: its reader
lets go, its producer makes a new one at its next put, and the chunks it held are lost — their
receivers give up at their input deadline, never on an exception out of the bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from runtime.config.deploy import DEFAULT_RING_BYTES
from runtime.connectors.namespaces import Owner
from runtime.connectors.stores import RingMemory, Store, StoreError
from runtime.kernel import wait_until

MAGIC = b"OMRG"
VERSION = 1
#: magic, version, capacity, head, tail, producer pid, retired, producer start ticks.
HEADER = struct.Struct("<4sIQQQIIQ")
#: magic, version, capacity: what no move of a ring ever changes.
_IDENTITY = struct.Struct("<4sIQ")
#: How many times a reader looks at a header that moves while it is judged, before it gives up
#: for now (it looks again at its next get).
ATTACH_LOOKS = 3
#: The header's first word, magic and version: a new ring's last store.
_MADE = struct.unpack("<Q", struct.pack("<4sI", MAGIC, VERSION))[0]
HEADER_SIZE = 64
_HEAD_AT = 16
_TAIL_AT = 24
_RETIRED_AT = 36
_ROOM_WANTED_AT = 48
#: state, key length, payload length, span.
FRAME = struct.Struct("<IIQQ")
ALIGN = 64
#: A frame's header and key, aligned, at most (a key is at most 200 characters).
_FRAME_HEAD_MAX = 256

WRITING, READY, DONE, CANCELLED, PAD, ABORTED = 1, 2, 3, 4, 5, 6
_STATES = frozenset({WRITING, READY, DONE, CANCELLED, PAD, ABORTED})
#: The states whose space the tail may pass: nothing in such a frame can be read or written any
#: more (an ABORTED frame's producer may still be writing into it).
FINISHED = frozenset({DONE, CANCELLED, PAD})

#: The least payload a ring must carry: the smallest wire frame (an empty payload's, 88 bytes) fits.
MIN_PAYLOAD = 2 * ALIGN
#: A ring's size when the deploy file names none (upstream's default).
DEFAULT_CAPACITY = DEFAULT_RING_BYTES
#: Payloads up to this share of a ring go on it; larger ones go to their own segment.
MAX_FRAME_FRACTION = 0.25
#: How long a put waits for room on a full ring before it takes a segment instead.
FULL_WAIT_S = 0.005
#: How long a get waits for the ring's lock (a reader holds it for one copy-out) before it looks
#: in segments only, for now.
LOCK_WAIT_S = 0.05
LOCK_RETRY_S = 0.00005
LOCK_RETRY_MAX_S = 0.002


class RingBusy(StoreError):
    """The ring's lock stayed held for longer than the caller may wait (a reader stopped mid-copy
    holds it until it goes on or dies)."""


class RingCorrupt(StoreError):
    """The ring holds bytes no producer of ours writes there (a stray write of another process
    of ours): a head or tail out of place, or a frame that does not fit where it lies."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class RingSettings:
    """How the rings of one connector are made."""

    capacity: int = DEFAULT_CAPACITY
    max_frame_fraction: float = MAX_FRAME_FRACTION
    full_wait_s: float = FULL_WAIT_S

    def __post_init__(self) -> None:
        if self.capacity < 4 * ALIGN or self.capacity % ALIGN:
            raise ValueError(f"a ring's capacity must be a multiple of {ALIGN} and at least {4 * ALIGN} bytes")
        if not 0 < self.max_frame_fraction <= 0.5:
            raise ValueError("a ring's max_frame_fraction must be in (0, 0.5]")
        if self.max_payload < MIN_PAYLOAD:
            raise ValueError(
                f"a ring of {self.capacity} bytes carries no payload of {MIN_PAYLOAD} bytes "
                f"(max_frame_fraction {self.max_frame_fraction}): it is too small"
            )
        if not 0 <= self.full_wait_s < math.inf:  # (also refuses nan)
            raise ValueError(f"a ring's full_wait_s must be a finite number of seconds >= 0, got {self.full_wait_s}")

    @property
    def max_payload(self) -> int:
        """The largest payload that goes on the ring: a share of it, and small enough that a
        frame (with its header and longest key) fits beside any remainder at the ring's end."""
        data_size = self.capacity - HEADER_SIZE
        return min(int(data_size * self.max_frame_fraction), data_size // 2 - 2 * _FRAME_HEAD_MAX)


def edge_name(from_stage: str, to_stage: str) -> str:
    return f"edge_{from_stage}_{to_stage}"


def room_channel(edge: str) -> str:
    """The wakeup channel on which a ring's producer waits for room."""
    return f"room_{edge}"


class Frame(NamedTuple):
    """A frame as the ring holds it now (a tuple: two are made per chunk)."""

    pos: int
    state: int
    key: str
    payload_at: int
    payload_len: int
    span: int


class Ring:
    """One side's view of a ring. Every method but :meth:`payload` expects the lock held."""

    def __init__(self, memory: RingMemory) -> None:
        self.memory = memory
        self.view = memory.view
        self.capacity = len(self.view)
        self.data_size = self.capacity - HEADER_SIZE
        #: The header as 8-byte words: head and tail are each one aligned store.
        self._words = self.view[:HEADER_SIZE].cast("Q")
        #: The ring as 4-byte words, for a frame's state and the header's flags: each one aligned
        #: store, which a look without the lock sees whole. (``struct.pack_into`` zeroes its bytes
        #: before it writes them: a state written with it reads 0, no state at all, to a look that
        #: comes in between.)
        self._u32 = self.view.cast("I")
        self._identity = _IDENTITY.pack(MAGIC, VERSION, self.capacity)

    @classmethod
    def attach(cls, memory: RingMemory, *, retire_malformed: bool = False) -> Ring | None:
        """A view of an existing ring; None (and ``memory`` closed) if its bytes are not a
        well-formed ring: too small, a size that is not whole frames, a bad header — or one
        not made yet, or moving too fast to judge (the next look tries again). With
        ``retire_malformed`` a bad header of a ring's size is marked retired first, so that its
        producer replaces it (a reader's move: the producer would write on)."""
        size = len(memory.view)
        if size < 4 * ALIGN or size % ALIGN:
            memory.close()
            return None
        ring = cls(memory)
        # Read without the lock: a live ring's head and tail may move between two reads, so a
        # header is judged malformed only if it held still while it was judged.
        for _ in range(ATTACH_LOOKS):
            seen = ring._words.tolist()
            if seen[0] == 0:
                break  # no magic yet: its producer is still making it (the magic goes last)
            if ring.well_formed():
                return ring
            if ring._words.tolist() == seen:
                if retire_malformed:
                    ring.retire()
                break
        ring.close()
        return None

    def close(self) -> None:
        self._words.release()
        self._u32.release()
        self.memory.close()

    # -- the header --------------------------------------------------------------------------

    @classmethod
    def made(cls, memory: RingMemory, producer: Owner | None) -> Ring:
        """A new ring's header on ``memory`` (zeros, under the ring's name already: a reader
        may map it at any moment). The magic goes last, in one aligned store: until then a
        reader finds no ring there, and once it is there, so is everything else."""
        ring = cls(memory)
        pid, ticks = (producer.pid, producer.start_ticks) if producer is not None else (0, 0)
        HEADER.pack_into(ring.view, 0, bytes(len(MAGIC)), 0, ring.capacity, 0, 0, pid, 0, ticks)
        ring._words[0] = _MADE
        return ring

    def well_formed(self) -> bool:
        head, tail = self.head, self.tail
        return self.view[: _IDENTITY.size] == self._identity and tail <= head <= tail + self.data_size

    def producer(self) -> tuple[int, int]:
        fields = HEADER.unpack_from(self.view, 0)
        return fields[5], fields[7]

    @property
    def head(self) -> int:
        return self._words[_HEAD_AT // 8]

    @property
    def tail(self) -> int:
        return self._words[_TAIL_AT // 8]

    @property
    def retired(self) -> bool:
        """Whether the ring is done with: marked so, or cut short (see :meth:`cut_short`)."""
        return self.cut_short() or bool(self._u32[_RETIRED_AT // 4])

    def retire(self) -> None:
        if not self.cut_short():
            self._u32[_RETIRED_AT // 4] = 1

    def cut_short(self) -> bool:
        """Whether the ring's file is shorter than its mapping now: a process outside the protocol
        truncated it, and touching the pages past its end would kill this one (SIGBUS). Each put
        and get asks first (through :attr:`retired`), and a cancel; such a ring is retired
        without a look at its bytes. (A cut that lands between that look and a side's copy still
        kills it: one ``fstat`` per operation, not per access.)"""
        return self.memory.truncated()

    def want_room(self) -> None:
        self._u32[_ROOM_WANTED_AT // 4] = 1

    def room_was_wanted(self) -> bool:
        """Whether a producer waits for room (the flag is cleared: one wakeup answers it)."""
        if not self._u32[_ROOM_WANTED_AT // 4]:
            return False
        self._u32[_ROOM_WANTED_AT // 4] = 0
        return True

    # -- frames ------------------------------------------------------------------------------

    def _at(self, pos: int) -> int:
        return HEADER_SIZE + pos % self.data_size

    def _bounds(self) -> tuple[int, int]:
        """Tail and head, checked: both on a frame boundary, at most a ring apart, in a ring whose
        header still names it (a stray write over the magic, version or capacity is found by the
        next move of either side, as one over a frame is)."""
        if self.view[: _IDENTITY.size] != self._identity:
            raise RingCorrupt(f"the ring's header is not that of a {self.capacity}-byte ring of version {VERSION}")
        tail, head = self.tail, self.head
        if tail % ALIGN or head % ALIGN or not tail <= head <= tail + self.data_size:
            raise RingCorrupt(f"tail {tail} and head {head} are not those of a {self.data_size}-byte ring")
        return tail, head

    def _described(self, pos: int, head: int) -> tuple[int, int, int, int]:
        """State, key length, payload length and span of the frame at ``pos`` (a boundary
        before ``head``), checked to be a frame a producer of ours writes: a known state, its
        key and payload inside its span, the span whole frames that end before the ring does."""
        offset = pos % self.data_size
        state, key_len, payload_len, span = FRAME.unpack_from(self.view, HEADER_SIZE + offset)
        if not (
            state in _STATES
            and span >= ALIGN
            and span % ALIGN == 0
            and offset + span <= self.data_size
            and pos + span <= head
            and _align(FRAME.size + key_len) + payload_len <= span
        ):
            raise RingCorrupt(
                f"the frame at {pos} (state {state}, a {key_len}-byte key, a {payload_len}-byte payload, "
                f"span {span}) is not one a producer of ours writes"
            )
        return state, key_len, payload_len, span

    def _frame(self, pos: int, head: int) -> Frame:
        state, key_len, payload_len, span = self._described(pos, head)
        at = self._at(pos)
        key = bytes(self.view[at + FRAME.size : at + FRAME.size + key_len]).decode("ascii", "replace")
        return Frame(pos, state, key, at + _align(FRAME.size + key_len), payload_len, span)

    def frame(self, pos: int) -> Frame | None:
        """The frame this process reserved at ``pos``; None if the tail has passed it (it is
        finished: its reader took it meanwhile, perhaps from another process, and released it —
        the producer reads without the lock, and only the producer reuses space, so the bytes
        there stay its frame's until its own next reserve)."""
        tail, head = self._bounds()
        if pos < tail:
            return None
        if pos >= head or pos % ALIGN:
            raise RingCorrupt(f"no frame can start at {pos} (tail {tail}, head {head})")
        return self._frame(pos, head)

    def frames(self) -> Iterator[Frame]:
        """Every frame between tail and head, oldest first."""
        pos, head = self._bounds()
        while pos < head:
            frame = self._frame(pos, head)
            yield frame
            pos += frame.span

    def find(self, key: str) -> Frame | None:
        """The unread frame of ``key``, if the ring holds one."""
        return self._find(key, *self._bounds())

    def lacks(self, key: str) -> bool:
        """Whether the ring surely holds no unread frame of ``key``, looked at *without* the lock,
        so that a poll for a chunk not yet there takes no lock (False: look again under it).

        Only the lock's holder moves the tail, and the producer writes only beyond the head and
        behind the tail's last lap: while the tail stays where the look found it, no frame the
        look walked was rewritten under it. So a look after which the tail has not moved saw
        every frame as it was (its state may have moved on since, as after any look); one after
        which it moved, or that met bytes that are not a ring's, cannot tell."""
        try:
            tail, head = self._bounds()
            found = self._find(key, tail, head)
        except RingCorrupt:
            return False  # (the look under the lock finds out what is wrong)
        return found is None and self.tail == tail

    def _find(self, key: str, pos: int, head: int) -> Frame | None:
        encoded = key.encode("ascii")
        while pos < head:
            state, key_len, payload_len, span = self._described(pos, head)
            at = self._at(pos)
            if state == READY and self.view[at + FRAME.size : at + FRAME.size + key_len] == encoded:
                return Frame(pos, state, key, at + _align(FRAME.size + key_len), payload_len, span)
            pos += span
        return None

    def payload(self, frame: Frame) -> memoryview:
        return self.view[frame.payload_at : frame.payload_at + frame.payload_len]

    def set_state(self, frame: Frame, state: int) -> None:
        self._u32[self._at(frame.pos) // 4] = state

    def _state(self, frame: Frame) -> int:
        return self._u32[self._at(frame.pos) // 4]

    def commit(self, frame: Frame) -> bool:
        """Make a written frame READY; False if a cleanup cancelled it meanwhile (it is then
        CANCELLED: the cleanup wins, as it does over a segment it unlinked under a writer)."""
        if self._state(frame) == WRITING:
            self.set_state(frame, READY)
            return True
        self.set_state(frame, CANCELLED)
        return False

    def abandon(self, frame: Frame) -> None:
        """Give up a frame whose write failed."""
        self.set_state(frame, CANCELLED)

    def cancel(self, key: str, pos: int) -> bool:
        """Cancel ``key``'s frame at ``pos`` if it is still being written (ABORTED) or unread
        (CANCELLED); True if it did. The producer's move, without the lock (see above)."""
        if self.cut_short():  # (a cleanup, the first look at the ring since the put)
            raise RingCorrupt("the ring's file was cut short under its mapping")
        frame = self.frame(pos)
        if frame is None or frame.key != key or frame.state not in (WRITING, READY):
            return False
        self.set_state(frame, ABORTED if frame.state == WRITING else CANCELLED)
        return True

    # -- the producer's moves ----------------------------------------------------------------

    def reserve(self, key: str, payload_len: int) -> Frame | None:
        """A WRITING frame for ``payload_len`` bytes; None while the ring has no room for it."""
        self.release_finished()
        encoded = key.encode("ascii")
        span = _align(FRAME.size + len(encoded)) + _align(payload_len)
        head, tail = self.head, self.tail
        offset = head % self.data_size
        pad = self.data_size - offset if offset + span > self.data_size else 0
        if head + pad + span - tail > self.data_size:
            return None
        if pad:
            self._pad(head, pad)
            head += pad
        at = self._at(head)
        FRAME.pack_into(self.view, at, WRITING, len(encoded), payload_len, span)
        self.view[at + FRAME.size : at + FRAME.size + len(encoded)] = encoded
        self._words[_HEAD_AT // 8] = head + span
        return Frame(head, WRITING, key, at + _align(FRAME.size + len(encoded)), payload_len, span)

    def _pad(self, pos: int, nbytes: int) -> None:
        """Fill the ``nbytes`` from ``pos`` to the ring's end with a PAD frame (readers and the
        tail step over it)."""
        FRAME.pack_into(self.view, self._at(pos), PAD, 0, 0, nbytes)

    def release_finished(self) -> None:
        """Move the tail past every finished frame at its front."""
        pos, head = self._bounds()
        while pos < head:
            state, _, _, span = self._described(pos, head)
            if state not in FINISHED:
                break
            pos += span
        self._words[_TAIL_AT // 8] = pos

    def unconsumed(self) -> list[str]:
        """Keys of the frames that still hold (or will hold) a chunk: residue at quiescence."""
        return [f.key for f in self.frames() if f.state in (WRITING, READY)]


def unread_frames(store: Store) -> list[str]:
    """``EDGE:KEY`` for every frame on the store's rings that holds (or will hold) a chunk nobody
    took yet: read from the shared bytes, as another process sees them."""
    out = []
    for edge in store.rings():
        try:
            memory = store.open_ring(edge)
        except StoreError:
            continue  # a name someone else took: no frame of ours is in it
        if memory is None:
            continue
        ring = Ring.attach(memory)
        if ring is None:
            continue
        try:
            out.extend(f"{edge}:{key}" for key in ring.unconsumed())
        except RingCorrupt:
            out.append(f"{edge}:(a corrupt ring)")  # what it holds cannot be told
        finally:
            ring.close()
    return out


class locked:
    """Hold a ring's lock for the block, waiting at most ``wait_s`` for it (backing off through
    the kernel; the wait is noted for ``key``), else :class:`RingBusy`. A class rather than a
    generator: it runs twice a chunk."""

    def __init__(self, memory: RingMemory, *, wait_s: float, key: str) -> None:
        self._memory = memory
        self._wait_s = wait_s
        self._key = key

    async def __aenter__(self) -> None:
        ready = self._memory.try_lock
        if not await wait_until(
            ready, what="ring", key=self._key, limit_s=self._wait_s, first_s=LOCK_RETRY_S, max_s=LOCK_RETRY_MAX_S
        ):
            raise RingBusy(f"the ring's lock stayed held for more than {self._wait_s:g}s")

    async def __aexit__(self, *exc: object) -> None:
        self._memory.unlock()
