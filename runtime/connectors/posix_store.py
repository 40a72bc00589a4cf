"""PosixStore: segments are POSIX shared memory, lock files are ``flock``'d files, both in
/dev/shm (or another tmpfs folder given as ``directory``) and both named ``omnisim-{namespace}-…``
so that runs never collide and every leftover is attributable to the run that made it.

* owner record: ``/dev/shm/omnisim-{ns}-owner`` (see :mod:`runtime.connectors.namespaces`),
  written before anything else of the namespace exists;
* segment of key K: ``/dev/shm/omnisim-{ns}-seg-K`` (opened as ``shm_open`` does: the file of
  that name in /dev/shm, ``O_NOFOLLOW``);
* lock file of key K: ``/dev/shm/omnisim-{ns}-lock-K``;
* ring of edge E: ``/dev/shm/omnisim-{ns}-ring-E``;
* spare segment (see :mod:`runtime.connectors.stores`): ``/dev/shm/omnisim-{ns}-spare-K``, K the
  key it carried last; it is made by a link, which never replaces an existing name, so a spare a
  producer opened is never swapped for another under its name.

Everything is created mode 0600 and only ever opened with ``O_NOFOLLOW``; an existing name that
is not ours — another user's, another mode, a symlink, a folder — is refused as
:class:`ForeignName`, never used, followed or removed. A segment is reserved with
``posix_fallocate`` before a byte is written, so a full /dev/shm is a clean :class:`StoreFull`;
and segments are never mapped (they are written with ``pwrite`` and read with ``preadv``), so no
SIGBUS is possible; a spare is taken by renaming it onto the key's new segment, never mapped
either. A ring is mapped (its control words are read and written per chunk), but only
once ``posix_fallocate`` reserved every page of it: no write to it can fault for want of space.
Every ``OSError`` becomes a :class:`StoreError` naming the key and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import numpy as np

from runtime.connectors.keys import validate_key
from runtime.connectors.namespaces import OWNER_SUFFIX, SHM_DIR, Owner, ShmDirectory, current_owner, write_owner
from runtime.connectors.stores import (
    SPARE_MIN_BYTES,
    SPARES_KEPT,
    ForeignName,
    OpenHandles,
    RingMemory,
    SegmentId,
    SparseSegment,
    StoreError,
    StoreFull,
    choose_spare,
    next_generation,
    uncommitted_tail,
)
from runtime.connectors.wire import TRAILER, Buffer, BufferIO, WireDecodeError

NAMESPACE_PATTERN = re.compile(r"[a-z0-9]{1,24}")
#: The only mode the store creates, and the only one it accepts on a name it opens.
MODE = 0o600
_T = TypeVar("_T")
_REFUSED = (errno.ELOOP, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENXIO)


def new_namespace() -> str:
    """A fresh namespace: 12 lowercase hex characters."""
    return secrets.token_hex(6)


def _store_error(what: str, key: str, e: OSError) -> StoreError:
    """The one translation of an OS error into the store's errors."""
    if e.errno == errno.ENOSPC:
        return StoreFull(key, 0, inodes=True)
    if e.errno in _REFUSED:
        return ForeignName(f"cannot {what} {key!r}: the name is taken by something that is not ours ({e.strerror})")
    return StoreError(f"cannot {what} {key!r}: {e.strerror or e}")


def _reservation_error(what: str, key: str, size: int, e: OSError) -> StoreError:
    """A reservation of ``size`` bytes that failed: :class:`StoreFull` when the space ran out."""
    if e.errno in (errno.ENOSPC, errno.EFBIG):
        return StoreFull(key, size)
    return _store_error(what, key, e)


@contextmanager
def _translated(what: str, key: str) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise _store_error(what, key, e) from None


#: How every name of the store is opened: as ``shm_open`` opens it, never through a symlink.
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def _create(path: str) -> int:
    """Make ``path`` (mode 0600), which must not exist (:class:`FileExistsError`); its descriptor."""
    return os.open(path, _OPEN | os.O_CREAT | os.O_EXCL, MODE)


def _open_existing(path: str) -> int | None:
    """Open ``path``; None if nothing has that name."""
    try:
        return os.open(path, _OPEN)
    except FileNotFoundError:
        return None


def _unlink(path: str) -> bool:
    """Remove the name ``path``; False if nothing had it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _check_ours(fd: int, key: str, kind: str) -> os.stat_result:
    """An opened name must be a regular file of this user with mode 0600; its status."""
    with _translated(f"look at the {kind} of", key):
        st = os.fstat(fd)
    if not _ours(st):
        raise ForeignName(
            f"the {kind} of {key!r} is not ours (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): refused"
        )
    return st


def _ours(st: os.stat_result) -> bool:
    """A regular file of this user with mode 0600: what the store makes, and all it touches."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == MODE


def _is_ours(path: str, what: str) -> bool:
    """Whether ``path`` exists (ours to replace); :class:`ForeignName` if it is not ours."""
    return _own_status(path, what) is not None


def _own_status(path: str, what: str) -> os.stat_result | None:
    """The status of ``path`` if it exists and is ours; None if nothing has that name;
    :class:`ForeignName` if it is not ours."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not _ours(st):
        raise ForeignName(f"cannot create {what}: its name is taken by something that is not ours")
    return st


def _names_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def _try_flock(fd: int) -> bool:
    """Take ``fd``'s exclusive ``flock`` if nobody holds it; never waits."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class _PosixSegment:
    """A segment used through its file descriptor: ``pwrite`` and ``preadv`` copy straight
    between the segment's pages and the caller's memory, with no mapping to fault in."""

    def __init__(
        self,
        key: str,
        fd: int,
        size: int,
        on_close: Callable[[], None],
        store: PosixStore | None = None,
        identity: SegmentId | None = None,
    ) -> None:
        """``store``: where a new segment finds spares (none for an opened one); ``identity``:
        which file it is, if its opener knows (else it is asked when wanted)."""
        self._key = key
        self._fd = fd
        self.size = size
        self._on_close = on_close
        self._store = store
        self._identity = identity
        self.generation = 0

    @property
    def identity(self) -> SegmentId:
        if self._identity is None:
            with _translated("look at segment", self._key):
                st = os.fstat(self._fd)
            self._identity = st.st_dev, st.st_ino
        return self._identity

    def reserve(self, size: int) -> None:
        spare = self._store._take_spare(self._key, self._fd, size) if self._store is not None else None
        if spare is not None:
            os.close(self._fd)  # the empty segment it replaced under the key's name
            self._fd, self.generation = spare
            self._identity = None
            self.size = size
            return

        def allocate() -> None:
            os.posix_fallocate(self._fd, 0, size)

        try:
            self._store.with_room(allocate) if self._store is not None else allocate()
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG):
                raise StoreFull(self._key, size) from e
            raise StoreError(f"cannot reserve {size} bytes for segment {self._key!r}: {e.strerror}") from e
        self.size = size

    def write(self, offset: int, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                written = os.pwrite(self._fd, view, offset)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise StoreFull(self._key, self.size) from None
                raise StoreError(f"cannot write segment {self._key!r}: {e.strerror}") from None
            view = view[written:]
            offset += written

    def read(self, offset: int, nbytes: int) -> bytes:
        try:
            data = os.pread(self._fd, nbytes, offset)
        except OSError as e:
            raise self._read_failed(e) from None
        self._check_read(len(data), nbytes, offset)
        return data

    def read_into(self, offset: int, out: np.ndarray) -> None:
        try:
            got = os.preadv(self._fd, [out], offset)
        except OSError as e:
            raise self._read_failed(e) from None
        self._check_read(got, out.nbytes, offset)

    def _read_failed(self, e: OSError) -> WireDecodeError:
        return WireDecodeError(f"cannot read segment {self._key!r}: {e.strerror}")

    def _check_read(self, got: int, nbytes: int, offset: int) -> None:
        if got != nbytes:
            raise WireDecodeError(f"segment {self._key!r} ended after {got} of {nbytes} bytes at {offset}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._on_close()


class _PosixLock:
    def __init__(self, fd: int, path: str, on_close: Callable[[], None]) -> None:
        self._fd: int | None = fd
        self._path = path
        self._held = False
        self._on_close = on_close

    def is_current(self) -> bool:
        assert self._fd is not None
        try:
            return _names_file(self._path, self._fd)
        except OSError:
            return False

    def try_acquire(self) -> bool:
        assert self._fd is not None
        if self._held:
            return False  # ``flock`` would grant it again: another task of this process holds it
        self._held = _try_flock(self._fd)
        return self._held

    def release(self) -> None:
        if self._held and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._held = False

    def close(self) -> None:
        if self._fd is not None:
            self.release()
            os.close(self._fd)
            self._fd = None
            self._on_close()


class _PosixRing:
    """A mapped ring; its lock is ``flock`` on its own descriptor (released by the kernel when
    the process dies, so a holder killed mid-update never wedges the ring's other side)."""

    def __init__(self, fd: int, size: int, count: Callable[[], Callable[[], None]]) -> None:
        """Map ``size`` bytes of ``fd``; ``count`` counts the handle once the mapping exists and
        gives what uncounts it."""
        self._fd = fd
        self._held = False
        st = os.fstat(fd)
        self.identity: SegmentId = (st.st_dev, st.st_ino)
        self._map: mmap.mmap | None = mmap.mmap(fd, size)
        self._view: memoryview | None = memoryview(self._map)
        self._on_close = count()

    @property
    def view(self) -> memoryview:
        assert self._view is not None, "the ring was closed"
        return self._view

    @property
    def closed(self) -> bool:
        return self._map is None

    def truncated(self) -> bool:
        if self._map is None:
            return False
        try:
            return os.fstat(self._fd).st_size < len(self._map)
        except OSError:
            return True  # (its size cannot be told: its bytes cannot be vouched for)

    def try_lock(self) -> bool:
        if self._held or self._map is None:
            return False  # ``flock`` would grant it again: another task of this process holds it
        self._held = _try_flock(self._fd)
        return self._held

    def unlock(self) -> None:
        if self._held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._held = False

    def close(self) -> None:
        if self._map is None:
            return
        self.unlock()
        view, mapping = self._view, self._map
        self._map = self._view = None
        assert view is not None
        try:
            view.release()
            mapping.close()
        except BufferError:
            pass  # a task stopped mid-copy still holds a slice: the mapping goes when it does
        os.close(self._fd)
        self._on_close()


class PosixStore:
    """Real /dev/shm storage under one namespace (shared by every process of one pipeline run).

    A store made without a namespace makes a fresh one and records this process as its owner;
    a store made with one attaches to an existing namespace (another process of the same run),
    unless ``claim`` says it is this process's to own (a stage process given its namespace).
    ``directory``: the tmpfs folder that plays /dev/shm (a small private one fills up for real).
    """

    def __init__(
        self,
        namespace: str | None = None,
        *,
        claim: bool | None = None,
        owner: Owner | None = None,
        spare_min_bytes: int = SPARE_MIN_BYTES,
        directory: str = SHM_DIR,
    ) -> None:
        claim = not namespace if claim is None else claim  # (an empty one is none: a fresh one, ours)
        namespace = namespace or new_namespace()
        if not NAMESPACE_PATTERN.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must be 1-24 characters of [a-z0-9]")
        self.namespace = namespace
        self.directory = directory
        self._stem = f"omnisim-{namespace}-"
        self._seg_prefix = f"{self._stem}seg-"
        self._lock_prefix = f"{self._stem}lock-"
        self._ring_prefix = f"{self._stem}ring-"
        self._spare_prefix = f"{self._stem}spare-"
        self.spare_min_bytes = spare_min_bytes
        self.owner_path = self._path(OWNER_SUFFIX)
        self.handles = OpenHandles()
        if claim:
            try:
                write_owner(self.owner_path, owner or current_owner())
            except OSError as e:
                raise _store_error("record the owner of namespace", namespace, e) from None

    def _path(self, name: str) -> str:
        """The path of ``omnisim-{namespace}-{name}``."""
        return os.path.join(self.directory, self._stem + name)

    def segment_path(self, key: str) -> str:
        return self._path("seg-" + validate_key(key))

    def lock_path(self, key: str) -> str:
        return self._path("lock-" + validate_key(key))

    def ring_path(self, edge: str) -> str:
        return self._path("ring-" + validate_key(edge))

    def with_room(self, make: Callable[[], _T]) -> _T:
        """``make()``; if it ran out of room (ENOSPC: space or inodes) and the spares give way
        (a cache never costs room), ``make()`` once more without them."""
        try:
            return make()
        except OSError as e:
            if e.errno != errno.ENOSPC or not self._drop_spares():
                raise
        return make()

    def create_segment(self, key: str) -> _PosixSegment:
        path = self.segment_path(key)
        with _translated("create segment", key):
            try:
                fd = self.with_room(lambda: _create(path))
            except FileExistsError:
                self._unlink_own_segment(key)  # put replaces unread data of ours under the same key
                fd = self.with_room(lambda: _create(path))
        return _PosixSegment(key, fd, 0, self.handles.opened(f"segment {key}"), self)

    def _take_spare(self, key: str, created: int, size: int) -> tuple[int, int] | None:
        """A spare for ``key``'s new segment (open as ``created``), resized to ``size`` bytes,
        all backed, its commit trailer made uncommitted, then renamed onto the key's name: its descriptor,
        and the generation of its next frame. None if there is no spare to take, or the new
        segment lost its name meanwhile (a cleanup removed it: the put writes into nothing, as it
        would have)."""
        if size < self.spare_min_bytes:
            return None
        sizes = {}
        for name in self.spares():
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(self._spare_path(name))
                if _ours(st) and st.st_nlink == 1:  # (two names: its consumer died handing it back)
                    sizes[name] = st.st_size
        name = choose_spare(sizes, size)
        with _translated("reuse a spare for segment", key):
            if name is None or not _names_file(self.segment_path(key), created):
                return None
        # Only this process renames or removes a spare of its namespace, and no one replaces one:
        # the name opened here is the one renamed below.
        with _translated("reuse a spare for segment", key):
            try:
                fd = os.open(self._spare_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
        try:
            _check_ours(fd, key, "spare segment")
            held = sizes[name]
            generation = next_generation(BufferIO(os.pread(fd, TRAILER.size, max(0, held - TRAILER.size))))
            if size != held:
                os.ftruncate(fd, size)
            if size > held:  # the pages up to its old size exist: only the new ones are reserved
                os.posix_fallocate(fd, held, size - held)
            at, tail = uncommitted_tail(size, generation)
            os.pwrite(fd, tail, at)
            os.rename(self._spare_path(name), self.segment_path(key))
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EFBIG):
                return None  # too small to grow here: the put makes room as for a fresh segment
            if isinstance(e, OSError):
                raise _reservation_error("reuse a spare for segment", key, size, e) from None
            raise
        return fd, generation

    def _drop_spares(self) -> int:
        """Remove every spare of the namespace (a full /dev/shm: a cache gives way); how many."""
        dropped = 0
        for name in self.spares():
            with contextlib.suppress(StoreError):
                dropped += self.remove_spare(name)
        return dropped

    def _spare_path(self, name: str) -> str:
        return self._path("spare-" + name)

    def _unlink_own_segment(self, key: str) -> None:
        if _is_ours(self.segment_path(key), f"segment {key!r}"):
            self.unlink_segment(key)

    def open_segment(self, key: str) -> _PosixSegment | None:
        with _translated("open segment", key):
            fd = _open_existing(self.segment_path(key))
        if fd is None:
            return None
        try:
            st = _check_ours(fd, key, "segment")
            if st.st_blocks * 512 < st.st_size:
                # Every segment of ours is reserved whole before its first byte is written; a
                # sparse one would let its header claim memory the frame does not hold.
                raise SparseSegment(f"segment {key!r} is sparse ({st.st_blocks * 512} of {st.st_size} bytes reserved)")
        except BaseException:
            os.close(fd)
            raise
        opened = self.handles.opened(f"segment {key}")
        return _PosixSegment(key, fd, st.st_size, opened, identity=(st.st_dev, st.st_ino))

    def unlink_segment(self, key: str, *, only: SegmentId | None = None) -> bool:
        path = self.segment_path(key)
        with _translated("remove segment", key):
            # (a name that is not ours is refused: a cleanup of a key whose chunk went on the
            # ring looks here too, and must not take a stranger's file for the key's segment)
            st = _own_status(path, f"segment {key!r}")
            if st is None or (only is not None and (st.st_dev, st.st_ino) != only):
                return False
            return _unlink(path)

    def segment_exists(self, key: str) -> bool:
        return os.path.lexists(self.segment_path(key))

    def retire_segment(self, key: str) -> bool:
        # The caller holds the key's lock file, so no writer can give the name a new segment
        # meanwhile: until it is unlinked it names the segment the caller took, or nothing.
        path = self.segment_path(key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _store_error("remove segment", key, e) from None
        if _ours(st) and st.st_size >= self.spare_min_bytes and len(self.spares()) < SPARES_KEPT:
            # A link never replaces an existing spare (its producer may be taking it); a death
            # before the unlink below leaves two names on one file, which no put takes as a spare.
            try:
                os.link(path, self._spare_path(key), follow_symlinks=False)
            except (FileExistsError, FileNotFoundError):
                pass
            except OSError as e:
                # A tmpfs counts a link as an inode: with none left, the segment goes, unkept.
                if e.errno != errno.ENOSPC:
                    raise _store_error("keep as a spare", key, e) from None
        return self.unlink_segment(key)

    def spares(self) -> list[str]:
        return self._listed(self._spare_prefix)

    def remove_spare(self, name: str) -> bool:
        path = self._spare_path(name)
        try:
            if not _is_ours(path, f"spare {name!r}"):
                return False
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _store_error("remove the spare", name, e) from None
        return True

    def open_lock(self, key: str, *, create: bool) -> _PosixLock | None:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        path = self.lock_path(key)
        try:
            fd = self.with_room(lambda: os.open(path, flags, MODE))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _store_error("open the lock file of", key, e) from None
        try:
            _check_ours(fd, key, "lock file")
        except BaseException:
            os.close(fd)
            raise
        return _PosixLock(fd, path, self.handles.opened(f"lock {key}"))

    def remove_lock(self, key: str) -> bool:
        try:
            os.unlink(self.lock_path(key))
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _store_error("remove the lock file of", key, e) from None
        return True

    def create_ring(self, edge: str, capacity: int) -> _PosixRing:
        path = self.ring_path(edge)
        with _translated("create ring", edge):
            try:
                fd = self.with_room(lambda: _create(path))
            except FileExistsError:
                if _is_ours(path, f"ring {edge!r}"):
                    self.unlink_ring(edge)
                fd = self.with_room(lambda: _create(path))
        try:
            self.with_room(lambda: os.posix_fallocate(fd, 0, capacity))
            return _PosixRing(fd, capacity, lambda: self.handles.opened(f"ring {edge}"))
        except BaseException as e:
            os.close(fd)
            self.unlink_ring(edge)
            if isinstance(e, OSError):
                raise _reservation_error("reserve ring", edge, capacity, e) from None
            raise

    def open_ring(self, edge: str) -> _PosixRing | None:
        with _translated("open ring", edge):
            fd = _open_existing(self.ring_path(edge))
        if fd is None:
            return None
        try:
            size = _check_ours(fd, edge, "ring").st_size
            if size == 0:
                raise ForeignName(f"ring {edge!r} has no bytes yet: its maker is still reserving them")
            return _PosixRing(fd, size, lambda: self.handles.opened(f"ring {edge}"))
        except OSError as e:
            os.close(fd)
            raise _store_error("map ring", edge, e) from None
        except BaseException:
            os.close(fd)
            raise

    def unlink_ring(self, edge: str, *, only: RingMemory | None = None) -> bool:
        path = self.ring_path(edge)
        with _translated("remove ring", edge):
            if only is not None and (not isinstance(only, _PosixRing) or not _names_file(path, only._fd)):
                return False
            return _unlink(path)

    def rings(self) -> list[str]:
        return self._listed(self._ring_prefix)

    def _listed(self, prefix: str) -> list[str]:
        return sorted(n[len(prefix) :] for n in os.listdir(self.directory) if n.startswith(prefix))

    def segments(self) -> list[str]:
        return self._listed(self._seg_prefix)

    def lock_files(self) -> list[str]:
        return self._listed(self._lock_prefix)

    def owner(self) -> Owner | None:
        found = ShmDirectory(path=self.directory).read_owner(self.namespace)
        return found if isinstance(found, Owner) else None

    def open_handles(self) -> list[str]:
        return self.handles.names()

    def sweep(self) -> list[str]:
        """Remove every name of this namespace in /dev/shm (files, the wakeup folder, and the
        owner record last); names that are not ours are left alone. It looks twice: a consumer
        may hand back a segment it was reading as a spare after the first look (see
        :func:`runtime.connectors.namespaces.sweep`)."""
        directory = ShmDirectory(path=self.directory)
        removed = []
        for _ in range(2):
            mine = [e for e in directory.entries() if e.namespace == self.namespace and e.ours]
            for entry in sorted(mine, key=lambda e: e.name.endswith(f"-{OWNER_SUFFIX}")):
                try:
                    directory.remove(entry.name)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    if e.errno == errno.ENOTEMPTY:
                        continue  # a folder holding names that are not ours: left alone with them
                    raise _store_error("sweep", entry.name, e) from None
                removed.append(entry.name)
        return removed
