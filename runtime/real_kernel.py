"""RealKernel: the kernel for production runs, on plain trio and the real monotonic clock."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import outcome
import trio

from runtime.kernel import Attr, KProcess, KTaskGroup, use_kernel

T = TypeVar("T")

#: Blocking work touching more bytes than this runs on a worker thread, so one large copy does
#: not stall every other stage task in the process.
OFFLOAD_BYTES = 4 << 20


def run(fn: Callable[..., Awaitable[T]], *args: object, compute_in_threads: bool = False) -> T:
    """Run ``fn(*args)`` in a fresh trio loop on a real kernel of its own (a process's entry
    point); see :class:`RealKernel` for ``compute_in_threads``."""
    with use_kernel(RealKernel(compute_in_threads=compute_in_threads)):
        return trio.run(fn, *args)


async def in_worker_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a trio worker thread, its answer handed over in a box the worker lets go of
    before it returns, so the worker never holds the last reference to what ``fn`` made (its
    value, or an exception whose traceback holds its frames). Trio's worker drops the answer it
    returns only after the event loop has it: freed there, at the wrong moment, a tensor kills
    the process — torch frees one with the GIL released, and a thread that takes the GIL back
    while the interpreter exits is ended mid-free (``std::terminate``: SIGABRT, exit -6)."""
    box: list[outcome.Outcome[T]] = []

    def call() -> None:
        box.append(outcome.capture(fn))

    await trio.to_thread.run_sync(call)
    return box.pop().unwrap()


class _Signal:
    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self, timeout: float, *, ready: Callable[[], bool] | None = None) -> bool:
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


class _Stream:
    """A trio socket stream whose failures are ``ConnectionError``s, as the seam promises."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream

    async def send_all(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ConnectionError(str(e)) from None

    async def receive_some(self, max_bytes: int) -> bytes:
        try:
            return await self._stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ConnectionError(str(e)) from None

    async def aclose(self) -> None:
        await self._stream.aclose()


class _TaskGroup:
    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def start_soon(self, fn: Callable[[], Awaitable[object]], *, name: str) -> None:
        self._nursery.start_soon(fn, name=name)


class RealKernel:
    """Points are free, locks and signals are trio's, time is the real clock.

    Model compute runs on the event loop (one thread: the stages of one process take turns,
    which costs less here than handing every step to a thread), unless ``compute_in_threads``
    (a stage process: its heartbeats and control plane must go on while a long step runs).
    """

    def __init__(self, *, compute_in_threads: bool = False) -> None:
        self.compute_in_threads = compute_in_threads

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
        return await in_worker_thread(fn)

    def stream(self, sock: socket.socket) -> _Stream:
        return _Stream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))

    def wait_gone(self, process: KProcess, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while process.returncode is None:  # (trio's returncode polls, and reaps)
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    async def start_process(self, argv: list[str]) -> tuple[trio.Process, _Stream]:
        ours, theirs = socket.socketpair()
        try:
            # A new session: a Ctrl-C at the terminal reaches the head only, which stops its
            # children itself, in order.
            process = await trio.lowlevel.open_process(
                [*argv, str(theirs.fileno())], pass_fds=(theirs.fileno(),), start_new_session=True
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child has its own copy
        return process, self.stream(ours)

    async def compute(self, fn: Callable[[], T]) -> T:
        if self.compute_in_threads:
            return await in_worker_thread(fn)
        return fn()

    async def wait_readable(
        self, fd: int, timeout: float, *, name: str = "", ready: Callable[[], bool] | None = None
    ) -> bool:
        if not math.isfinite(timeout) or timeout <= 0:
            return False
        with trio.move_on_after(timeout):
            await trio.lowlevel.wait_readable(fd)
            return True
        return False
