"""``ordered``: event-order constraints, random elsewhere.

A constraint is a chain of event patterns, ``a[k=v] < b < c[k=v,k2=w]``: the first event matching
``a`` happens before the first matching ``b``, and so on. A task parked at a point that matches a
later element of a chain is held back until the earlier elements have happened. A chain that
cannot be completed is reported as unsatisfied, never as a hang of the runtime.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from invariants.observed import TraceEvent
from omnisim.base import UsageError
from omnisim.points import check_attributes
from omnisim.strategies.random import RandomStrategy

if TYPE_CHECKING:
    from omnisim.sim_kernel import SimTask

_PATTERN = re.compile(r"\s*([A-Za-z0-9_.]+)\s*(?:\[([^\]]*)\])?\s*")


class ConstraintError(UsageError):
    """A constraint that does not parse."""


@dataclass(frozen=True)
class EventPattern:
    name: str
    attrs: tuple[tuple[str, str], ...]

    def matches(self, name: str, attrs: dict[str, object]) -> bool:
        return name == self.name and all(str(attrs.get(k)) == v for k, v in self.attrs)

    def __str__(self) -> str:
        inner = ",".join(f"{k}={v}" for k, v in self.attrs)
        return f"{self.name}[{inner}]" if inner else self.name


def parse_pattern(text: str) -> EventPattern:
    m = _PATTERN.fullmatch(text)
    if not m:
        raise ConstraintError(f"bad event pattern {text!r}; expected name[attr=value,...]")
    attrs = []
    for part in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConstraintError(f"bad attribute {part!r} in {text!r}; expected attr=value")
        attrs.append((key.strip(), value.strip()))
    never = check_attributes(m.group(1), (key for key, _ in attrs))
    if never is not None:
        raise ConstraintError(f"{text.strip()!r} can never match: {never}")
    return EventPattern(m.group(1), tuple(attrs))


def parse_chain(text: str) -> list[EventPattern]:
    chain = [parse_pattern(part) for part in text.split("<")]
    if len(chain) < 2:
        raise ConstraintError(f"a constraint orders at least two events: {text!r}")
    return chain


class OrderedStrategy(RandomStrategy):
    name = "ordered"

    def __init__(self, seed: int, constraints: list[str]) -> None:
        super().__init__(seed)
        self.constraints = list(constraints)
        self._chains = [parse_chain(c) for c in constraints]
        self._next = [0] * len(self._chains)
        self._violations: list[str] = []

    def _held_back(self, task: SimTask) -> bool:
        name, attrs = task.pending
        for chain, nxt in zip(self._chains, self._next, strict=True):
            for later in chain[nxt + 1 :]:
                if later.matches(name, attrs):
                    return True
        return False

    def allowed(self, ready: list[SimTask]) -> list[SimTask]:
        return [t for t in ready if not self._held_back(t)]

    def on_event(self, event: TraceEvent) -> None:
        for i, chain in enumerate(self._chains):
            nxt = self._next[i]
            if nxt >= len(chain):
                continue
            if chain[nxt].matches(event.name, event.attrs):
                self._next[i] = nxt + 1
            elif any(p.matches(event.name, event.attrs) for p in chain[nxt + 1 :]):
                self._violations.append(f"{event.name} happened before {chain[nxt]} (it is not a point)")

    def unsatisfied(self) -> list[str]:
        out = list(self._violations)
        for chain, nxt in zip(self._chains, self._next, strict=True):
            if nxt < len(chain):
                out.append(f"{' < '.join(map(str, chain))}: {chain[nxt]} never happened in order")
        return out

    def describe(self) -> dict[str, object]:
        return {"strategy": self.name, "seed": self.seed, "constraints": self.constraints}
