"""Child processes of a simulated world, and their control connections.

:meth:`SimKernel.start_process <omnisim.sim_kernel.SimKernel.start_process>` does not start an
OS process: it looks the command up among the world's *programs* (``python -m MODULE``: the
program registered for ``MODULE``), and runs what the program makes as a simulated process — its
tasks scheduled like every other, killed by SIGKILL as a whole (see ``SimKernel.kill_process``).
Its control connection is a pair of :class:`_End` s in memory that behave as a Unix socket pair's
do: bytes arrive in order, 64 KiB at most per receive, what was sent before an end closed can
still be read, then the reader gets end-of-file, and a send to a closed end fails.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.kernel import KStream

if TYPE_CHECKING:
    from omnisim.sim_kernel import SimKernel


@dataclass(frozen=True)
class Spawned:
    """What a program makes of one command: a process of the world, not started yet."""

    #: Its name in the world (its tasks' process).
    process: str
    pid: int
    #: What it runs, given its end of the control connection; the process exits when it returns.
    main: Callable[[KStream], Awaitable[None]]
    #: SIGKILL: its tasks stop where they are (the world's crash: what it held in memory goes).
    kill: Callable[[], None]
    #: It ended by itself: the world forgets it as a live process.
    exited: Callable[[], None]


#: A program of the world: the command (as a real kernel gets it, without the descriptor it
#: appends) -> the process it starts.
Program = Callable[[list[str]], Spawned]


#: The most one receive hands over (a Code2Wav chunk's audio is three times that).
READ_PIECE = 1 << 16


def program_name(argv: list[str]) -> str:
    """The module a ``python -m MODULE …`` command runs; a command of another form is an error."""
    if len(argv) < 3 or argv[1] != "-m":
        raise FileNotFoundError(f"a simulated world runs only `python -m MODULE` commands, not {argv[:3]}")
    return argv[2]


class _End:
    """One end of a simulated socket pair (see the module docstring)."""

    def __init__(self, kernel: SimKernel, name: str) -> None:
        self.name = name
        self.inbox = bytearray()
        self.closed = False
        self.peer: _End = self
        self._arrived = kernel.signal(name)

    async def send_all(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionError(f"{self.name}: send on a closed connection")
        if self.peer.closed:
            raise BrokenPipeError(f"{self.name}: the other end is closed")
        self.peer.inbox += data
        self.peer._arrived.notify()

    async def receive_some(self, max_bytes: int) -> bytes:
        while not (self.closed or self._readable()):
            await self._arrived.wait(math.inf, ready=self._readable)
        if self.closed:
            raise ConnectionError(f"{self.name}: receive on a closed connection")
        # A stream socket may hand a large message over in parts: a reader must read on.
        take = min(max_bytes, READ_PIECE)
        data = bytes(self.inbox[:take])
        del self.inbox[:take]
        return data

    def _readable(self) -> bool:
        return bool(self.inbox) or self.peer.closed

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.peer._arrived.notify()


def connection(kernel: SimKernel, name: str) -> tuple[_End, _End]:
    """A connected pair: the parent's end (``NAME.parent``) and the child's (``NAME.child``)."""
    parent, child = _End(kernel, f"{name}.parent"), _End(kernel, f"{name}.child")
    parent.peer, child.peer = child, parent
    return parent, child


class SimChild:
    """A child process as its parent sees it: :class:`runtime.kernel.KProcess`."""

    def __init__(self, kernel: SimKernel, spawned: Spawned, end: _End) -> None:
        self.pid = spawned.pid
        self.spawned = spawned
        self._returncode: int | None = None
        self._end = end
        self._ended = kernel.signal(f"{spawned.process}.ended")

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def wait(self) -> int:
        while self._returncode is None:
            await self._ended.wait(math.inf, ready=lambda: self._returncode is not None)
        return self._returncode

    def send_signal(self, sig: int) -> None:
        if sig not in (signal.SIGKILL, signal.SIGTERM):
            raise ValueError(f"a simulated process takes SIGKILL or SIGTERM (its death), not signal {sig}")
        if self._returncode is None:
            self.spawned.kill()

    def ended(self, returncode: int) -> None:
        """It is gone (exited, or killed): its end of the connection closes with it."""
        if self._returncode is None:
            self._returncode = returncode
            self._end.close()
            self._ended.notify()
