"""Invariants: each has an id, a one-line statement, and a checker over an :class:`ObservedWorld`
that returns messages a person can act on (naming the key, request or structure at fault)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from invariants.observed import ObservedWorld

Checker = Callable[[ObservedWorld], list[str]]


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"invariant": self.invariant, "message": self.message}


@dataclass(frozen=True)
class Invariant:
    id: str
    statement: str
    check: Checker


INVARIANTS: dict[str, Invariant] = {}


def invariant(id: str, statement: str) -> Callable[[Checker], Checker]:
    """Register a checker under ``id``."""

    def register(check: Checker) -> Checker:
        INVARIANTS[id] = Invariant(id, statement, check)
        return check

    return register


def check(world: ObservedWorld, ids: Iterable[str]) -> list[Violation]:
    """Run the named checkers, plus what the scenario's own probes found (``probe.failed``
    events); in a stable order."""
    out: list[Violation] = []
    for id in ids:
        probed = [
            str(e.attrs["message"]) for e in world.trace if e.name == "probe.failed" and e.attrs["invariant"] == id
        ]
        messages = INVARIANTS[id].check(world) + probed
        out.extend(Violation(id, message) for message in messages)
    return out


# The checkers register themselves on import.
from invariants import dataplane, delivery, isolation, ownership, resources  # noqa: E402, F401
