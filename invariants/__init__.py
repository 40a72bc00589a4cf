"""Invariants: each has an id, a one-line statement, and a checker over an :class:`ObservedWorld`
that returns messages a person can act on (naming the key, request or structure at fault)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from invariants.observed import ObservedWorld
from omnisim.base import UsageError

Checker = Callable[[ObservedWorld], list[str]]

#: How ``no-crash`` says where a crash was raised when that was not in the runtime.
RAISED_OUTSIDE_THE_RUNTIME = "raised outside the runtime"


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str

    @property
    def is_a_slip_of_the_world(self) -> bool:
        """A crash of code outside the runtime (the scenario's, the harness's, a test's): its
        world's own slip, never a failure of the runtime."""
        return self.invariant == "no-crash" and RAISED_OUTSIDE_THE_RUNTIME in self.message

    def as_dict(self) -> dict[str, str]:
        return {"invariant": self.invariant, "message": self.message}


@dataclass(frozen=True)
class Invariant:
    id: str
    statement: str
    check: Checker


INVARIANTS: dict[str, Invariant] = {}


def invariant(id: str, statement: str) -> Callable[[Checker], Checker]:
    """Register a checker under ``id``; an id taken by a checker defined elsewhere is a usage
    error (the same definition run again, its module imported a second time, replaces it)."""

    def register(check: Checker) -> Checker:
        taken = INVARIANTS.get(id)
        if taken is not None and where(taken.check) != where(check):
            raise UsageError(f"invariant {id!r} is registered twice (first in {where(taken.check)})")
        INVARIANTS[id] = Invariant(id, statement, check)
        return check

    return register


def where(fn: Callable[..., object]) -> str:
    """Where ``fn`` is defined: ``file:line``."""
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(fn)


class CheckerFailed(Exception):
    """A checker raised instead of answering: a bug in it, never a finding. ``builtin``: the
    checker is one of omnisim's (else a plugin's)."""

    def __init__(self, id: str, check: Checker, error: Exception) -> None:
        super().__init__(f"the checker of invariant {id!r} ({where(check)}) raised {type(error).__name__}: {error}")
        self.builtin = check.__module__.split(".")[0] == __name__


class UnknownInvariant(LookupError):
    """A name that no registered invariant has."""


def check(world: ObservedWorld, ids: Iterable[str]) -> list[Violation]:
    """Run the named checkers, plus what the scenario's own probes found (``probe.failed``
    events), of any invariant, run or not; in a stable order."""
    # One pass over the trace for every invariant's probes, not one per invariant.
    probed: dict[str, list[str]] = {}
    for e in world.trace:
        if e.name == "probe.failed":
            probed.setdefault(str(e.attrs["invariant"]), []).append(str(e.attrs["message"]))
    unknown = sorted(set(probed) - set(INVARIANTS)) or sorted(set(ids) - set(INVARIANTS))
    if unknown:
        raise UnknownInvariant(
            f"no invariant is named {unknown[0]!r} (a scenario's `invariants=`, or its probe): register it with "
            "@invariants.invariant (a checker may find nothing itself and leave the verdict to probes)"
        )
    ids = list(ids)
    out: list[Violation] = []
    # A probe that failed is a violation whether or not the scenario runs that invariant's checker.
    for id in [*ids, *sorted(set(probed) - set(ids))]:
        messages = (_checked(INVARIANTS[id], world) if id in ids else []) + probed.get(id, [])
        out.extend(Violation(id, message) for message in messages)
    return out


def _checked(inv: Invariant, world: ObservedWorld) -> list[str]:
    try:
        return inv.check(world)
    except Exception as e:
        raise CheckerFailed(inv.id, inv.check, e) from e


# The checkers register themselves on import.
from invariants import dataplane, delivery, isolation, ownership, resources  # noqa: E402, F401
