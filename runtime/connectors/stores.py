"""Where segments and their lock files live: the store interface and the in-memory store.

A *store* is the file system underneath a shared-memory connector: named byte segments, named
lock files and named rings (one per stage edge, see :mod:`runtime.connectors.ring`), all scoped
to a namespace whose owner is recorded. :class:`PosixStore
<runtime.connectors.posix_store.PosixStore>` is the real one (POSIX shared memory plus ``flock``'d
lock files under /dev/shm); :class:`MemoryStore` keeps the same semantics in dictionaries, so a
simulated run explores thousands of schedules a second without touching the OS.

A segment a consumer took does not have to die with its name: :meth:`Store.retire_segment` keeps
a large one as a *spare* of its namespace, and the producer's next put of about that size takes
it instead of a fresh one, so the put writes into pages that already exist instead of paying for
new ones (a third of a fresh segment's time; ``omnisim bench pages``). A spare is a name of the
producer's namespace like any other — at most :data:`SPARES_KEPT` of them, removed by the
producer's ``close`` and by a sweep of its namespace — and it never looks like a chunk: before it
takes a key's name its commit trailer is zeroed, so a writer that dies after the rename leaves an
uncommitted frame, never the frame the spare held before.

Every failure of the file system is a :class:`StoreError` (never a raw ``OSError``): a full store
is :class:`StoreFull`, a name that is not ours (another user's, a symlink, the wrong kind of file)
is :class:`ForeignName`.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from runtime.connectors.namespaces import SPARES_KEPT, Owner
from runtime.connectors.wire import GENERATIONS, TRAILER, Buffer, BufferIO, FrameIO, read_trailer

#: Segments from this size on are kept as spares once consumed (a smaller one is cheap to make).
SPARE_MIN_BYTES = 1 << 20


def choose_spare(sizes: dict[str, int], size: int) -> str | None:
    """The spare a segment of ``size`` bytes takes: the smallest that holds it (its extra pages
    are given back), else the largest (the fewest new pages to add); None if there is none."""
    if not sizes:
        return None
    fitting = [name for name, n in sizes.items() if n >= size]
    if fitting:
        return min(fitting, key=lambda name: (sizes[name], name))
    return max(sizes, key=lambda name: (sizes[name], name))


def next_generation(spare: FrameIO) -> int:
    """The generation of the next frame in ``spare``, a reused segment (read before it is
    resized): one more than its trailer's, committed or not. A reused segment's trailer holds its
    new generation from the moment it is taken (:func:`uncommitted_tail`), so a writer that died
    before its commit has used its number up all the same."""
    trailer = read_trailer(spare)
    return 0 if trailer is None else (trailer[1] + 1) % GENERATIONS


def uncommitted_tail(size: int, generation: int) -> tuple[int, bytes]:
    """Where a reused segment of ``size`` bytes gets its trailer before it takes a key's name, and
    that trailer: uncommitted (no magic, no checksum: it reads as uncommitted until its writer
    commits the new frame), holding the ``generation`` that writer will commit."""
    return max(0, size - TRAILER.size), TRAILER.pack(bytes(4), generation, 0, 0)[: min(size, TRAILER.size)]


class StoreError(Exception):
    """A storage operation failed; a put that meets one reports failure and leaves nothing behind."""


class StoreFull(StoreError):
    """No room left (ENOSPC: space, or inodes). Raised before a byte is written, never a SIGBUS."""

    def __init__(self, key: str, size: int, *, inodes: bool = False) -> None:
        what = "no inodes left in the store" if inodes else f"no space left for {size} bytes"
        super().__init__(f"/dev/shm is full: {what} (segment {key!r}, {errno.errorcode[errno.ENOSPC]})")


class ForeignName(StoreError):
    """A name the store would use is taken by something that is not ours: refused, never used,
    followed or removed."""


class SparseSegment(StoreError):
    """A segment of ours with a hole in it: no put of ours leaves one (each reserves every byte
    before the first is written), so what it holds is a corrupt chunk."""


#: Which file a segment is (a device and an inode number, as ``stat`` gives them): a key's name
#: may later hold another segment, of another put, and a cleanup must be able to tell.
SegmentId = tuple[int, int]


class Segment(FrameIO, Protocol):
    """An open segment: positional writes (a created one) and reads (an opened one)."""

    @property
    def identity(self) -> SegmentId:
        """Which file this is (once reserved: a spare taken then is another file)."""
        ...

    @property
    def generation(self) -> int:
        """The generation its frame commits (once reserved): 0 in a new file, one more than the
        last frame's in a reused spare (which keeps its identity)."""
        ...

    def reserve(self, size: int) -> None:
        """Give a new segment exactly ``size`` bytes, all backed now (StoreFull if they are not):
        a spare's when one is there (its stale commit trailer made uncommitted), else fresh ones."""
        ...

    def close(self) -> None: ...


class LockFile(Protocol):
    """An open lock file: an exclusive, non-blocking advisory lock."""

    def try_acquire(self) -> bool: ...

    def is_current(self) -> bool:
        """True while this open lock file is still the one its name refers to."""
        ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class RingMemory(Protocol):
    """The shared bytes of one ring, reserved in full when it was made (a write to them can
    never fault for want of space), and the lock that guards its control words. The lock is only
    ever tried (a waiter backs off through the kernel); it excludes other processes and, per
    handle, other tasks of this one; a process's death releases it."""

    @property
    def view(self) -> memoryview:
        """The ring's bytes, writable (valid until :meth:`close`)."""
        ...

    @property
    def identity(self) -> SegmentId:
        """Which file this is (a ring made again under the same name is another)."""
        ...

    @property
    def closed(self) -> bool: ...

    def try_lock(self) -> bool: ...

    def unlock(self) -> None: ...

    def truncated(self) -> bool:
        """Whether the ring's file is shorter than these bytes now (cut by a process outside the
        protocol): the bytes past its end must not be touched."""
        ...

    def close(self) -> None:
        """Release the lock if held and let go of the bytes (what a process's death does too)."""
        ...


class Store(Protocol):
    namespace: str
    #: Consumed segments of at least this many bytes are kept as spares.
    spare_min_bytes: int

    def create_segment(self, key: str) -> Segment:
        """Create segment ``key``, empty, replacing one of ours of the same name."""
        ...

    def open_segment(self, key: str) -> Segment | None:
        """Open an existing segment (of any size, 0 included); None if there is none."""
        ...

    def unlink_segment(self, key: str, *, only: SegmentId | None = None) -> bool:
        """Remove segment ``key``; with ``only``, only while the name holds that segment (a
        later put's segment of the same name stays). True only if this call removed it."""
        ...

    def retire_segment(self, key: str) -> bool:
        """A consumer took segment ``key``'s bytes and holds its lock file: the name goes, and
        the segment is kept as a spare if it is large enough and the namespace has room for one
        (removed otherwise). True only if this call took the name away."""
        ...

    def spares(self) -> list[str]:
        """Names of this namespace's spare segments (each the key it carried last), sorted."""
        ...

    def remove_spare(self, name: str) -> bool:
        """Remove the spare ``name``; True only if this call removed it."""
        ...

    def segment_exists(self, key: str) -> bool: ...

    def open_lock(self, key: str, *, create: bool) -> LockFile | None:
        """Open (or create, mode 0600) the lock file of ``key``; None if missing and not created."""
        ...

    def remove_lock(self, key: str) -> bool: ...

    def create_ring(self, edge: str, capacity: int) -> RingMemory:
        """Make the ring ``edge`` (a valid key), ``capacity`` zero bytes reserved in full,
        replacing one of ours of the same name; :class:`StoreFull` if there is no room."""
        ...

    def open_ring(self, edge: str) -> RingMemory | None:
        """The existing ring ``edge``; None if there is none."""
        ...

    def unlink_ring(self, edge: str, *, only: RingMemory | None = None) -> bool:
        """Remove the ring ``edge``'s name; with ``only``, only while the name is that open ring's
        (a successor's ring of the same name stays). True only if this call removed it."""
        ...

    def rings(self) -> list[str]: ...

    def segments(self) -> list[str]:
        """Keys of every segment of this namespace, sorted."""
        ...

    def lock_files(self) -> list[str]:
        """Keys of every lock file of this namespace, sorted."""
        ...

    def owner(self) -> Owner | None:
        """The namespace's recorded owner."""
        ...

    def sweep(self) -> list[str]:
        """Remove everything this namespace holds, owner record last; the names removed."""
        ...

    def open_handles(self) -> list[str]:
        """The segments and lock files opened through this store and not closed yet, one
        ``segment KEY`` or ``lock KEY`` per handle: each keeps a file descriptor (and a removed
        segment's memory) for as long as the process lives."""
        ...


class OpenHandles:
    """The handles a store gave out that are not closed yet."""

    def __init__(self) -> None:
        self._open: Counter[str] = Counter()

    def opened(self, name: str) -> Callable[[], None]:
        """Count a handle on ``name``; the returned function uncounts it, once however often called."""
        self._open[name] += 1
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                self._open[name] -= 1
                if not self._open[name]:
                    del self._open[name]

        return close

    def names(self) -> list[str]:
        return sorted(self._open.elements())


def _bytes_of(file: object) -> int:
    """The bytes a file of the store holds: a segment's, a ring's, or none (a lock file)."""
    if isinstance(file, bytearray):
        return len(file)
    return len(file.data) if isinstance(file, _RingInode) else 0


class _LockInode:
    """One lock file; its lock belongs to the file, not to the name."""

    held = False


class _MemLock:
    def __init__(self, store: MemoryStore, key: str, inode: _LockInode, on_close: Callable[[], None]) -> None:
        self._store = store
        self._key = key
        self._inode = inode
        self._held = False
        self._on_close = on_close

    def is_current(self) -> bool:
        return self._store._locks.get(self._key) is self._inode

    def try_acquire(self) -> bool:
        if self._inode.held:
            return False
        self._inode.held = self._held = True
        return True

    def release(self) -> None:
        if self._held:
            self._inode.held = self._held = False

    def close(self) -> None:
        self.release()
        self._on_close()


class _MemReader(BufferIO):
    """An opened segment in memory: read-only, counted until it is closed."""

    def __init__(self, data: Buffer, identity: SegmentId, on_close: Callable[[], None]) -> None:
        super().__init__(data)
        self.identity = identity
        self._on_close = on_close

    def close(self) -> None:
        super().close()
        self._on_close()


class _MemSegment(_MemReader):
    """A segment in memory; a created one grows to its size once, as ``posix_fallocate`` does."""

    def __init__(
        self, store: MemoryStore, key: str, data: bytearray, identity: SegmentId, on_close: Callable[[], None]
    ) -> None:
        super().__init__(data, identity, on_close)
        self._store = store
        self._key = key
        self._data = data
        self.generation = 0

    def reserve(self, size: int) -> None:
        spare = self._store._take_spare(self._key, self._data, size)
        if spare is None and not self._store._make_room(size):
            raise StoreFull(self._key, size)
        self._view.release()  # a bytearray cannot grow while a view of it is held
        if spare is None:
            self._data.extend(bytes(size))
        else:
            # The spare is open now, and the empty file it replaced under the key's name is closed.
            self._on_close()
            self._data, self.generation = spare
            self._on_close = self._store._opened(f"segment {self._key}", self._data)
            self.identity = self._store._identities[self._key]
        self._view = memoryview(self._data).cast("B")


class _RingInode:
    def __init__(self, capacity: int, identity: SegmentId) -> None:
        self.data = bytearray(capacity)
        self.identity = identity
        self.held = False


class _MemRing:
    """A ring in memory; its lock, like ``flock``, belongs to the open ring, not to the name."""

    def __init__(self, inode: _RingInode, on_close: Callable[[], None]) -> None:
        self._inode = inode
        self._held = False
        self._on_close = on_close
        self._view: memoryview | None = memoryview(inode.data)

    @property
    def view(self) -> memoryview:
        assert self._view is not None, "the ring was closed"
        return self._view

    @property
    def identity(self) -> SegmentId:
        return self._inode.identity

    def truncated(self) -> bool:
        return False  # (a simulated ring's bytes are never cut: its stray writes change them)

    @property
    def closed(self) -> bool:
        return self._view is None

    def try_lock(self) -> bool:
        if self._inode.held or self._view is None:
            return False
        self._inode.held = self._held = True
        return True

    def unlock(self) -> None:
        if self._held:
            self._inode.held = self._held = False

    def close(self) -> None:
        if self._view is not None:
            self.unlock()
            view, self._view = self._view, None
            with contextlib.suppress(BufferError):  # a task stopped mid-copy still holds a slice
                view.release()
            self._on_close()


class MemoryStore:
    """Segments and lock files in dictionaries; ``capacity`` bytes in all and ``max_names``
    names (a tmpfs's size and inode count; None: unbounded). Space is counted in whole pages of
    ``page`` bytes, as a tmpfs counts it (a 1-byte file holds a page), the owner record's page
    included; a ``page`` of 1 counts bytes.

    A lock held through a lock file whose name was removed stays with that open file, as with
    ``flock`` on an unlinked inode; a new lock file of the same name is a new lock. A file whose
    name was removed keeps its room (its name and its pages) until its last handle is closed.
    """

    def __init__(
        self,
        namespace: str = "mem",
        capacity: int | None = None,
        owner: Owner | None = None,
        *,
        spare_min_bytes: int = SPARE_MIN_BYTES,
        max_names: int | None = None,
        page: int = 1,
    ) -> None:
        self.namespace = namespace
        self.capacity = capacity
        self.max_names = max_names
        self.page = page
        self.spare_min_bytes = spare_min_bytes
        self._owner = owner
        self._segments: dict[str, bytearray] = {}
        #: What each segment's name holds, as a ``stat`` would tell it: a new number per file (a
        #: spare renamed onto a key keeps its own).
        self._identities: dict[str, SegmentId] = {}
        self._inode_numbers = itertools.count(1)
        #: Spares by name (the key each carried last): the file, and which file it is (a rename
        #: keeps that).
        self._spares: dict[str, tuple[bytearray, SegmentId]] = {}
        self._locks: dict[str, _LockInode] = {}
        self._rings: dict[str, _RingInode] = {}
        self.handles = OpenHandles()
        #: The files with handles open on them, by identity: (the file, how many handles).
        self._open_files: dict[int, tuple[object, int]] = {}

    def used(self) -> int:
        spares = (data for data, _ in self._spares.values())
        files = itertools.chain(self._segments.values(), spares, self._rings.values(), self._unnamed())
        owner = len(self._owner.to_json()) if self._owner is not None else 0
        return sum(self._pages(_bytes_of(f)) for f in files) + self._pages(owner)

    def _opened(self, name: str, file: object) -> Callable[[], None]:
        """Count a handle on ``file`` (named ``name`` when opened); the returned function
        uncounts it, once however often called."""
        uncount = self.handles.opened(name)
        held, count = self._open_files.get(id(file), (file, 0))
        self._open_files[id(file)] = (held, count + 1)
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                uncount()
                held, count = self._open_files[id(file)]
                if count == 1:
                    del self._open_files[id(file)]
                else:
                    self._open_files[id(file)] = (held, count - 1)

        return close

    def _unnamed(self) -> list[object]:
        """The open files whose names were removed: each still holds its room."""
        named = {id(f) for f in (*self._segments.values(), *(data for data, _ in self._spares.values()))}
        named |= {id(f) for f in (*self._locks.values(), *self._rings.values())}
        return [f for i, (f, _) in self._open_files.items() if i not in named]

    def _pages(self, size: int) -> int:
        """The room ``size`` bytes of one file take: whole pages."""
        return -(-size // self.page) * self.page

    def _name_made(self, key: str) -> None:
        """Room for one more name, once the spares gave way if they must; else :class:`StoreFull`
        (no inodes left)."""
        if self.max_names is None:
            return
        if self.names_used() >= self.max_names:
            self._drop_spares()
        if self.names_used() >= self.max_names:
            raise StoreFull(key, 0, inodes=True)

    def names_used(self) -> int:
        """The names in use: an inode each on a tmpfs, the owner record's included."""
        owner = 1 if self._owner is not None else 0
        named = len(self._segments) + len(self._spares) + len(self._locks) + len(self._rings)
        return named + owner + len(self._unnamed())

    def create_segment(self, key: str) -> _MemSegment:
        if key not in self._segments:
            self._name_made(key)
        data = self._segments[key] = bytearray()  # replaced, as a POSIX create unlinks the old name first
        return _MemSegment(self, key, data, self._named(key), self._opened(f"segment {key}", data))

    def _named(self, key: str) -> SegmentId:
        """The identity of the new file the name ``key`` holds from now on."""
        identity = self._identities[key] = (0, next(self._inode_numbers))
        return identity

    def open_segment(self, key: str) -> _MemReader | None:
        data = self._segments.get(key)
        if data is None:
            return None
        return _MemReader(memoryview(data).toreadonly(), self._identities[key], self._opened(f"segment {key}", data))

    def unlink_segment(self, key: str, *, only: SegmentId | None = None) -> bool:
        if key not in self._segments or (only is not None and self._identities[key] != only):
            return False
        del self._segments[key], self._identities[key]
        return True

    def segment_exists(self, key: str) -> bool:
        return key in self._segments

    def retire_segment(self, key: str) -> bool:
        data = self._segments.pop(key, None)
        if data is None:
            return False
        identity = self._identities.pop(key)
        # (a link: it never replaces a spare of that name, and on a tmpfs it takes a name of its own
        # until the key's is gone, so with no name left the segment goes, unkept)
        has_name = self.max_names is None or self.names_used() + 1 < self.max_names
        kept = len(data) >= self.spare_min_bytes and len(self._spares) < SPARES_KEPT and has_name
        if kept:
            self._spares.setdefault(key, (data, identity))
        return True

    def _take_spare(self, key: str, created: bytearray, size: int) -> tuple[bytearray, int] | None:
        """What a reserve does with a spare in /dev/shm (see ``PosixStore._take_spare``): resize
        it, make its commit trailer uncommitted, rename it onto ``key``'s new segment ``created`` — unless
        that segment lost its name meanwhile (a cleanup: the put then writes into nothing, as it
        would have). The spare's old bytes stay where the new frame does not overwrite them, as
        in a real segment, and it stays the same file. The spare and its next generation; None if
        there is none to take."""
        if size < self.spare_min_bytes or self._segments.get(key) is not created:
            return None
        name = choose_spare({n: len(d) for n, (d, _) in self._spares.items()}, size)
        if name is None:
            return None
        old, identity = self._spares[name]
        if self.capacity is not None and self.used() + self._pages(size) - self._pages(len(old)) > self.capacity:
            return None  # too small to grow here: the put makes room as for a fresh segment
        generation = next_generation(BufferIO(old))
        data = bytearray(old[:size]) + bytes(max(0, size - len(old)))  # (a copy: a dead reader may hold a view)
        at, tail = uncommitted_tail(size, generation)
        data[at : at + len(tail)] = tail
        del self._spares[name]
        self._segments[key] = data
        self._identities[key] = identity
        return data, generation

    def _make_room(self, size: int) -> bool:
        """Whether ``size`` more bytes fit, once the spares gave way if they must (as a full
        /dev/shm makes them)."""
        if self.capacity is None or self.used() + self._pages(size) <= self.capacity:
            return True
        self._drop_spares()
        return self.used() + self._pages(size) <= self.capacity

    def _drop_spares(self) -> int:
        """Remove every spare (the store is full: a cache gives way); how many."""
        dropped = len(self._spares)
        self._spares.clear()
        return dropped

    def spares(self) -> list[str]:
        return sorted(self._spares)

    def remove_spare(self, name: str) -> bool:
        return self._spares.pop(name, None) is not None

    def open_lock(self, key: str, *, create: bool) -> _MemLock | None:
        inode = self._locks.get(key)
        if inode is None:
            if not create:
                return None
            self._name_made(key)
            inode = self._locks[key] = _LockInode()
        return _MemLock(self, key, inode, self._opened(f"lock {key}", inode))

    def remove_lock(self, key: str) -> bool:
        return self._locks.pop(key, None) is not None

    def create_ring(self, edge: str, capacity: int) -> _MemRing:
        self._rings.pop(edge, None)
        self._name_made(edge)
        if not self._make_room(capacity):
            raise StoreFull(edge, capacity)
        inode = self._rings[edge] = _RingInode(capacity, (0, next(self._inode_numbers)))
        return _MemRing(inode, self._opened(f"ring {edge}", inode))

    def open_ring(self, edge: str) -> _MemRing | None:
        inode = self._rings.get(edge)
        return None if inode is None else _MemRing(inode, self._opened(f"ring {edge}", inode))

    def unlink_ring(self, edge: str, *, only: RingMemory | None = None) -> bool:
        if only is not None and (not isinstance(only, _MemRing) or self._rings.get(edge) is not only._inode):
            return False
        return self._rings.pop(edge, None) is not None

    def rings(self) -> list[str]:
        return sorted(self._rings)

    def segments(self) -> list[str]:
        return sorted(self._segments)

    def lock_files(self) -> list[str]:
        return sorted(self._locks)

    def owner(self) -> Owner | None:
        return self._owner

    def open_handles(self) -> list[str]:
        return self.handles.names()

    def sweep(self) -> list[str]:
        removed = [f"segment {k}" for k in self.segments()] + [f"lock {k}" for k in self.lock_files()]
        removed += [f"ring {k}" for k in self.rings()] + [f"spare {k}" for k in self.spares()]
        self._segments.clear()
        self._identities.clear()
        self._spares.clear()
        self._locks.clear()
        self._rings.clear()
        if self._owner is not None:
            removed.append("owner")
            self._owner = None
        return removed
