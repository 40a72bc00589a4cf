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

from runtime.connectors.namespaces import Owner
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.stores import LockFile, MemoryStore, Segment, Store
from runtime.connectors.wire import ALIGN, COMMIT_MAGIC, EXT_TENSOR, MAGIC, TRAILER

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
        self.owner = owner
        self.namespace = store.namespace
        self.dead = False
        self.opened: set[_HeldLock] = set()
        #: Every segment this process opened: the kernel closes them when it dies.
        self.segments_opened: list[Segment] = []

    def check(self) -> None:
        if self.dead:
            raise ProcessDied(f"process {self.owner.pid} is dead")

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

    def unlink_segment(self, key: str) -> bool:
        self.check()
        return self.store.unlink_segment(key)

    def segment_exists(self, key: str) -> bool:
        self.check()
        return self.store.segment_exists(key)

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


def corrupt_segment(store: Store, key: str) -> None:
    """Flip one byte in the middle of segment ``key`` (bytes changed after their commit)."""

    def flip(data: bytes) -> bytes:
        if not data:
            return data
        out = bytearray(data)
        out[len(out) // 2] ^= 0xFF
        return bytes(out)

    _rewrite(store, key, flip)


def forge_segment(store: Store, key: str) -> None:
    """Replace segment ``key`` by a forged frame: trailer and checksum valid, codes that were
    never sent, and the flags' one-byte buffers lying inside the codes' bytes (overlapping
    buffer references, which a decoder must refuse)."""
    _rewrite(store, key, lambda _: forged_frame())


def forged_frame() -> bytes:
    codes = np.full((16, 25), 256, dtype="<i8")  # its first byte is 0: the flags read False
    flag = msgpack.ExtType(EXT_TENSOR, msgpack.packb(["bool", [], 0, 1]))
    header = msgpack.packb(
        {
            "codes": {"audio": msgpack.ExtType(EXT_TENSOR, msgpack.packb(["int64", [16, 25], 0, codes.nbytes]))},
            "meta": {"finished": flag, "is_segment_finished": flag},
        }
    )
    prefix = struct.pack("<4sI", MAGIC, len(header))
    base = (len(prefix) + len(header) + ALIGN - 1) // ALIGN * ALIGN
    body = (prefix + header).ljust(base, b"\0") + codes.tobytes()
    raw = codes.tobytes()
    # The checksum a reader computes: the head, then each buffer in the header's order.
    checksum = xxhash.xxh3_64_intdigest(prefix + header + raw + raw[:1] + raw[:1])
    return body + TRAILER.pack(COMMIT_MAGIC, 0, checksum, len(body))
