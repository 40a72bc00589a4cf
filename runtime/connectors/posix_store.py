"""PosixStore: segments are POSIX shared memory, lock files are ``flock``'d files, both in
/dev/shm and both named ``omnisim-{namespace}-…`` so that runs never collide and every leftover is
attributable to the run that made it.

* owner record: ``/dev/shm/omnisim-{ns}-owner`` (see :mod:`runtime.connectors.namespaces`),
  written before anything else of the namespace exists;
* segment of key K: ``/dev/shm/omnisim-{ns}-seg-K`` (``shm_open`` name ``/omnisim-{ns}-seg-K``);
* lock file of key K: ``/dev/shm/omnisim-{ns}-lock-K``.

Everything is created mode 0600 and only ever opened with ``O_NOFOLLOW``; an existing name that
is not ours — another user's, another mode, a symlink, a folder — is refused as
:class:`ForeignName`, never used, followed or removed. A segment is reserved with
``posix_fallocate`` before a byte is written, so a full /dev/shm is a clean :class:`StoreFull`;
and segments are never mapped (they are written with ``pwrite`` and read with ``preadv``), so no
SIGBUS is possible. Every ``OSError`` becomes a :class:`StoreError` naming the key and the cause.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import posix_ipc

from runtime.connectors.keys import InvalidKeyError, validate_key
from runtime.connectors.namespaces import OWNER_SUFFIX, SHM_DIR, Owner, ShmDirectory, current_owner, write_owner
from runtime.connectors.stores import ForeignName, OpenHandles, StoreError, StoreFull
from runtime.connectors.wire import Buffer, WireDecodeError

NAMESPACE_PATTERN = re.compile(r"[a-z0-9]{1,24}")
#: The only mode the store creates, and the only one it accepts on a name it opens.
MODE = 0o600
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


@contextmanager
def _translated(what: str, key: str) -> Iterator[None]:
    try:
        yield
    except InvalidKeyError:
        raise
    except posix_ipc.ExistentialError as e:
        raise StoreError(f"cannot {what} {key!r}: {e}") from None
    except posix_ipc.PermissionsError as e:
        raise ForeignName(f"cannot {what} {key!r}: {e}") from None
    except ValueError as e:  # posix_ipc's EINVAL: the name is something shm_open cannot open
        raise ForeignName(f"cannot {what} {key!r}: the name is not a shared memory object ({e})") from None
    except OSError as e:
        raise _store_error(what, key, e) from None


def _check_ours(fd: int, key: str, kind: str) -> None:
    """An opened name must be a regular file of this user with mode 0600."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != MODE:
        raise ForeignName(
            f"the {kind} of {key!r} is not ours (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): refused"
        )


class _PosixSegment:
    """A segment used through its file descriptor: ``pwrite`` and ``preadv`` copy straight
    between the segment's pages and the caller's memory, with no mapping to fault in."""

    def __init__(self, key: str, fd: int, size: int, on_close: Callable[[], None]) -> None:
        self._key = key
        self._fd = fd
        self.size = size
        self._on_close = on_close

    def reserve(self, size: int) -> None:
        try:
            os.posix_fallocate(self._fd, 0, size)
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

    def read_into(self, offset: int, out: np.ndarray) -> None:
        try:
            got = os.preadv(self._fd, [out], offset)
        except OSError as e:
            raise WireDecodeError(f"cannot read segment {self._key!r}: {e.strerror}") from None
        if got != out.nbytes:
            raise WireDecodeError(f"segment {self._key!r} ended after {got} of {out.nbytes} bytes at {offset}")

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
            named = os.stat(self._path, follow_symlinks=False)
        except OSError:
            return False
        mine = os.fstat(self._fd)
        return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)

    def try_acquire(self) -> bool:
        assert self._fd is not None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._held = True
        return True

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


class PosixStore:
    """Real /dev/shm storage under one namespace (shared by every process of one pipeline run).

    A store made without a namespace makes a fresh one and records this process as its owner;
    a store made with one attaches to an existing namespace (another process of the same run),
    unless ``claim`` says it is this process's to own (a stage process given its namespace).
    """

    def __init__(self, namespace: str | None = None, *, claim: bool | None = None, owner: Owner | None = None) -> None:
        claim = namespace is None if claim is None else claim
        namespace = namespace or new_namespace()
        if not NAMESPACE_PATTERN.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must be 1-24 characters of [a-z0-9]")
        self.namespace = namespace
        self._stem = f"omnisim-{namespace}-"
        self._seg_prefix = f"{self._stem}seg-"
        self._lock_prefix = f"{self._stem}lock-"
        self.owner_path = os.path.join(SHM_DIR, f"{self._stem}{OWNER_SUFFIX}")
        self.handles = OpenHandles()
        if claim:
            try:
                write_owner(self.owner_path, owner or current_owner())
            except OSError as e:
                raise _store_error("record the owner of namespace", namespace, e) from None

    def segment_path(self, key: str) -> str:
        return os.path.join(SHM_DIR, self._seg_prefix + validate_key(key))

    def lock_path(self, key: str) -> str:
        return os.path.join(SHM_DIR, self._lock_prefix + validate_key(key))

    def _shm_name(self, key: str) -> str:
        return "/" + self._seg_prefix + validate_key(key)

    def create_segment(self, key: str) -> _PosixSegment:
        name = self._shm_name(key)
        with _translated("create segment", key):
            try:
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=MODE)
            except posix_ipc.ExistentialError:
                self._unlink_own_segment(key)  # put replaces unread data of ours under the same key
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=MODE)
        return _PosixSegment(key, shm.fd, 0, self.handles.opened(f"segment {key}"))

    def _unlink_own_segment(self, key: str) -> None:
        path = self.segment_path(key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != MODE:
            raise ForeignName(f"cannot create segment {key!r}: its name is taken by something that is not ours")
        self.unlink_segment(key)

    def open_segment(self, key: str) -> _PosixSegment | None:
        with _translated("open segment", key):
            try:
                shm = posix_ipc.SharedMemory(self._shm_name(key))
            except posix_ipc.ExistentialError:
                return None
        fd = shm.fd
        try:
            _check_ours(fd, key, "segment")
            size = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return _PosixSegment(key, fd, size, self.handles.opened(f"segment {key}"))

    def unlink_segment(self, key: str) -> bool:
        with _translated("remove segment", key):
            try:
                posix_ipc.unlink_shared_memory(self._shm_name(key))
            except posix_ipc.ExistentialError:
                return False
        return True

    def segment_exists(self, key: str) -> bool:
        return os.path.lexists(self.segment_path(key))

    def open_lock(self, key: str, *, create: bool) -> _PosixLock | None:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        path = self.lock_path(key)
        try:
            fd = os.open(path, flags, MODE)
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

    def _listed(self, prefix: str) -> list[str]:
        return sorted(n[len(prefix) :] for n in os.listdir(SHM_DIR) if n.startswith(prefix))

    def segments(self) -> list[str]:
        return self._listed(self._seg_prefix)

    def lock_files(self) -> list[str]:
        return self._listed(self._lock_prefix)

    def owner(self) -> Owner | None:
        return ShmDirectory().read_owner(self.namespace)

    def open_handles(self) -> list[str]:
        return self.handles.names()

    def sweep(self) -> list[str]:
        """Remove every name of this namespace in /dev/shm (files, the wakeup folder, and the
        owner record last); names that are not ours are left alone."""
        directory = ShmDirectory()
        mine = [e for e in directory.entries() if e.namespace == self.namespace and e.ours]
        removed = []
        for entry in sorted(mine, key=lambda e: e.name.endswith(f"-{OWNER_SUFFIX}")):
            try:
                directory.remove(entry.name)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise _store_error("sweep", entry.name, e) from None
            removed.append(entry.name)
        return removed
