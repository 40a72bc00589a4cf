"""What every part of the harness shares and must stay cheap to import (the command line's
``--help`` and argument errors load nothing else): the store names, the usage error, and how an
interrupt is recognised."""

from __future__ import annotations

#: The stores a simulated world can run on.
STORES = ("memory", "posix")


class UsageError(ValueError):
    """A bad name or parameter given by the user (exit status 2)."""


def is_interrupt(error: BaseException | None) -> bool:
    """True for a KeyboardInterrupt, alone, inside an exception group (trio's nurseries) or as
    the cause of another error (one that landed inside trio's own machinery)."""
    if error is None:
        return False
    if isinstance(error, BaseExceptionGroup):
        return any(is_interrupt(inner) for inner in error.exceptions)
    return isinstance(error, KeyboardInterrupt) or is_interrupt(error.__cause__)
