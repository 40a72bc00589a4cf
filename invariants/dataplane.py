"""Data-plane invariants: what a consumer accepts, what a sweep removes, how long a wait lasts."""

from __future__ import annotations

import struct
from collections.abc import Iterator

from invariants import invariant
from invariants.observed import ObservedWorld

#: Slack for a bounded wait: its last back-off may overrun the deadline by that much.
WAIT_SLACK_US = 60_000


@invariant(
    "no-corrupt-accept",
    "every frame a consumer accepts is one a producer sent, in the order sent, none twice (checked by content, "
    "whatever the outcome; a vetoed chunk may leave a gap); every payload a get hands out is one a put was asked "
    "to send under that key, type for type and byte for byte",
)
def no_corrupt_accept(world: ObservedWorld) -> list[str]:
    out = []
    for s in world.streams.values():
        if not s.received_frames:
            continue
        sent = iter(s.sent_frames)
        for i, frame in enumerate(s.received_frames):
            # Consumes ``sent`` up to the frame: a frame sent earlier, or twice, is not found again.
            if not any(frame == candidate for candidate in sent):
                out.append(
                    f"request {s.request_id} accepted frame {i} {list(frame[:4])}… that no producer sent after the "
                    f"frames before it ({len(s.received_frames)} frames received, {len(s.sent_frames)} sent)"
                )
                break
    return out


@invariant(
    "no-residue-after-sweep",
    "a sweep removes every name of a namespace whose owner is dead, and none of a namespace whose owner lives; "
    "a process's own sweep as it exits removes every name of its namespace but the ones that are not ours",
)
def no_residue_after_sweep(world: ObservedWorld) -> list[str]:
    out = []
    dead_at: dict[str, int] = {}  # namespace -> event index its owner was seen dead at
    for ev in world.trace:
        if ev.name == "world.owner_died":
            dead_at[str(ev.attrs["ns"])] = ev.index
        elif ev.name == "sweep.removed" and str(ev.attrs["ns"]) not in dead_at:
            out.append(f"the sweep removed {ev.attrs['name']}, of namespace {ev.attrs['ns']} whose owner lives")
    for snap in world.snapshots:
        if snap.label == "at exit":
            out.extend(
                f"the exit sweep of {name} by its owner left {', '.join(store.names[:5])}"
                for name, store in snap.stores.items()
                if store.names
            )
        if snap.label != "after sweep":
            continue
        for name, store in snap.stores.items():
            left = store.segments + store.lock_files + store.rings + store.spares
            left += ["its owner record"] if store.owner_record else []
            if store.owner_dead and left:
                out.append(f"after the sweep, {name} still holds {', '.join(left[:5])}")
    return out


@invariant(
    "bounded-wait",
    "no wait outlives its stated deadline (in virtual time): a put waiting for a key's lock file gives up in time",
)
def bounded_wait(world: ObservedWorld) -> list[str]:
    out = []
    open_waits: dict[tuple[str, str, str], tuple[int, int]] = {}  # (task, what, key) -> (start, limit)
    for ev in world.trace:
        if ev.name == "wait.begin":
            open_waits[(ev.task, str(ev.attrs["what"]), str(ev.attrs["key"]))] = (ev.time_us, int(ev.attrs["limit_us"]))  # type: ignore[arg-type]
        elif ev.name == "wait.end":
            begun = open_waits.pop((ev.task, str(ev.attrs["what"]), str(ev.attrs["key"])), None)
            if begun is not None and ev.time_us - begun[0] > begun[1] + WAIT_SLACK_US:
                out.append(
                    f"{ev.task} waited {(ev.time_us - begun[0]) / 1e6:g}s for the {ev.attrs['what']} of "
                    f"{ev.attrs['key']}, past its {begun[1] / 1e6:g}s deadline"
                )
    for (task, what, key), (start, limit) in open_waits.items():
        if world.end_time_us - start > limit + WAIT_SLACK_US:
            out.append(
                f"{task} still waited for the {what} of {key} {(world.end_time_us - start) / 1e6:g}s after it "
                f"began, past its {limit / 1e6:g}s deadline"
            )
    return out


@invariant(
    "bad-input-refused",
    "an invalid key, request id, text or payload is refused with the error for it, and the valid input next to it "
    "goes through unchanged (checked by the hostile-input scenarios)",
)
def bad_input_refused(world: ObservedWorld) -> list[str]:
    return world.missed_cases("input.case", "{what}: got {got}, must give {want}")


@invariant(
    "foreign-names-untouched",
    "what a hostile or careless user left in /dev/shm next to the run's names (another user's FIFO, a file or a "
    "symlink where a FIFO or a folder of ours belongs, a folder that is not ours) is never written to, followed or "
    "removed; a FIFO of ours with no reader (a dead receiver's) is removed (checked by the hostile-/dev/shm scenario)",
)
def foreign_names_untouched(world: ObservedWorld) -> list[str]:
    return world.missed_cases("shm.planted", "{what}: it was {got}, it must be {want}")


#: What may make a put or a get fail: something the world did to the data plane.
CAUSES = ("fault", "process.killed", "process.paused", "kernel.killed", "world.owner_died", "stage.died")
#: How a scenario names a fault it makes itself (``fault`` alone is the fault plan's).
FAULT_OF_A_SCENARIO = "fault."
#: A put or a get that failed: a storage or encoding error, a corrupt chunk, a chunk that never comes.
FAILURES = ("shm.put.failed", "shm.get.corrupt", "adapter.receive_failed")


@invariant(
    "failures-have-causes",
    "a put or a get fails (a storage error, a corrupt chunk, a chunk that will never arrive) only after the world "
    "gave a cause: an injected fault, a killed or paused process",
)
def failures_have_causes(world: ObservedWorld) -> list[str]:
    out = []
    for ev in world.trace:
        if ev.name in CAUSES or ev.name.startswith(FAULT_OF_A_SCENARIO):
            return out  # from here on a failure may be what that caused
        if ev.name in FAILURES:
            what = ", ".join(f"{k}={v}" for k, v in sorted(ev.attrs.items()))
            out.append(
                f"{ev.task}: {ev.name} ({what}) with no fault injected and no process killed or paused before it"
            )
    return out


#: The ring's layout (``runtime.connectors.ring``'s docstring), restated so that the oracle below
#: reads a ring's bytes with code of its own.
RING_HEADER = 64
RING_ALIGN = 64
_RING_WORDS = struct.Struct("<QQ")  # head, tail at byte 16
_RING_FRAME = struct.Struct("<IIQQ")  # state, key length, payload length, span
_RING_RETIRED = struct.Struct("<I")  # at byte 36
_RING_FINISHED = (3, 4, 5)  # DONE, CANCELLED, PAD: space a reserve may take back


def _aligned(n: int) -> int:
    return -(-n // RING_ALIGN) * RING_ALIGN


def ring_max_payload(capacity: int, fraction: float = 0.25) -> int:
    """The largest payload a ring of ``capacity`` bytes carries (upstream: a quarter of it), capped
    so that a frame with the longest key (256 bytes with its header) fits beside any remainder at
    the ring's end. Restated, not imported from ``RingSettings.max_payload``: a runtime that sends
    smaller payloads to segments than the rule says must not set the bar it is checked against."""
    data = capacity - RING_HEADER
    return min(int(data * fraction), data // 2 - 2 * 256)


#: Frames that hold ring space for good unless someone moves them on, by state: a chunk nobody
#: took yet (READY), one being written (WRITING), a write a cleanup aborted that no commit
#: turned into CANCELLED (ABORTED). The tail never passes them.
_RING_HELD = {1: "being written", 2: "unread", 6: "aborted"}


def _ring_frames(view: memoryview) -> Iterator[tuple[int, int, str, int]]:
    """``(pos, state, key, span)`` of every frame from the tail to the head of the ring whose bytes
    are ``view``, oldest first."""
    data = len(view) - RING_HEADER
    if data < RING_ALIGN:
        return
    head, pos = _RING_WORDS.unpack_from(view, 16)
    for _ in range(data // RING_ALIGN):  # (at most one frame per aligned slot: garbage cannot loop it)
        if pos >= head:
            return
        at = RING_HEADER + pos % data
        state, key_len, _, span = _RING_FRAME.unpack_from(view, at)
        if span <= 0:
            return  # a producer killed between reserving a frame and describing it
        key = bytes(view[at + _RING_FRAME.size : at + _RING_FRAME.size + key_len]).decode("ascii", "replace")
        yield pos, state, key, span
        pos += span


def ring_retired(view: memoryview) -> bool:
    """Whether the ring whose bytes are ``view`` was retired (found corrupt: no reader takes a
    frame of it any more)."""
    return len(view) >= RING_HEADER and _RING_RETIRED.unpack_from(view, 36)[0] != 0


def ring_unread_keys(view: memoryview, *, written: bool = False) -> set[str]:
    """The keys whose chunks the ring whose bytes are ``view`` holds unread or being written
    (``written``: unread only, their write committed)."""
    states = (2,) if written else (1, 2)
    return {key for _, state, key, _ in _ring_frames(view) if state in states}


def ring_frames_held(view: memoryview) -> list[str]:
    """``KEY (why)`` for every frame between the tail and the head of the ring whose bytes are
    ``view`` that holds its space (see :data:`_RING_HELD`)."""
    return [f"{key} ({_RING_HELD[state]})" for _, state, key, _ in _ring_frames(view) if state in _RING_HELD]


def ring_room(view: memoryview, key: str, nbytes: int) -> tuple[int, int]:
    """``(free, needed)``: the bytes a put of ``nbytes`` under ``key`` could have on the ring whose
    bytes are ``view`` once every finished frame at its front is released (a frame that would run
    past the end starts the ring over, and the remainder counts as taken), and the bytes its frame
    takes. The put had room if ``free >= needed``."""
    data = len(view) - RING_HEADER
    head, tail = _RING_WORDS.unpack_from(view, 16)
    for pos, state, _, span in _ring_frames(view):
        if state not in _RING_FINISHED:
            break
        tail = pos + span
    needed = _aligned(_RING_FRAME.size + len(key.encode("ascii"))) + _aligned(nbytes)
    offset = head % data
    remainder = data - offset if offset + needed > data else 0
    return data - (head - tail) - remainder, needed


@invariant(
    "ring-before-segments",
    "on an edge with a ring, a put whose payload fits the ring goes on it; it takes a segment only while the key's "
    "unread payload is in one, or when the ring could not be made, or stayed held, or stayed full (no room even "
    "once every finished frame is released) for the whole wait",
)
def ring_before_segments(world: ObservedWorld) -> list[str]:
    if world.ring_max_payload is None:
        return []
    out = []
    excused: dict[str, bool] = {}  # task -> its put in flight may take a segment
    putting: dict[str, str] = {}  # task -> the key of its last put
    in_segment: set[str] = set()  # keys some put placed in a segment, not cleaned up since
    via: dict[str, str] = {}  # task -> where its put in flight goes
    for ev in world.trace:
        key = str(ev.attrs.get("key", ""))
        if ev.name == "shm.put.begin":
            excused[ev.task] = key in in_segment
            putting[ev.task] = key
        elif ev.name in ("ring.full", "ring.unavailable"):
            excused[ev.task] = True
        elif ev.name == "shm.put.created":
            via[ev.task] = str(ev.attrs.get("via"))
        elif ev.name == "shm.put.reserved" and via.pop(ev.task, None) == "segment":
            in_segment.add(key)
            nbytes = int(ev.attrs["bytes"])  # type: ignore[arg-type]
            if nbytes <= world.ring_max_payload and not excused.get(ev.task, False):
                out.append(
                    f"{ev.task} put {key} ({nbytes} bytes; the ring carries up to {world.ring_max_payload}) in a "
                    "segment, though the ring was neither full nor held and the key had no unread segment"
                )
            # (a put of the same key still deciding, in another task, now finds it in a segment)
            excused.update({task: True for task, k in putting.items() if k == key and task != ev.task})
        elif ev.name == "shm.cleanup.begin":
            in_segment.discard(key)
    return out


@invariant(
    "full-store-clean",
    "a full /dev/shm fails a put cleanly, naming the cause, and only when what is unread leaves no room: spares "
    "and consumed chunks give way first, and what fit comes back whole (checked by the full-store scenario)",
)
def full_store_clean(world: ObservedWorld) -> list[str]:
    return world.missed_cases("room.case", "{what}: got {got}, must give {want}")


@invariant(
    "answers-true",
    "what a connector answers is what it did: a put's result (its bytes and the key its metadata names, or no "
    "bytes and the cause; ok only if its chunk is in place, unread, when no get, cleanup or fault could have "
    "taken it meanwhile), a cleanup's whether it removed an unread chunk (a segment of ours, or a frame on the "
    "ring of an edge it put on, being written or unread), cleanup_prefix's count of those, a wait's whether its "
    "wakeup generation moved; and the frames it reports unread on the rings are the ones there",
)
def answers_true(world: ObservedWorld) -> list[str]:
    return world.missed_cases("connector.answer", "{what}: answered {got}, did {want}")


@invariant(
    "sweep-reports-true",
    "a sweep's report says what it did: what it removed (or would, in a dry run, which removes nothing), the "
    "namespaces it kept because their owner lives or cannot be judged or their names are too young, the names it "
    "skipped as not ours, the names it could not remove (checked by the sweep-report scenario)",
)
def sweep_reports_true(world: ObservedWorld) -> list[str]:
    return world.missed_cases("sweep.case", "{what}: {got}, where it must be {want}")


@invariant(
    "ring-writes-locked",
    "a ring's head and tail move only while its lock is held: whenever the lock is taken (and at quiescence) they are "
    "as its last holder left them, and a reader lets it go with the head where it found it (checked on every ring of "
    "a world's stores)",
)
def ring_writes_locked(world: ObservedWorld) -> list[str]:
    return [
        f"the {e.attrs['edge']} ring's head and tail were {e.attrs['found']} when its lock was {e.attrs['when']}, "
        f"though its last holder left them at {e.attrs['left']}"
        for e in world.trace
        if e.name == "ring.unlocked_write"
    ]


@invariant(
    "os-errors-clean",
    "a system call of the store that fails (EIO, ENOSPC) or moves fewer bytes than asked fails the put or get it "
    "struck cleanly, naming the error, never as a raw OSError, and leaves the other chunks whole (checked by the "
    "os-errors scenario)",
)
def os_errors_clean(world: ObservedWorld) -> list[str]:
    return world.missed_cases("os.case", "{what}: got {got}, must give {want}")


@invariant(
    "store-model-faithful",
    "the store in memory that simulated runs stand on does what the real store does on a tmpfs of the same room, "
    "call by call: the same result or error, the same names, handles open and room left (checked by the "
    "store-model scenario)",
)
def store_model_faithful(world: ObservedWorld) -> list[str]:
    return world.missed_cases("model.case", "{what}: in memory {got}; on a tmpfs {want}")
