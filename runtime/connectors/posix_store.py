"""PosixStore: segments are POSIX shared memory, lock files are ``fcntl.flock``'d files, both in
/dev/shm and both named ``omnisim-{namespace}-…`` so that runs never collide and every leftover is
attributable to the run that made it.

* segment of key K: ``/dev/shm/omnisim-{ns}-seg-K`` (``shm_open`` name ``/omnisim-{ns}-seg-K``)
* lock file of key K: ``/dev/shm/omnisim-{ns}-lock-K``

Both are created mode 0600. A segment is reserved with ``posix_fallocate`` before a byte is
written, so a full /dev/shm is a clean :class:`StoreFull` at create time; and segments are never
mapped (they are written with ``pwrite`` and read with ``preadv``), so no SIGBUS is possible.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets

import numpy as np
import posix_ipc

from runtime.connectors.keys import validate_key
from runtime.connectors.stores import StoreError, StoreFull
from runtime.connectors.wire import Buffer, WireDecodeError

SHM_DIR = "/dev/shm"
NAMESPACE_PATTERN = re.compile(r"[a-z0-9]{1,24}")


def new_namespace() -> str:
    """A fresh namespace: 12 lowercase hex characters."""
    return secrets.token_hex(6)


class _PosixSegment:
    """A segment used through its file descriptor: ``pwrite`` and ``preadv`` copy straight
    between the segment's pages and the caller's memory, with no mapping to fault in."""

    def __init__(self, key: str, fd: int, size: int) -> None:
        self._key = key
        self._fd = fd
        self.size = size

    def write(self, offset: int, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        while view:
            try:
                written = os.pwrite(self._fd, view, offset)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise StoreFull(self._key, self.size) from e
                raise StoreError(f"cannot write segment {self._key!r}: {e}") from e
            view = view[written:]
            offset += written

    def read_into(self, offset: int, out: np.ndarray) -> None:
        got = os.preadv(self._fd, [out], offset)
        if got != out.nbytes:
            raise WireDecodeError(f"segment {self._key!r} ended after {got} of {out.nbytes} bytes at {offset}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _PosixLock:
    def __init__(self, fd: int, path: str) -> None:
        self._fd: int | None = fd
        self._path = path
        self._held = False

    def is_current(self) -> bool:
        assert self._fd is not None
        try:
            named = os.stat(self._path, follow_symlinks=False)
        except FileNotFoundError:
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


class PosixStore:
    """Real /dev/shm storage under one namespace (shared by every process of one pipeline run)."""

    def __init__(self, namespace: str | None = None) -> None:
        namespace = namespace or new_namespace()
        if not NAMESPACE_PATTERN.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} must be 1-24 characters of [a-z0-9]")
        self.namespace = namespace
        self._seg_prefix = f"omnisim-{namespace}-seg-"
        self._lock_prefix = f"omnisim-{namespace}-lock-"

    def segment_path(self, key: str) -> str:
        return os.path.join(SHM_DIR, self._seg_prefix + validate_key(key))

    def lock_path(self, key: str) -> str:
        return os.path.join(SHM_DIR, self._lock_prefix + validate_key(key))

    def _shm_name(self, key: str) -> str:
        return "/" + self._seg_prefix + validate_key(key)

    def create_segment(self, key: str, size: int) -> _PosixSegment:
        name = self._shm_name(key)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
        except posix_ipc.ExistentialError:
            self.unlink_segment(key)
            try:
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600)
            except posix_ipc.Error as e:
                raise StoreError(f"cannot create segment {key!r}: {e}") from e
        except posix_ipc.Error as e:
            raise StoreError(f"cannot create segment {key!r}: {e}") from e
        fd = shm.fd
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            self.unlink_segment(key)
            if e.errno in (errno.ENOSPC, errno.EFBIG):
                raise StoreFull(key, size) from e
            raise StoreError(f"cannot reserve {size} bytes for segment {key!r}: {e}") from e
        return _PosixSegment(key, fd, size)

    def open_segment(self, key: str) -> _PosixSegment | None:
        try:
            shm = posix_ipc.SharedMemory(self._shm_name(key))
        except posix_ipc.Error:
            return None
        fd = shm.fd
        size = os.fstat(fd).st_size
        if size == 0:
            os.close(fd)
            return None
        return _PosixSegment(key, fd, size)

    def unlink_segment(self, key: str) -> bool:
        try:
            posix_ipc.unlink_shared_memory(self._shm_name(key))
        except posix_ipc.ExistentialError:
            return False
        return True

    def segment_exists(self, key: str) -> bool:
        return os.path.exists(self.segment_path(key))

    def open_lock(self, key: str, *, create: bool) -> _PosixLock | None:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        path = self.lock_path(key)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise StoreFull(key, 0) from e
            raise StoreError(f"cannot open lock file of {key!r}: {e}") from e
        return _PosixLock(fd, path)

    def remove_lock(self, key: str) -> bool:
        try:
            os.unlink(self.lock_path(key))
        except FileNotFoundError:
            return False
        return True

    def _listed(self, prefix: str) -> list[str]:
        return sorted(n[len(prefix) :] for n in os.listdir(SHM_DIR) if n.startswith(prefix))

    def segments(self) -> list[str]:
        return self._listed(self._seg_prefix)

    def lock_files(self) -> list[str]:
        return self._listed(self._lock_prefix)

    def sweep(self) -> list[str]:
        """Remove every name of this namespace in /dev/shm (files and the wakeup folder)."""
        removed = []
        stem = f"omnisim-{self.namespace}-"
        for name in sorted(os.listdir(SHM_DIR)):
            if not name.startswith(stem):
                continue
            path = os.path.join(SHM_DIR, name)
            if os.path.isdir(path) and not os.path.islink(path):
                for inner in os.listdir(path):
                    os.unlink(os.path.join(path, inner))
                os.rmdir(path)
            else:
                os.unlink(path)
            removed.append(name)
        return removed
