"""RealKernel: the kernel for production runs, on plain trio and the real monotonic clock."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import trio

from runtime.kernel import Attr, KTaskGroup

T = TypeVar("T")

#: Blocking work touching more bytes than this runs on a worker thread, so one large copy does
#: not stall every other stage task in the process.
OFFLOAD_BYTES = 4 << 20


class _Signal:
    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self, timeout: float) -> bool:
        event = self._event
        with trio.move_on_after(timeout):
            await event.wait()
        return event.is_set()


class _Lock:
    """trio's lock without the scheduling round of an uncontended acquire.

    ``trio.Lock.acquire`` always yields to the scheduler. The runtime's critical sections are
    short and every stage loop yields once per step anyway, so an uncontended acquire only
    costs a full trio round per section — most of the transport overhead of a streamed request.
    """

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def __aenter__(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


class _TaskGroup:
    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def start_soon(self, fn: Callable[[], Awaitable[object]], *, name: str) -> None:
        self._nursery.start_soon(fn, name=name)


class RealKernel:
    """Points are free, locks and signals are trio's, time is the real clock."""

    async def point(self, name: str, /, **attrs: Attr) -> None:
        return None

    def note(self, name: str, /, **attrs: Attr) -> None:
        return None

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    def lock(self, name: str) -> _Lock:
        return _Lock()

    def signal(self, name: str) -> _Signal:
        return _Signal()

    @asynccontextmanager
    async def task_group(self) -> AsyncIterator[KTaskGroup]:
        async with trio.open_nursery() as nursery:
            yield _TaskGroup(nursery)

    async def run_blocking(self, fn: Callable[[], T], *, cost: int = 0) -> T:
        if cost < OFFLOAD_BYTES:
            return fn()
        return await trio.to_thread.run_sync(fn)

    async def wait_readable(self, fd: int, timeout: float) -> bool:
        if not math.isfinite(timeout) or timeout <= 0:
            return False
        with trio.move_on_after(timeout):
            await trio.lowlevel.wait_readable(fd)
            return True
        return False
