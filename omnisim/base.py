"""What every part of the harness shares and must stay cheap to import (the command line's
``--help`` and argument errors load nothing else): the store names, the command errors, how an
interrupt is recognised, and the checks that an output path can be written."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

#: The stores a simulated world can run on: dictionaries, /dev/shm segments, or /dev/shm with a
#: (small) ring per stage edge for the chunks that fit on it.
STORES = ("memory", "posix", "ring")
#: Where a real engine's chunks live (its edges' transport comes from the deploy file).
ENGINE_STORES = ("memory", "posix")


class UsageError(ValueError):
    """A bad name or parameter given by the user (exit status 2)."""


class Misuse(BaseException):
    """A use of the harness that turns out impossible while a world runs (a crash fault that hits
    a task of the harness's own process). A BaseException, so that no handler of the runtime under
    test takes it for a failure of its own; the run stops and it is reported as a usage error."""


class CommandFailed(Exception):
    """The command ran and its subject failed (a pipeline request): one line, exit status 1."""


#: The signals (SIGINT, SIGTERM) that asked the running command to stop: whatever goes wrong from
#: then on is the stop, not a failure of its own.
stop_requested: list[str] = []


@contextmanager
def stop_at_decisions() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM only record that a stop was asked for: the simulator looks
    at :data:`stop_requested` at its next scheduling decision and ends the run there, so a stop
    never lands in the middle of trio's (or the runtime's) own machinery."""

    def record(signum: int, frame: FrameType | None) -> None:
        stop_requested.append(signal.Signals(signum).name)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, record)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def is_interrupt(error: BaseException | None) -> bool:
    """True for a KeyboardInterrupt, alone, inside an exception group (trio's nurseries) or as
    the cause of another error (one that landed inside trio's own machinery)."""
    if error is None:
        return False
    if stop_requested:
        return True
    if isinstance(error, BaseExceptionGroup):
        return any(is_interrupt(inner) for inner in error.exceptions)
    return isinstance(error, KeyboardInterrupt) or is_interrupt(error.__cause__)


def writable_dir(path: str) -> str:
    """Prove that files can be written into folder ``path`` — itself if it exists, else the
    nearest folder above it, where it would be made — without leaving anything behind."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"cannot write to {path!r}: {existing!r} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise UsageError(f"cannot write to {path!r}: {e.strerror or e}") from None
    return path


def writable_file(path: str) -> str:
    """Prove ``path`` can be written (see :func:`writable_dir`) without creating anything."""
    if os.path.isdir(path):
        raise UsageError(f"{path!r} is a directory, not a file")
    writable_dir(os.path.dirname(os.path.abspath(path)))
    return path
