"""Arrival wakeups (spec §2.9): a put hints the receivers of ``to_stage`` that a chunk landed.

A wakeup is only a hint; correctness still comes from polling the exact key. Receivers take a
generation snapshot *before* a poll pass and, when the pass made no progress, wait for that
generation to change instead of sleeping, so a put landing mid-pass is never slept through.

* :class:`LocalWakeups` — stages in one process: a counter and a kernel signal per stage.
* :class:`FifoWakeups` — stages in different processes: one FIFO per receiver in
  ``/dev/shm/omnisim-{ns}-wake/``; a sender writes one byte into every FIFO of ``to_stage``.

Besides the stages, the bus carries other channels: a ring's producer waits for room on
``room_edge_{from}_{to}`` (see :mod:`runtime.connectors.ring`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat
import uuid
from collections.abc import Callable
from typing import Protocol

from runtime.kernel import KSignal, current_kernel

log = logging.getLogger(__name__)

#: What a FIFO receiver may listen on: a stage id, or another channel of the bus (a ring's
#: ``room_edge_1_2``); a safe file name, never a path.
CHANNEL = re.compile(r"[a-z0-9_]{1,64}")


class Wakeups(Protocol):
    def notify(self, to_stage: str) -> None:
        """Hint every receiver of ``to_stage`` that something arrived."""
        ...

    def poke(self, stage: str) -> None:
        """Wake this process's own wait on ``stage``, as a put would: something else (a new
        registration) wants a poll now."""
        ...

    def generation(self, stage: str) -> int | None:
        """The receiver's wakeup counter, or None when wakeups are unavailable (keep polling)."""
        ...

    async def wait_for_change(
        self, stage: str, generation: int, *, timeout: float, ready: Callable[[], bool] | None = None
    ) -> bool:
        """Wait up to ``timeout`` for the counter to move past ``generation``; True if it did.
        ``ready``: what else the caller waits for (see :meth:`runtime.kernel.KSignal.wait`)."""
        ...

    def close(self) -> None: ...


class LocalWakeups:
    """Wakeups between the stages of one process."""

    def __init__(self) -> None:
        self._counters: dict[str, int] = {}
        self._signals: dict[str, KSignal] = {}

    def _signal(self, stage: str) -> KSignal:
        sig = self._signals.get(stage)
        if sig is None:
            sig = self._signals[stage] = current_kernel().signal(f"wakeup.{stage}")
            self._counters[stage] = 0
        return sig

    def notify(self, to_stage: str) -> None:
        sig = self._signal(to_stage)
        self._counters[to_stage] += 1
        sig.notify()

    def poke(self, stage: str) -> None:
        self.notify(stage)

    def generation(self, stage: str) -> int | None:
        self._signal(stage)
        return self._counters[stage]

    async def wait_for_change(
        self, stage: str, generation: int, *, timeout: float, ready: Callable[[], bool] | None = None
    ) -> bool:
        sig = self._signal(stage)

        def moved_or_ready() -> bool:
            return self._counters[stage] != generation or (ready is not None and ready())

        if self._counters[stage] == generation:
            await sig.wait(timeout, ready=moved_or_ready)
        return self._counters[stage] != generation

    def close(self) -> None:
        return None


def _our_fifo(st: os.stat_result) -> bool:
    """Whether a name in the wakeup folder is a receiver's FIFO: a FIFO of this user. Nothing
    else there is written to or removed (a file, a symlink, another user's FIFO)."""
    return stat.S_ISFIFO(st.st_mode) and st.st_uid == os.geteuid()


class _FifoReceiver:
    def __init__(self, path: str, read_fd: int, hold_fd: int) -> None:
        self.path = path
        self.read_fd = read_fd
        self.hold_fd = hold_fd
        self.counter = 0

    def drain(self) -> bool:
        got = False
        while True:
            try:
                chunk = os.read(self.read_fd, 4096)
            except BlockingIOError:
                return got
            if not chunk:
                return got
            got = True

    def close(self) -> None:
        for fd in (self.read_fd, self.hold_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class FifoWakeups:
    """Cross-process wakeups through FIFOs under ``/dev/shm/omnisim-{namespace}-wake``.

    The folder must be ours (a real folder, not a symlink, of this user, mode 0700) and every
    FIFO written to must be a FIFO of this user: anything else at those names is refused —
    wakeups are then unavailable and receivers keep polling — never followed or removed."""

    def __init__(self, namespace: str, shm_dir: str = "/dev/shm") -> None:
        self.directory = os.path.join(shm_dir, f"omnisim-{namespace}-wake")
        self._receivers: dict[str, _FifoReceiver] = {}
        self._closed = False
        #: Whether the folder is ours: None until a first look; a folder refused stays refused
        #: (a poll loop asks every pass, and would warn every pass).
        self._directory_ours: bool | None = None

    def _own_directory(self) -> bool:
        """Make the folder, or accept an existing one only if it is ours."""
        if self._directory_ours is not None:
            return self._directory_ours
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.directory, 0o700)
        try:
            st = os.lstat(self.directory)
        except OSError:
            return False
        ours = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        if not ours:
            log.warning("wakeups disabled: %s is not a folder of ours (mode %o)", self.directory, st.st_mode)
        self._directory_ours = ours
        return ours

    def _receiver(self, stage: str) -> _FifoReceiver | None:
        if self._closed or not CHANNEL.fullmatch(stage):
            return None
        rx = self._receivers.get(stage)
        if rx is not None:
            return rx
        try:
            if not self._own_directory():
                return None
            # Made under a name no notifier looks at, and given its real name only once its read
            # end is open: a FIFO under a real name without a reader is a dead receiver's.
            name = f"{stage}_{uuid.uuid4().hex}"
            path = os.path.join(self.directory, f"new.{name}")
            os.mkfifo(path, 0o600)
        except OSError as e:
            log.warning("wakeups disabled for stage %s: %s", stage, e)
            return None
        read_fd = hold_fd = -1
        try:
            read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
            if not stat.S_ISFIFO(os.fstat(read_fd).st_mode):
                raise OSError(f"{path} is not a FIFO")
            # The hold end keeps the FIFO from reporting EOF (a spin) while no sender has it open.
            hold_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
            named = os.path.join(self.directory, name)
            os.rename(path, named)
            path = named
        except OSError:
            for fd in (read_fd, hold_fd):
                if fd >= 0:
                    os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        rx = self._receivers[stage] = _FifoReceiver(path, read_fd, hold_fd)
        return rx

    def notify(self, to_stage: str) -> None:
        if not CHANNEL.fullmatch(to_stage):
            return
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if not name.startswith(f"{to_stage}_"):
                continue
            path = os.path.join(self.directory, name)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no reader: its process died (see _receiver)
                    with contextlib.suppress(OSError):
                        if _our_fifo(os.lstat(path)):  # another user's is not ours to remove
                            os.unlink(path)
                continue
            try:
                if _our_fifo(os.fstat(fd)):
                    os.write(fd, b"\0")
            except OSError:
                pass
            finally:
                os.close(fd)

    def poke(self, stage: str) -> None:
        rx = self._receivers.get(stage)
        if rx is not None:
            with contextlib.suppress(OSError):  # full (a wakeup is pending anyway), or closed
                os.write(rx.hold_fd, b"\0")

    def generation(self, stage: str) -> int | None:
        rx = self._receiver(stage)
        return None if rx is None else rx.counter

    async def wait_for_change(
        self, stage: str, generation: int, *, timeout: float, ready: Callable[[], bool] | None = None
    ) -> bool:
        rx = self._receivers.get(stage)
        if rx is None or self._closed:
            return False
        arrived = rx.counter == generation and (
            rx.drain() or await current_kernel().wait_readable(rx.read_fd, timeout, name=f"wakeup.{stage}", ready=ready)
        )
        if self._closed or self._receivers.get(stage) is not rx:
            return False  # closed while it waited: its descriptor's number may be another file's now
        if arrived:
            rx.drain()
            rx.counter += 1
        return rx.counter != generation

    def close(self) -> None:
        self._closed = True
        for rx in self._receivers.values():
            rx.close()
        self._receivers.clear()
        if self._directory_ours:
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)
