"""The kernel seam: the one way runtime code waits, locks, sleeps, spawns or reads the clock.

Runtime code never imports trio's blocking primitives, ``threading`` or ``time``. It asks the
*current kernel* (a context variable) instead::

    k = current_kernel()
    await k.point("shm.put.begin", key=key)    # a place where another task may interleave
    async with self._lock: ...                 # a kernel lock made by k.lock(name)

Two kernels implement this interface: :class:`runtime.real_kernel.RealKernel` (plain trio, real
clock; points are free) and ``omnisim.sim_kernel.SimKernel`` (one logical task at a time, each
point a scheduling decision taken by a strategy, virtual time). Runtime code never asks which one
it runs on.
"""

from __future__ import annotations

import contextvars
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Protocol, TypeVar

T = TypeVar("T")

#: Attribute values a point may carry. Kept to scalars so traces are canonical.
Attr = str | int | bool | None


class KLock(Protocol):
    """A mutual-exclusion lock. Only ``async with`` is used by the runtime."""

    async def __aenter__(self) -> None: ...
    async def __aexit__(self, *exc: object) -> None: ...


class KSignal(Protocol):
    """A wake-up signal, the runtime's condition variable.

    ``wait`` registers the caller *before* it gives up control, so a state check followed by
    ``wait`` (with no await between them) cannot miss a ``notify``.
    """

    def notify(self) -> None:
        """Wake every task currently waiting."""
        ...

    async def wait(self, timeout: float, *, ready: Callable[[], bool] | None = None) -> bool:
        """Wait until notified or ``timeout`` seconds pass; True if notified.

        ``ready`` says what the caller waits for. A wait that runs out its timeout while
        ``ready()`` holds missed a ``notify``: every wait is bounded, so such a loss costs only
        latency and nothing else would show it; the simulator records it (``kernel.timeout``
        with ``missed``) for the ``no-lost-wakeup`` invariant, production ignores it.
        """
        ...


class KStream(Protocol):
    """A byte stream to another process (a connected Unix socket)."""

    async def send_all(self, data: bytes) -> None: ...

    async def receive_some(self, max_bytes: int) -> bytes:
        """Some bytes, at most ``max_bytes``; ``b""`` once the other end closed."""
        ...

    async def aclose(self) -> None: ...


class KProcess(Protocol):
    """A child OS process."""

    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...


class KTaskGroup(Protocol):
    def start_soon(self, fn: Callable[[], Awaitable[object]], *, name: str) -> None: ...


class Kernel(Protocol):
    """Everything the runtime needs from the world that can block, interleave or be timed."""

    async def point(self, name: str, /, **attrs: Attr) -> None:
        """A named place where another task may run; may raise an injected fault."""
        ...

    def note(self, name: str, /, **attrs: Attr) -> None:
        """Record an observation (no scheduling decision). Free on the real kernel."""
        ...

    def now(self) -> float:
        """Seconds on a monotonic clock."""
        ...

    async def sleep(self, seconds: float) -> None: ...

    def lock(self, name: str) -> KLock: ...

    def signal(self, name: str) -> KSignal: ...

    def task_group(self) -> AbstractAsyncContextManager[KTaskGroup]:
        """A scope whose tasks all finish (or are cancelled) before it exits."""
        ...

    async def run_blocking(self, fn: Callable[[], T], *, cost: int = 0) -> T:
        """Run blocking work; ``cost`` (bytes touched) lets a kernel move large work off-loop."""
        ...

    async def compute(self, fn: Callable[[], T]) -> T:
        """Run model compute, off the event loop where the kernel can, so that everything else
        of the process — the other stages, heartbeats, the control plane — goes on meanwhile."""
        ...

    async def wait_readable(
        self, fd: int, timeout: float, *, name: str = "", ready: Callable[[], bool] | None = None
    ) -> bool:
        """Wait until ``fd`` is readable or ``timeout`` passes; True if readable. ``name`` says what
        the descriptor stands for, as a signal's name does; ``ready``: what else the caller waits
        for, as for :meth:`KSignal.wait` (a timeout while it holds missed a wakeup). Production
        ignores both."""
        ...

    def stream(self, sock: socket.socket) -> KStream:
        """Wrap a connected socket (one end of a ``socketpair``) as a stream."""
        ...

    def wait_gone(self, process: KProcess, timeout: float) -> bool:
        """Block until ``process``, sent SIGKILL, is gone, for at most ``timeout`` seconds; True if
        it is. For a path that cannot await (the cleanup of a cancelled task): a process killed in
        the middle of a system call (reserving a file's space, say) finishes that call before it
        dies, so what it leaves may be removed only after."""
        ...

    async def start_process(self, argv: list[str]) -> tuple[KProcess, KStream]:
        """Start a child OS process (spawned afresh, never forked from this one) with a control
        connection: the child gets one end of a new Unix socket pair, its descriptor's number
        appended to ``argv``; the other end comes back as a stream, with the process."""
        ...


_current: contextvars.ContextVar[Kernel | None] = contextvars.ContextVar("omnisim_kernel", default=None)


def current_kernel() -> Kernel:
    """The kernel of the running context; a RealKernel when none was installed."""
    k = _current.get()
    if k is None:
        from runtime.real_kernel import RealKernel

        k = RealKernel()
        _current.set(k)
    return k


@contextmanager
def use_kernel(kernel: Kernel) -> Iterator[Kernel]:
    """Install ``kernel`` as the current kernel for the duration of the block."""
    token = _current.set(kernel)
    try:
        yield kernel
    finally:
        _current.reset(token)


async def wait_until(
    ready: Callable[[], bool], *, what: str, key: str, limit_s: float, first_s: float, max_s: float
) -> bool:
    """Ask ``ready()`` until it says yes, backing off from ``first_s`` (doubling, at most
    ``max_s``) for at most ``limit_s``; False if it never did. A wait that happens is noted
    (``wait.begin``/``wait.end`` on ``what`` and ``key``), so its bound can be checked."""
    if ready():
        return True
    k = current_kernel()
    k.note("wait.begin", what=what, key=key, limit_us=round(limit_s * 1e6))
    deadline = k.now() + limit_s
    backoff = first_s
    try:
        while k.now() < deadline:
            await k.sleep(backoff)
            backoff = min(backoff * 2, max_s)
            if ready():
                return True
        return False
    finally:
        k.note("wait.end", what=what, key=key)
