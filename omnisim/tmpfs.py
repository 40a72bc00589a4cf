"""A small private tmpfs: a /dev/shm that fills up for real.

A scenario about a full /dev/shm should meet the kernel's own ENOSPC — for space from
``posix_fallocate``, for inodes from ``open(O_CREAT)`` — not an exception the harness raises
above the store, or the store's own translation of those errors goes unchecked. The machine's
/dev/shm cannot be filled for one run (every other process shares it), so such a world gets a
tmpfs of its own, mounted under the temporary folder with the size and inode count it asks for,
and unmounted at the end of the run. Mounting needs the right to (root, or CAP_SYS_ADMIN):
:func:`why_unavailable` says what is missing where it is not there. A harness killed mid-run
leaves its mount behind; its name carries the harness's pid, so the next harness to look
unmounts the mounts of dead ones (:func:`reclaim_stale`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import tempfile

_libc = ctypes.CDLL(None, use_errno=True)
#: ``umount2``'s flag: detach now, even with a descriptor still open on it (a killed run's).
_MNT_DETACH = 2


def mount(size: int, inodes: int) -> str:
    """A fresh tmpfs of ``size`` bytes and ``inodes`` inodes (its root folder is one), mode 1777
    as /dev/shm; its path. :class:`OSError` if it cannot be mounted here."""
    path = tempfile.mkdtemp(prefix=f"omnisim-tmpfs-{os.getpid()}-")
    options = f"size={size},nr_inodes={inodes},mode=1777".encode()
    if _libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, options) != 0:
        code = ctypes.get_errno()
        os.rmdir(path)
        raise OSError(code, f"cannot mount a tmpfs at {path}: {os.strerror(code)}")
    return path


def unmount(path: str) -> None:
    """Unmount the tmpfs at ``path`` (what it holds goes with it) and remove the folder."""
    if _libc.umount2(path.encode(), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"cannot unmount the tmpfs at {path}: {os.strerror(code)}")
    os.rmdir(path)


def reclaim_stale() -> list[str]:
    """Unmount the private tmpfs mounts that harnesses no longer alive left; their paths."""
    mine = re.compile(re.escape(os.path.join(tempfile.gettempdir(), "omnisim-tmpfs-")) + r"(\d+)-\w+")
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f]
    stale = []
    for path in mounts:
        found = mine.fullmatch(path)
        if found is not None and not os.path.exists(f"/proc/{found[1]}"):
            unmount(path)
            stale.append(path)
    return stale


@functools.cache
def why_unavailable() -> str | None:
    """Why no private tmpfs can be mounted here; None if one can. (The first look also
    reclaims what dead harnesses left.)"""
    try:
        reclaim_stale()
        unmount(mount(4096, 4))
    except OSError as e:
        return f"a private tmpfs cannot be mounted here ({e.strerror}): it needs root or CAP_SYS_ADMIN"
    return None
