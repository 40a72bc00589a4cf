"""Processes of a simulated world: who is alive, and what a process that dies leaves behind.

A real stage process can be SIGKILLed between any two instructions: nothing of it runs any more
(no ``finally`` block, no cleanup), the kernel releases the ``flock`` locks it held, and what it
wrote so far stays where it is. The simulator models exactly that:

* :class:`SimProcesses` is the machine's process table (pids with start times, so a reused pid
  is a different process), the one :func:`runtime.connectors.namespaces.sweep` consults;
* :class:`ProcessStore` is one process's handle on a store: when the process dies, every lock it
  held is released and every later call through the handle raises :class:`ProcessDied`, so the
  ``finally`` blocks the simulator unwinds at the end of the run cannot touch the store either;
* the sim kernel freezes the process's tasks (:meth:`omnisim.sim_kernel.SimKernel.kill_process`).
"""

from __future__ import annotations

import itertools
import os
import struct
from collections.abc import Callable

import msgpack
import numpy as np
import xxhash

from runtime.connectors import ring as rings
from runtime.connectors.namespaces import Owner
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.ring import Ring
from runtime.connectors.stores import LockFile, MemoryStore, RingMemory, Segment, SegmentId, Store
from runtime.connectors.wire import ALIGN, COMMIT_MAGIC, EXT_NDARRAY, EXT_TENSOR, MAGIC, TRAILER, encode, frame_seed

SIM_PID_NAMESPACE = "sim"


class ProcessDied(BaseException):
    """A call made by a process that is dead. Not an Exception: no runtime code catches it."""


class SimProcesses:
    """The simulated machine's process table."""

    def __init__(self) -> None:
        self._live: dict[int, Owner] = {}
        self._pids = itertools.count(1000)
        self._ticks = itertools.count(1)

    def spawn(self, pid: int | None = None) -> Owner:
        """A new process; ``pid`` reuses a pid (a different process: a later start time)."""
        owner = Owner(next(self._pids) if pid is None else pid, next(self._ticks), SIM_PID_NAMESPACE)
        self._live[owner.pid] = owner
        return owner

    def kill(self, owner: Owner) -> None:
        if self._live.get(owner.pid) == owner:
            del self._live[owner.pid]

    def identity(self, pid: int) -> Owner | None:
        return self._live.get(pid)

    def pid_namespace(self) -> str:
        return SIM_PID_NAMESPACE

    def alive(self, owner: Owner) -> bool:
        return self._live.get(owner.pid) == owner


class _HeldLock:
    """A lock file opened through a process's handle, so the process's death releases it."""

    def __init__(self, handle: ProcessStore, lock: LockFile) -> None:
        self._handle = handle
        self._lock = lock

    def try_acquire(self) -> bool:
        self._handle.check()
        return self._lock.try_acquire()

    def is_current(self) -> bool:
        self._handle.check()
        return self._lock.is_current()

    def release(self) -> None:
        self._handle.check()
        self._lock.release()

    def close(self) -> None:
        self._handle.check()
        self._lock.close()
        self._handle.opened.discard(self)

    def drop(self) -> None:
        """What the kernel does for a dead process: the lock is released, the file stays."""
        self._lock.close()


class ProcessStore:
    """One simulated process's handle on a (shared) store; see the module docstring."""

    def __init__(self, store: Store, owner: Owner) -> None:
        self.store = store
        self.process = owner
        self.namespace = store.namespace
        self.dead = False
        self.opened: set[_HeldLock] = set()
        #: Every segment and ring this process opened: the kernel closes them when it dies.
        self.segments_opened: list[Segment | RingMemory] = []

    @property
    def spare_min_bytes(self) -> int:
        return self.store.spare_min_bytes

    def check(self) -> None:
        if self.dead:
            raise ProcessDied(f"process {self.process.pid} is dead")

    def die(self) -> None:
        self.dead = True
        for lock in list(self.opened):
            lock.drop()
        self.opened.clear()
        for segment in self.segments_opened:
            segment.close()
        self.segments_opened.clear()

    def create_segment(self, key: str) -> Segment:
        self.check()
        segment = self.store.create_segment(key)
        self.segments_opened.append(segment)
        return segment

    def open_segment(self, key: str) -> Segment | None:
        self.check()
        segment = self.store.open_segment(key)
        if segment is not None:
            self.segments_opened.append(segment)
        return segment

    def unlink_segment(self, key: str, *, only: SegmentId | None = None) -> bool:
        self.check()
        return self.store.unlink_segment(key, only=only)

    def segment_exists(self, key: str) -> bool:
        self.check()
        return self.store.segment_exists(key)

    def retire_segment(self, key: str) -> bool:
        self.check()
        return self.store.retire_segment(key)

    def spares(self) -> list[str]:
        return self.store.spares()

    def remove_spare(self, name: str) -> bool:
        self.check()
        return self.store.remove_spare(name)

    def open_lock(self, key: str, *, create: bool) -> LockFile | None:
        self.check()
        lock = self.store.open_lock(key, create=create)
        if lock is None:
            return None
        held = _HeldLock(self, lock)
        self.opened.add(held)
        return held

    def remove_lock(self, key: str) -> bool:
        self.check()
        return self.store.remove_lock(key)

    def create_ring(self, edge: str, capacity: int) -> RingMemory:
        self.check()
        ring = self.store.create_ring(edge, capacity)
        self.segments_opened.append(ring)
        return ring

    def open_ring(self, edge: str) -> RingMemory | None:
        self.check()
        ring = self.store.open_ring(edge)
        if ring is not None:
            self.segments_opened.append(ring)
        return ring

    def unlink_ring(self, edge: str, *, only: RingMemory | None = None) -> bool:
        self.check()
        return self.store.unlink_ring(edge, only=only)

    def rings(self) -> list[str]:
        return self.store.rings()

    def segments(self) -> list[str]:
        return self.store.segments()

    def lock_files(self) -> list[str]:
        return self.store.lock_files()

    def owner(self) -> Owner | None:
        return self.store.owner()

    def sweep(self) -> list[str]:
        return self.store.sweep()

    def open_handles(self) -> list[str]:
        return self.store.open_handles()


def _rewrite(store: Store, key: str, change: Callable[[bytes], bytes]) -> None:
    """Replace the bytes of segment ``key`` behind the runtime's back (what an attacker or a
    stray write does)."""
    if isinstance(store, MemoryStore):
        data = store._segments[key]
        new = change(bytes(data))
        if len(new) == len(data):
            data[:] = new  # in place: the writer may still hold a view of it
        else:
            store._segments[key] = bytearray(new)
        return
    if not isinstance(store, PosixStore):
        raise TypeError(f"cannot rewrite a segment of a {type(store).__name__}")
    fd = os.open(store.segment_path(key), os.O_RDWR | os.O_NOFOLLOW)
    try:
        new = change(os.pread(fd, os.fstat(fd).st_size, 0))
        os.ftruncate(fd, len(new))
        os.pwrite(fd, new, 0)
    finally:
        os.close(fd)


def _rewrite_ring_frame(store: Store, key: str, change: Callable[[bytes], bytes]) -> None:
    """Replace the payload of ``key``'s unread frame (committed, perhaps not yet published) on
    any of the store's rings, in place; a longer replacement is cut to the frame's room (corrupt
    all the same)."""
    for edge in store.rings():
        memory = store.open_ring(edge)
        ring = Ring.attach(memory) if memory is not None else None
        if ring is None:
            continue
        try:
            frame = next((f for f in ring.frames() if f.key == key and f.state in (rings.WRITING, rings.READY)), None)
            if frame is None:
                continue
            with ring.payload(frame) as old:
                new = change(bytes(old))[: frame.payload_len]
            ring.view[frame.payload_at : frame.payload_at + len(new)] = new
            at = rings.HEADER_SIZE + frame.pos % ring.data_size
            rings.FRAME.pack_into(ring.view, at, frame.state, len(frame.key), len(new), frame.span)
        finally:
            ring.close()


def _rewrite_chunk(store: Store, key: str, change: Callable[[bytes], bytes]) -> None:
    """Replace the bytes of ``key``'s unread chunk, in its segment or on a ring of the store."""
    if store.segment_exists(key):
        _rewrite(store, key, change)
    else:
        _rewrite_ring_frame(store, key, change)


def corrupt_segment(store: Store, key: str) -> None:
    """Flip one byte in the middle of ``key``'s chunk (bytes changed after their commit)."""

    def flip(data: bytes) -> bytes:
        if not data:
            return data
        out = bytearray(data)
        out[len(out) // 2] ^= 0xFF
        return bytes(out)

    _rewrite_chunk(store, key, flip)


#: How a forged frame lies about its buffers -> what the error of a reader that rejects it must
#: name. Each lie is one check of the decoder's to catch (the trailer and the checksum are valid
#: for the bytes a reader would take), and a reader that meets it deserves to be told which.
#: The first four lie about where the codes' bytes are; the others in the codes' reference
#: itself, which a reader that did not check it could not follow, or in the frame's prefix and
#: trailer.
FORGERIES = {
    "overlapping": "overlapping buffer references",
    "short_buffer": "needs 3200 bytes, got 3192",
    "past_the_end": "buffer reference past end of frame",
    "negative_offset": "bad buffer reference",
    "unknown_extension": "unknown extension type 99",
    "unreadable_reference": "bad extension payload",
    "unknown_array_dtype": "unknown ndarray dtype 'no_such_dtype'",
    "offset_not_a_number": "bad buffer reference",
    "reference_of_three": "bad extension payload shape",
    "unknown_tensor_dtype": "unknown tensor dtype 'no_such_dtype'",
    "object_array": "unsupported ndarray dtype 'O'",
    "negative_dimensions": "bad shape [-16, -25]",
    "trailer_length": "the commit trailer says",
    "uncommitted": "uncommitted frame",
    "bad_magic": "bad magic",
    "header_past_the_end": "runs past the end",
    "too_short": "frame too short",
    "header_not_msgpack": "corrupt header",
    "not_a_payload": "holds no stage payload",
    "empty_payload": "holds no stage payload",
}

_CODES_SHAPE = [16, 25]
#: A frame's prefix (magic and header length): ``too_short`` is no more than that.
_PREFIX_BYTES = 8


def _codes_reference(lie: str, at: int, nbytes: int) -> msgpack.ExtType:
    """The header's reference to the codes' ``nbytes`` at ``at``, as ``lie`` tells it."""
    if lie == "unknown_extension":
        return msgpack.ExtType(99, msgpack.packb(["int64", _CODES_SHAPE, at, nbytes]))
    if lie == "unreadable_reference":
        return msgpack.ExtType(EXT_TENSOR, b"\xc1")  # a byte msgpack never uses
    if lie == "unknown_array_dtype":
        return msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["no_such_dtype", _CODES_SHAPE, at, nbytes]))
    if lie == "offset_not_a_number":
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb(["int64", _CODES_SHAPE, str(at), nbytes]))
    if lie == "reference_of_three":
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb(["int64", _CODES_SHAPE, at]))
    if lie == "unknown_tensor_dtype":
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb(["no_such_dtype", _CODES_SHAPE, at, nbytes]))
    if lie == "object_array":  # (pointers: never to be made from bytes)
        return msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["O", _CODES_SHAPE, at, nbytes]))
    if lie == "negative_dimensions":  # (their product is the right count all the same)
        return msgpack.ExtType(EXT_TENSOR, msgpack.packb(["int64", [-d for d in _CODES_SHAPE], at, nbytes]))
    return msgpack.ExtType(EXT_TENSOR, msgpack.packb(["int64", _CODES_SHAPE, at, nbytes]))


def forge_segment(store: Store, key: str, lie: str = "overlapping") -> None:
    """Replace ``key``'s chunk by a forged frame (see :func:`forged_frame`)."""
    _rewrite_chunk(store, key, lambda _: forged_frame(lie, key))


def intact_forgery(lie: str) -> object | None:
    """What a forged frame that tells no lie about its bytes carries (``not_a_payload``,
    ``empty_payload``): a connector hands it out as any intact frame, and its taker must refuse
    it. None for the other lies, which no get hands out."""
    return {"not_a_payload": ["codes", 256], "empty_payload": {}}.get(lie)


def forged_frame(lie: str = "overlapping", key: str | None = None) -> bytes:
    """A frame of codes that were never sent, with a valid trailer and checksum (for ``key``),
    whose header
    lies about its buffers: ``overlapping``, the flags' one-byte buffers lie inside the codes'
    bytes; ``short_buffer``, the codes' buffer holds one value less than their shape needs;
    ``past_the_end``, the codes' buffer runs into the commit trailer; ``negative_offset``, it
    starts before the buffers, in the header; ``trailer_length``, the commit trailer says the
    frame is longer than it is; ``uncommitted``, its trailer has no commit magic; ``bad_magic``
    and ``header_past_the_end``, its prefix has a foreign magic or a header length past the
    frame's end; ``too_short``, it is a prefix and nothing more; ``header_not_msgpack``, its
    header is not msgpack; ``not_a_payload`` and ``empty_payload``, it is an intact frame, but of
    a list and of an empty dict, not of a stage payload; the others, the codes'
    reference names an extension type or a dtype that does not exist, an array of objects,
    negative dimensions, is not msgpack, gives its offset as a string, or has three fields, not
    four. The checksum covers what a reader that did not check the references would take: the
    head, then each buffer's bytes as its shape needs them, in the header's order."""
    intact = intact_forgery(lie)
    if intact is not None:
        return encode(intact, key)
    codes = np.full(_CODES_SHAPE, 256, dtype="<i8").tobytes()  # its first byte is 0: a flag read from it is False
    # Where the codes' and the flags' buffers are, from the start of the buffers; what the body holds there.
    if lie == "overlapping":
        codes_at, nbytes, flags_at, buffers = 0, len(codes), 0, codes
    elif lie == "short_buffer":
        nbytes = len(codes) - 8
        codes_at, flags_at, buffers = 0, nbytes, codes[:nbytes] + b"\0\0"
    elif lie == "past_the_end":  # the flags first, then codes whose last bytes would be the trailer's magic
        codes_at, nbytes, flags_at = ALIGN, len(codes), 0
        buffers = bytes(ALIGN) + codes[: -len(COMMIT_MAGIC)]
    elif lie == "negative_offset":
        codes_at, nbytes, flags_at, buffers = -ALIGN, len(codes), len(codes), codes + b"\0\0"
    else:
        codes_at, nbytes, flags_at, buffers = 0, len(codes), len(codes), codes + b"\0\0"
    flags = [msgpack.ExtType(EXT_TENSOR, msgpack.packb(["bool", [], flags_at + i, 1])) for i in range(2)]
    header = msgpack.packb(
        {
            "codes": {"audio": _codes_reference(lie, codes_at, nbytes)},
            "meta": {"finished": flags[0], "is_segment_finished": flags[1]},
        }
    )
    if lie == "too_short":
        return bytes(_PREFIX_BYTES)
    if lie == "header_not_msgpack":
        header = b"\xc1" + header[1:]  # a byte msgpack never uses, where the map begins
    header_len = len(header) + (1 << 20) if lie == "header_past_the_end" else len(header)
    prefix = struct.pack("<4sI", b"JUNK" if lie == "bad_magic" else MAGIC, header_len)
    base = (len(prefix) + len(header) + ALIGN - 1) // ALIGN * ALIGN
    body = (prefix + header).ljust(base, b"\0") + buffers
    # What a reader past the body's end meets first: the trailer's magic and its zero pad.
    whole = body + COMMIT_MAGIC + bytes(4)
    taken = [(base + codes_at, len(codes)), (base + flags_at, 1), (base + flags_at + 1, 1)]
    checksum = xxhash.xxh3_64_intdigest(
        prefix + header + b"".join(whole[at : at + n] for at, n in taken), seed=frame_seed(key, 0)
    )
    length = len(body) + ALIGN if lie == "trailer_length" else len(body)
    commit = bytes(len(COMMIT_MAGIC)) if lie == "uncommitted" else COMMIT_MAGIC
    return body + TRAILER.pack(commit, 0, checksum, length)
