"""Fault plans: named faults fired at named points, chosen up front or sampled BUGGIFY-style.

Most faults are an exception raised out of a point, of the very type the real failure produces,
so the runtime handles an injected fault exactly as it handles the real one. The others act on
the world (the simulator carries them out, see :meth:`omnisim.world.World.apply_fault`):

=========================  ====================  =============================================
kind                       fires at (default)    what happens
=========================  ====================  =============================================
``put_fail``               ``shm.put.begin``     a storage error: ``put`` reports failure
``store_full``             ``shm.put.locked``    ENOSPC (space) before the segment exists
``enospc_inodes``          ``shm.put.begin``     ENOSPC (inodes): no lock file can be made
``reserve_full``           ``shm.put.created``   ENOSPC (space) once the segment or ring frame
                                                 exists: its reservation fails
``foreign_name``           ``shm.put.locked``    the segment's name is taken by a foreign object
``put_raise_after_create`` ``shm.put.written``   ``put`` raises with the segment left behind
``decode_fail``            ``shm.get.consumed``  the bytes were taken but do not decode
``get_raise``              ``shm.get.begin``     ``get`` raises before it touched anything
``cleanup_raise``          ``shm.cleanup.begin`` ``cleanup`` raises before it removed anything
                                                 (a bug, or an interrupted call)
``crash_writer``           ``shm.put.written``   the writing task's process dies there (SIGKILL):
                                                 no ``finally`` runs, its locks are released,
                                                 what it wrote stays
``crash_reader``           ``shm.get.locked``    the reading task's process dies there
``stall``                  ``shm.get.locked``    the task hangs there for good (SIGSTOP of a
                                                 thread): its process lives and keeps its locks
``crash_stage``            ``shm.put.begin``     the stage process of the task dies there
                                                 (SIGKILL), all of its tasks with it
``pause_stage``            ``shm.put.written``   the stage process of the task stops there for
                                                 ``world.PAUSE_S`` (SIGSTOP … SIGCONT), locks held
``corrupt_bytes``          ``shm.put.committed`` a byte of the committed segment flips
``forged_frame``           ``shm.put.committed`` the segment is replaced by a forged frame: valid
                                                 trailer and checksum, a header that lies about
                                                 its buffers (``world.forgery`` says how)
=========================  ====================  =============================================

``at`` moves a fault to another point (``crash_writer`` at ``shm.put.created``, say).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from omnisim.points import check_attributes
from runtime.connectors.stores import ForeignName, StoreError, StoreFull
from runtime.connectors.wire import WireDecodeError
from runtime.kernel import Attr
from runtime.real_kernel import RealKernel


class InjectedStoreError(StoreError):
    """An injected storage failure."""


class InjectedCrash(Exception):
    """An injected exception that escapes the connector (as a bug or an interrupted call would)."""


class InjectedDecodeError(WireDecodeError):
    """An injected deserialization failure after the bytes were consumed."""


def _key(attrs: dict[str, Attr]) -> str:
    return str(attrs.get("key"))


#: kind -> (default point, the exception it raises; None: an action the world carries out).
FAULT_KINDS: dict[str, tuple[str, Callable[[dict[str, Attr]], BaseException] | None]] = {
    "put_fail": ("shm.put.begin", lambda a: InjectedStoreError(f"injected put failure for {_key(a)}")),
    "store_full": ("shm.put.locked", lambda a: StoreFull(_key(a), 0)),
    "enospc_inodes": ("shm.put.begin", lambda a: StoreFull(_key(a), 0, inodes=True)),
    "reserve_full": ("shm.put.created", lambda a: StoreFull(_key(a), 0)),
    "foreign_name": (
        "shm.put.locked",
        lambda a: ForeignName(f"cannot create segment {_key(a)!r}: its name is taken by something that is not ours"),
    ),
    "put_raise_after_create": ("shm.put.written", lambda a: InjectedCrash(f"injected raise after creating {_key(a)}")),
    "decode_fail": ("shm.get.consumed", lambda a: InjectedDecodeError(f"injected decode failure for {_key(a)}")),
    "get_raise": ("shm.get.begin", lambda a: InjectedStoreError(f"injected read failure for {_key(a)}")),
    "cleanup_raise": ("shm.cleanup.begin", lambda a: InjectedCrash(f"injected raise in the cleanup of {_key(a)}")),
    "crash_writer": ("shm.put.written", None),
    "crash_reader": ("shm.get.locked", None),
    "stall": ("shm.get.locked", None),
    "crash_stage": ("shm.put.begin", None),
    "pause_stage": ("shm.put.written", None),
    "corrupt_bytes": ("shm.put.committed", None),
    "forged_frame": ("shm.put.committed", None),
}


class UnknownFaultError(ValueError):
    """A fault kind that does not exist, or a fault spec that cannot be read."""


@dataclass
class Fault:
    """Fire ``kind`` on the ``nth`` (1-based) hit of its point whose attrs match ``match``;
    with ``probability`` set, every matching hit fires with that probability instead."""

    kind: str
    match: dict[str, str] = field(default_factory=dict)
    nth: int = 1
    probability: float | None = None
    #: The point it fires at, if not its kind's default.
    at: str | None = None
    hits: int = 0
    #: Added to the scenario by the command line (``--fault``, ``--faults sampled``), not one of
    #: the scenario's own: a shrink may drop it, where the scenario's own are what it is about.
    added: bool = False

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise UnknownFaultError(f"unknown fault kind {self.kind!r}; known: {', '.join(FAULT_KINDS)}")

    @property
    def point(self) -> str:
        return self.at or FAULT_KINDS[self.kind][0]

    def exception(self, name: str, attrs: dict[str, Attr]) -> BaseException | None:
        """The exception this fault raises at ``name``, marked as injected (``injected_fault``:
        what a check may tell from a slip of the runtime); None for a fault the world acts out."""
        make = FAULT_KINDS[self.kind][1]
        if make is None:
            return None
        error = make(attrs)
        error.injected_fault = self.kind  # type: ignore[attr-defined]
        return error

    @property
    def raises(self) -> bool:
        """Whether it is an exception (rather than an action of the simulator's world)."""
        return FAULT_KINDS[self.kind][1] is not None

    def as_dict(self) -> dict[str, object]:
        """A fault that fires on one hit, as an artifact records it (see :func:`fixed_fault`)."""
        assert self.probability is None, "a probabilistic fault has no fixed form"
        return {"kind": self.kind, "at": self.point, "match": dict(self.match), "nth": self.nth, "added": self.added}


def fixed_fault(entry: object) -> Fault:
    """The fault an artifact recorded with :meth:`Fault.as_dict`; anything else is an
    :class:`UnknownFaultError`."""
    if not isinstance(entry, dict) or set(entry) != {"kind", "at", "match", "nth", "added"}:
        raise UnknownFaultError(f"expected a fault with kind, at, match, nth and added, got {entry!r}")
    kind, at, match, nth, added = entry["kind"], entry["at"], entry["match"], entry["nth"], entry["added"]
    if not (isinstance(kind, str) and isinstance(at, str) and isinstance(match, dict)):
        raise UnknownFaultError(f"fault {entry!r}: kind and at must be names, match a mapping")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in match.items()):
        raise UnknownFaultError(f"fault {entry!r}: match must map names to values")
    if not isinstance(nth, int) or isinstance(nth, bool) or nth < 1:
        raise UnknownFaultError(f"fault {entry!r}: nth must be a hit number from 1")
    if not isinstance(added, bool):
        raise UnknownFaultError(f"fault {entry!r}: added must be true or false")
    return Fault(kind, match=dict(match), nth=nth, at=at, added=added)


#: What ``--faults sampled`` draws from: the storage failures the runtime must survive anywhere.
SAMPLED_KINDS = (
    "put_fail",
    "store_full",
    "reserve_full",
    "enospc_inodes",
    "foreign_name",
    "put_raise_after_create",
    "decode_fail",
)


def sampled_kinds(spec: str) -> tuple[str, ...] | None:
    """The kinds of a ``sampled[:KIND,KIND...]`` spec (BUGGIFY: each run draws which are active
    and when they fire, from its seed); None for a spec that names one fault."""
    head, _, kinds = spec.partition(":")
    if head != "sampled":
        return None
    chosen = tuple(filter(None, kinds.split(","))) or SAMPLED_KINDS
    for kind in chosen:
        Fault(kind)  # an unknown kind is an error now, not at the first run
    return chosen


def parse_fault(spec: str) -> Fault:
    """A fault from the command line: ``KIND[@NAME=VALUE[,NAME=VALUE...]][#N]`` fires ``KIND``
    at its point on the ``N``-th hit (default: the first) whose attributes match — for example
    ``put_fail@key=R_0_3``, ``decode_fail#2`` or ``crash_reader@key=R_1_0``."""
    rest, _, nth = spec.partition("#")
    kind, _, matches = rest.partition("@")
    match: dict[str, str] = {}
    for pair in filter(None, matches.split(",")):
        name, sep, value = pair.partition("=")
        if not sep or not name or not value:
            raise UnknownFaultError(f"fault {spec!r}: expected NAME=VALUE after '@', got {pair!r}")
        match[name] = value
    if nth and (not nth.isdigit() or int(nth) < 1):
        raise UnknownFaultError(f"fault {spec!r}: expected a hit number from 1 after '#', got {nth!r}")
    fault = Fault(kind, match=match, nth=int(nth) if nth else 1, added=True)
    never = check_attributes(fault.point, match)
    if never is not None:
        raise UnknownFaultError(f"fault {spec!r} would never fire: {never}")
    return fault


def faults_of_specs(specs: Sequence[str], seed: int, hit_probability: float = 0.2) -> list[Fault]:
    """The faults of command-line specs (``--fault``, ``--faults sampled``) for the run of
    ``seed``: the named ones first, then those the sampled specs draw (each active kind firing on
    a hit with ``hit_probability``; several sampled specs draw once, over all their kinds).
    Fresh objects on every call: a fault counts its hits."""
    named = [parse_fault(spec) for spec in specs if sampled_kinds(spec) is None]
    kinds = list(dict.fromkeys(kind for spec in specs for kind in sampled_kinds(spec) or ()))
    if not kinds:
        return named
    return [*named, *FaultPlan.sampled(seed, kinds, hit_probability=hit_probability).faults]


def check_raising(specs: Sequence[str]) -> None:
    """Refuse specs that name a fault the simulator's world acts out (a crash, a stall, bytes
    changed): a real run can only raise, and has real deaths of its own."""
    for spec in specs:
        kinds = sampled_kinds(spec) or (parse_fault(spec).kind,)
        acted = [kind for kind in kinds if not Fault(kind).raises]
        if acted:
            raise UnknownFaultError(
                f"fault {spec!r}: {', '.join(acted)} is acted out by the simulator's world; a real run injects "
                f"only faults that raise ({', '.join(k for k in FAULT_KINDS if Fault(k).raises)})"
            )


class FaultPlan:
    def __init__(self, faults: list[Fault], seed: int = 0) -> None:
        self.faults = faults
        self._rng = random.Random(seed)
        #: The faults that fired, in order.
        self.fired: list[Fault] = []

    @classmethod
    def sampled(
        cls, seed: int, kinds: list[str], site_probability: float = 0.5, hit_probability: float = 0.2
    ) -> FaultPlan:
        """BUGGIFY: each kind is active in this run with ``site_probability``; an active kind
        fires on each hit with ``hit_probability``."""
        rng = random.Random(seed)
        active = [
            Fault(kind, probability=hit_probability, added=True) for kind in kinds if rng.random() < site_probability
        ]
        return cls(active, seed)

    @classmethod
    def fixed(cls, faults: list[Fault]) -> FaultPlan:
        """Exactly ``faults``, as fresh copies (a fault counts its hits, so each run needs its own)."""
        return cls([dataclasses.replace(fault, hits=0) for fault in faults])

    def fire(self, name: str, attrs: dict[str, Attr]) -> Fault | None:
        for fault in self.faults:
            if fault.point != name or not all(str(attrs.get(k)) == v for k, v in fault.match.items()):
                continue
            fault.hits += 1
            fires = self._rng.random() < fault.probability if fault.probability is not None else fault.hits == fault.nth
            if fires:
                self.fired.append(fault)
                return fault
        return None


class FaultingKernel(RealKernel):
    """The production kernel with a fault plan (``omnisim soak --fault``): each point asks the
    plan, and a fault that fires there raises the exception its real failure raises, so a real
    run (real /dev/shm, real torch, real timing) meets the failures the simulator injects. Only
    faults that raise (see :func:`check_raising`). ``plan`` None: no fault fires (yet)."""

    def __init__(self, plan: FaultPlan | None = None) -> None:
        super().__init__()
        self.plan = plan
        #: Each fault that fired: its kind, the key it fired on, and when (this kernel's clock).
        self.fired: list[tuple[str, str, float]] = []

    async def point(self, name: str, /, **attrs: Attr) -> None:
        fault = self.plan.fire(name, attrs) if self.plan is not None else None
        if fault is None:
            return
        error = fault.exception(name, attrs)
        if error is None:
            raise UnknownFaultError(f"fault {fault.kind} is acted out by the simulator's world: a real run cannot")
        self.fired.append((fault.kind, str(attrs.get("key")), self.now()))
        raise error
