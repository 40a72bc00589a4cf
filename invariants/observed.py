"""What invariants look at: an observed world, never the runtime's internals.

A run hands the checkers its trace, snapshots of its stores and of every component's
``residue()`` (at quiescence and after shutdown), and what each client stream received.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from runtime.connectors.keys import external_id_of
from runtime.kernel import Attr

_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_quote = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
#: ``_CANONICAL``'s C encoder, made once: ``JSONEncoder.encode`` makes a new one per call, which
#: costs as much as the encoding itself. Without a circular check: attribute values are scalars.
_c_encoder = json.encoder.c_make_encoder  # type: ignore[attr-defined]
_encode_attrs: Callable[[dict[str, Attr], int], Iterable[str]] = (
    _c_encoder(None, _CANONICAL.default, _quote, None, ":", ",", True, False, True)
    if _c_encoder is not None
    else lambda attrs, _level: (_CANONICAL.encode(attrs),)
)


class TraceEvent(NamedTuple):
    """One event: a granted point, a note, a block, a fault or a crash. (A named tuple: one is
    made at every point, so it must be cheap.)"""

    index: int
    time_us: int
    task: str
    name: str
    attrs: dict[str, Attr]

    def canonical(self) -> str:
        """The event as one line of canonical JSON (sorted keys, no spaces, ASCII only)."""
        # Assembled by hand in sorted key order: one is made per event, and this is what
        # json.dumps(sort_keys=True, separators=(",", ":")) would produce, at half the cost.
        return (
            f'{{"a":{"".join(_encode_attrs(self.attrs, 0))},"ev":{_quote(self.name)},"i":{self.index},'
            f'"t":{self.time_us},"task":{_quote(self.task)}}}'
        )

    def matches(self, name: str, attrs: dict[str, str]) -> bool:
        return self.name == name and all(str(self.attrs.get(k)) == v for k, v in attrs.items())


@dataclass(frozen=True)
class TaskState:
    name: str
    state: str
    waiting_for: str

    def __str__(self) -> str:
        return f"{self.name} [{self.state}] {self.waiting_for}"


class HasResidue(Protocol):
    def residue(self) -> dict[str, list[str]]: ...


@dataclass
class StoreSnapshot:
    segments: list[str]
    lock_files: list[str]
    #: The namespace's owner is dead: whatever it holds waits for a sweep.
    owner_dead: bool = False
    #: Segments and lock files opened through the store and not closed (``segment KEY``, …).
    open_handles: list[str] = field(default_factory=list)
    #: The store's rings, and ``EDGE:KEY`` of every frame on them that holds a chunk nobody took.
    rings: list[str] = field(default_factory=list)
    ring_frames: list[str] = field(default_factory=list)
    #: The namespace's spare segments (consumed segments kept for its producer's next puts).
    spares: list[str] = field(default_factory=list)
    #: The FIFOs of live receivers in the namespace's wakeup folder, by stage (a dead process's
    #: stay until a put to its stage finds them without a reader), and the folder if it is empty.
    wakeup_fifos: list[str] = field(default_factory=list)
    #: Every name of the namespace still there, in the snapshot taken after its owner's own sweep
    #: as it exits (``omnisim-{namespace}-…`` in /dev/shm, or the memory store's equivalents).
    names: list[str] = field(default_factory=list)
    #: The namespace's owner record is still there (an operator's sweep removes it last).
    owner_record: bool = True


#: The snapshots taken once the world went idle: everything a request held must be gone there.
SETTLED = ("quiescence", "shutdown")


@dataclass
class Snapshot:
    """Resources and per-request state at one moment (quiescence, after shutdown, or mid-run
    right after a sweep)."""

    label: str
    stores: dict[str, StoreSnapshot]
    residue: dict[str, dict[str, list[str]]]
    #: What the descriptors the run opened and left open point at (taken at exit, in a world
    #: where no process died: a dead process's are the OS's to close, which a simulator cannot).
    open_descriptors: list[str] = field(default_factory=list)
    #: Each live stage's health counters, as its connector reports them and as counted from
    #: outside: stage -> counter -> (reported, counted) (taken at shutdown).
    health: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)

    @property
    def settled(self) -> bool:
        return self.label in SETTLED


@dataclass
class Stream:
    """What the client of one request saw at the end of a stage edge."""

    request_id: str
    external_req_id: str
    frames_sent: int = 0
    chunks: list[tuple[int, bool]] = field(default_factory=list)  # (frames, finished)
    outcome: str = "open"  # open | finished | aborted | failed
    #: Why it failed, as the client was told.
    error: str | None = None
    #: How many terminal outputs the client got, and when it got the (first) one.
    terminals: int = 0
    ended_us: int | None = None
    #: Outcomes this request may legitimately end with (an abort may race the terminal).
    allowed_outcomes: frozenset[str] = frozenset({"finished"})
    #: The frames themselves (codebook 0..15 of each), where a scenario records content.
    sent_frames: list[tuple[int, ...]] = field(default_factory=list)
    received_frames: list[tuple[int, ...]] = field(default_factory=list)
    #: False where the sender stage is finished externally: its queued chunks may be vetoed, but
    #: the terminal must still arrive (#6670).
    complete_required: bool = True
    #: Its sender is finished externally with chunks queued: they may be vetoed, so the frames
    #: that arrive need not be all of them (only the terminal must come).
    vetoable: bool = False
    #: Where an engine accepted it: the index of its ``orch.accepted`` note, which starts its
    #: generation of the id (None where no engine is in the world, or it was never accepted).
    accepted_at: int | None = None

    @property
    def frames_received(self) -> int:
        return sum(n for n, _ in self.chunks)


@dataclass
class ObservedWorld:
    trace: list[TraceEvent]
    snapshots: list[Snapshot]
    streams: dict[str, Stream]
    stop_reason: str | None = None
    stop_detail: str = ""
    stopped_tasks: list[TaskState] = field(default_factory=list)
    crashes: list[tuple[str, str]] = field(default_factory=list)
    #: Virtual time when the run ended (or was stopped).
    end_time_us: int = 0
    #: The largest payload the world's edges carry on a ring; None where they have no rings.
    ring_max_payload: int | None = None

    def allowed_outcomes(self, stream: Stream) -> frozenset[str]:
        """What ``stream`` may end with: what its scenario expects, and "failed" too once an
        injected fault hit one of its request's keys (a fault may fail the request it hits,
        never another one, and never make it hang or finish with a gap)."""
        if self.faulted(stream):
            return stream.allowed_outcomes | {"failed"}
        return stream.allowed_outcomes

    def faulted(self, stream: Stream) -> bool:
        """Whether an injected fault hit one of the keys (``{id}_{stage}_{chunk}``) of the
        stream's request — of its own generation of the id where an engine accepted it: from its
        ``orch.accepted`` note up to the next one of the id (a fault that struck an id's earlier
        generation licenses no failure of a later one)."""
        struck = self._faults_by_request.get(stream.external_req_id, [])
        if stream.accepted_at is None:
            return bool(struck)
        later = [i for i in self._accepted_by_request[stream.external_req_id] if i > stream.accepted_at]
        ends = later[0] if later else math.inf
        return any(stream.accepted_at < i < ends for i in struck)

    @functools.cached_property
    def _faults_by_request(self) -> dict[str, list[int]]:
        """Where injected faults hit each request id's keys (trace indices)."""
        by_request: dict[str, list[int]] = {}
        for e in self.trace:
            if e.name == "fault" and "key" in e.attrs:
                by_request.setdefault(external_id_of(str(e.attrs["key"])), []).append(e.index)
        return by_request

    @functools.cached_property
    def _accepted_by_request(self) -> dict[str, list[int]]:
        """Where an engine accepted each request id (trace indices): its generations' starts."""
        by_request: dict[str, list[int]] = {}
        for e in self.trace:
            if e.name == "orch.accepted":
                by_request.setdefault(str(e.attrs["req"]), []).append(e.index)
        return by_request

    def missed_expectations(self, event: str) -> list[TraceEvent]:
        """The ``event`` notes whose ``got`` is not their ``want``: a scenario that states a
        contract case by case (a config resolved, a bad input refused) notes each case so."""
        return [e for e in self.trace if e.name == event and e.attrs["got"] != e.attrs["want"]]

    def missed_cases(self, event: str, say: str) -> list[str]:
        """The :meth:`missed_expectations` of ``event``, each as ``say`` says it (a format string
        over the note's attributes: ``"{what}: got {got}, must give {want}"``)."""
        return [say.format(**e.attrs) for e in self.missed_expectations(event)]
