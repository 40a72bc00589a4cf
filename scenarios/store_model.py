"""The simulated /dev/shm against the real one (issue 11: the store every simulated run stands on).

A run on the memory store trusts :class:`~runtime.connectors.stores.MemoryStore` to do what
:class:`~runtime.connectors.posix_store.PosixStore` does on a tmpfs: which names exist, which calls
succeed and which fail with what error, what a consumed segment leaves as a spare and which spare a
put takes, what a lock or a ring's lock grants to a second handle, how much room is left. If the
model drifts from the real store, every schedule explored on it checks a system that does not
exist. So here the two run the same script of store calls side by side, each in the same room (the
real one in a private tmpfs of that size and inode count, the model counting the same pages and
names). Both are fresh stores of the scenario's own, whatever store the world runs on.

The scripts walk what the connector does with a store — segments made, reserved, written, read,
replaced, retired into spares and taken again; lock files and rings opened twice and locked against
each other, closed twice, unlinked under an open handle; the room filled for space and for names,
where spares must give way; a sweep — and after every call ``store-model-faithful`` compares the two
stores: the call's result or error, then the names of each kind, the handles open and the room
left. Nothing here is drawn at random: one run is the whole check.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from omnisim import devshm, tmpfs
from omnisim.registry import DEFAULT_INVARIANTS, Param, Params, scenario
from omnisim.sim_kernel import MAIN_PROCESS
from omnisim.world import Room, World, make_store
from runtime.connectors.namespaces import OWNER_SUFFIX
from runtime.connectors.posix_store import PosixStore
from runtime.connectors.stores import MemoryStore, Store
from runtime.kernel import current_kernel

PAGE = mmap.PAGESIZE
#: Segments from two pages on are kept as spares.
SPARE_MIN_BYTES = 2 * PAGE
#: A store with room to spare (the scripts about what calls do, not about a full store).
AMPLE = Room(bytes=256 * PAGE, names=64, spare_min_bytes=SPARE_MIN_BYTES)
#: The kinds of name a real store's sweep reports, by the stem after the namespace.
SWEPT_KINDS = {"seg-": "segment", "lock-": "lock", "ring-": "ring", "spare-": "spare"}


class Side:
    """One of the two stores, and the handles the script holds on it, by the script's names."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.handles: dict[str, Any] = {}
        #: The segments whose reserve succeeded, by key.
        self.reserved: set[str] = set()

    def keep(self, name: str, handle: object) -> object:
        if handle is not None:
            self.handles[name] = handle
        return handle

    def room_left(self) -> str:
        """Bytes and names still free, as the tmpfs counts them (the model: its own count)."""
        if isinstance(self.store, PosixStore):
            st = os.statvfs(self.store.directory)
            return f"{st.f_bfree * st.f_frsize} bytes, {st.f_ffree} names"
        assert isinstance(self.store, MemoryStore) and self.store.capacity is not None
        assert self.store.max_names is not None
        names = self.store.max_names - self.store.names_used()
        return f"{self.store.capacity - self.store.used()} bytes, {names} names"

    def state(self) -> str:
        s = self.store
        return (
            f"segments {s.segments()}, spares {s.spares()}, locks {s.lock_files()}, rings {s.rings()}, "
            f"open {s.open_handles()}, {self.room_left()} left"
        )

    def plain(self, text: str) -> str:
        """``text`` without what differs between the two stores and from run to run: the real
        store's folder and namespace."""
        if isinstance(self.store, PosixStore):
            text = text.replace(self.store.directory, "/dev/shm").replace(self.store.namespace, "NS")
        return text


def shown(result: object) -> str:
    if isinstance(result, bytes):
        return f"{len(result)} bytes, xxh64 {xxhash.xxh64_hexdigest(result)}"
    if result is None or isinstance(result, bool | int | str | list):
        return repr(result)
    return "a handle"


class Twins:
    """The model and the real store; every call goes to both, and what each gave is noted."""

    def __init__(self, model: Store, real: Store) -> None:
        self.model, self.real = Side(model), Side(real)

    def do(self, what: str, call: Callable[[Side], object]) -> None:
        got, want = (self._outcome(side, call) for side in (self.model, self.real))
        k = current_kernel()
        k.note("model.case", what=what, got=got, want=want)
        k.note("model.case", what=f"the store after: {what}", got=self.model.state(), want=self.real.state())

    @staticmethod
    def _outcome(side: Side, call: Callable[[Side], object]) -> str:
        try:
            return shown(call(side))
        except Exception as e:  # (the outcome to compare: the real store's errors are the contract)
            return side.plain(f"{type(e).__name__}: {e}")

    # -- segments ----------------------------------------------------------------------------

    def put(self, key: str, size: int) -> None:
        """What a put does with the store: make the segment, reserve, write, close; a segment
        that could not be reserved is closed and removed unwritten, as the put's rollback does."""
        self.do(f"create segment {key}", lambda s: s.keep(key, s.store.create_segment(key)))
        self.do(f"reserve {size} bytes for {key}", lambda s: reserve(s, key, size))
        self.do(f"write {key}, or roll it back", lambda s: write_or_roll_back(s, key, size))
        self.do(f"segment {key} exists", lambda s: s.store.segment_exists(key))

    def take(self, key: str) -> None:
        """Open ``key``, read all of it, close it, retire it (a consumer's get and cleanup)."""
        self.do(f"read {key}", lambda s: read_all(s, key))
        self.do(f"retire segment {key}", lambda s: s.store.retire_segment(key))

    def close(self, name: str) -> None:
        self.do(f"close {name}", lambda s: s.handles[name].close() if name in s.handles else "no handle")

    def sweep(self) -> None:
        self.do("sweep", lambda s: sorted(s.plain(swept(name)) for name in s.store.sweep()))


def pattern(key: str, size: int) -> bytes:
    """``size`` bytes that say which key and size they were written for."""
    stem = f"{key}:{size};".encode()
    return (stem * (size // len(stem) + 1))[:size]


def reserve(side: Side, key: str, size: int) -> str:
    side.reserved.discard(key)
    if key not in side.handles:
        return "no segment to reserve"
    side.handles[key].reserve(size)
    side.reserved.add(key)
    return "reserved"


def write_or_roll_back(side: Side, key: str, size: int) -> str:
    segment = side.handles.pop(key, None)
    if segment is None:
        return "no segment to write"
    try:
        if key not in side.reserved:
            return f"rolled back: {side.store.unlink_segment(key)}"
        segment.write(0, pattern(key, size))
        return "written"
    finally:
        segment.close()


def lock_step(handle: Any, verb: str) -> bool | None:
    """A lock file's or a ring's handle ``acquires`` / ``locks``, or ``releases`` / ``unlocks``."""
    if verb == "acquires":
        return handle.try_acquire()
    if verb == "locks":
        return handle.try_lock()
    return handle.release() if verb == "releases" else handle.unlock()


def read_all(side: Side, key: str) -> bytes | None:
    segment = side.store.open_segment(key)
    if segment is None:
        return None
    try:
        out = np.empty(segment.size, np.uint8)
        segment.read_into(0, out)
        return out.tobytes()
    finally:
        segment.close()


def swept(name: str) -> str:
    """A sweep's report of one name, as the model words it: ``segment K``, ``owner``, …"""
    if name.endswith(f"-{OWNER_SUFFIX}") or name == OWNER_SUFFIX:
        return OWNER_SUFFIX
    for stem, kind in SWEPT_KINDS.items():
        if f"-{stem}" in name:
            return f"{kind} {name.split(f'-{stem}', 1)[1]}"
    return name


# == the scripts ==================================================================================


def spares(t: Twins) -> None:
    """Which consumed segment becomes a spare, which spare a put takes, and what it reads as."""
    t.put("a", PAGE)
    t.take("a")  # too small to keep
    t.put("b", SPARE_MIN_BYTES)
    t.take("b")  # the smallest kept
    t.put("c", SPARE_MIN_BYTES - 1)  # too small to take one
    t.put("d", 3 * PAGE)  # takes b, grown
    t.take("c")
    t.take("d")
    t.put("e", SPARE_MIN_BYTES)  # takes d, shrunk: the bytes past its trailer are d's
    t.do("read e, a spare's old bytes and all", lambda s: read_all(s, "e"))
    for key, pages in (("f", 2), ("g", 3), ("h", 4), ("i", 5), ("j", 6)):
        t.put(key, pages * PAGE)
    for key in "efghij":
        t.take(key)  # a namespace keeps a few spares, no more
    t.put("k", 3 * PAGE)  # the smallest spare that holds it
    t.put("l", 9 * PAGE)  # none holds it: the largest, grown
    t.do("remove spare f", lambda s: s.store.remove_spare("f"))
    t.do("remove spare f again", lambda s: s.store.remove_spare("f"))
    t.do("remove spare zz, never made", lambda s: s.store.remove_spare("zz"))
    t.do("unlink segment k", lambda s: s.store.unlink_segment("k"))
    t.do("unlink segment k again", lambda s: s.store.unlink_segment("k"))
    t.do("retire segment k, gone", lambda s: s.store.retire_segment("k"))
    t.do("open segment k, gone", lambda s: s.store.open_segment("k"))
    t.put("m", PAGE)
    t.put("m", 3 * PAGE)  # replaces m's unread segment
    t.take("m")
    t.sweep()  # spares and all


def locks_and_rings(t: Twins) -> None:
    """What a lock file's and a ring's lock grant to a second handle; closing twice; a name
    removed or replaced under an open handle."""
    t.do("open lock x, not made", lambda s: s.store.open_lock("x", create=False))
    t.do("make lock x as h1", lambda s: s.keep("h1", s.store.open_lock("x", create=True)))
    t.do("open lock x as h2", lambda s: s.keep("h2", s.store.open_lock("x", create=False)))
    for step in ("h1 acquires", "h2 acquires", "h1 acquires again", "h1 releases", "h2 acquires", "h1 acquires"):
        handle, verb = step.split()[:2]
        t.do(step, lambda s, h=handle, v=verb: lock_step(s.handles[h], v))
    t.do("h1 is current", lambda s: s.handles["h1"].is_current())
    t.close("h2")  # (it held the lock: closing lets it go)
    t.do("h1 acquires after h2 closed", lambda s: s.handles["h1"].try_acquire())
    t.do("remove lock x", lambda s: s.store.remove_lock("x"))
    t.do("h1 is current, its name gone", lambda s: s.handles["h1"].is_current())
    t.do("remove lock x again", lambda s: s.store.remove_lock("x"))
    t.do("make lock x anew as h3", lambda s: s.keep("h3", s.store.open_lock("x", create=True)))
    t.do("h3 acquires, h1 holding the old file's", lambda s: s.handles["h3"].try_acquire())
    for name in ("h1", "h1", "h3"):
        t.close(name)

    t.do("open ring r, not made", lambda s: s.store.open_ring("r"))
    t.do("make ring r as r1", lambda s: s.keep("r1", s.store.create_ring("r", 4 * PAGE)))
    t.do("open ring r as r2", lambda s: s.keep("r2", s.store.open_ring("r")))
    t.do("r2's bytes", lambda s: len(s.handles["r2"].view))
    for step in ("r1 locks", "r2 locks", "r1 locks again", "r1 unlocks", "r2 locks"):
        handle, verb = step.split()[:2]
        t.do(step, lambda s, h=handle, v=verb: lock_step(s.handles[h], v))
    t.close("r2")  # (it held the lock: closing lets it go)
    t.do("r1 locks after r2 closed", lambda s: s.handles["r1"].try_lock())
    t.do("make ring r anew as r3, r1 open", lambda s: s.keep("r3", s.store.create_ring("r", 8 * PAGE)))
    t.do("open ring r as r4", lambda s: s.keep("r4", s.store.open_ring("r")))
    t.do("r4's bytes", lambda s: len(s.handles["r4"].view))
    t.do("r4 locks, r1 holding the old ring's", lambda s: s.handles["r4"].try_lock())
    t.do("unlink ring r, only if it is r1's", lambda s: s.store.unlink_ring("r", only=s.handles["r1"]))
    t.do("unlink ring r, only if it is r4's", lambda s: s.store.unlink_ring("r", only=s.handles["r4"]))
    t.do("unlink ring r again", lambda s: s.store.unlink_ring("r"))
    for name in ("r1", "r1", "r3", "r4"):
        t.close(name)
    t.do("r1 is closed", lambda s: s.handles["r1"].closed)
    t.do("r1 locks once closed", lambda s: s.handles["r1"].try_lock())
    t.sweep()


def full_space(t: Twins) -> None:
    """Space runs out: an exact fit, a reserve refused, spares giving way to a segment and to a
    ring's bytes. The room: 16 pages, one of them the owner record's."""
    for key in "abc":
        t.put(key, 4 * PAGE)
    t.put("d", 3 * PAGE)  # exactly full
    t.put("e", 1)  # refused
    t.take("a")
    t.take("b")  # two spares hold the room now
    t.put("f", 5 * PAGE)  # a spare too small to grow here: the spares give way
    t.take("c")
    t.do("make ring r of 4 pages as r1", lambda s: s.keep("r1", s.store.create_ring("r", 4 * PAGE)))
    t.close("r1")
    t.put("g", PAGE)
    t.put("h", 8 * PAGE)
    t.do("make ring s of 16 pages, more than the room", lambda s: s.store.create_ring("s", 16 * PAGE))
    t.sweep()


def exact_fit(t: Twins) -> None:
    """Segments that fill the room to the last page: beside a spare, which stays, and once the
    spare gave way; then a spare that grows into the last pages beside another, which stays.
    The room: 16 pages, one of them the owner record's."""
    for key, pages in (("a", 2), ("b", 4), ("c", 5), ("d", 2)):
        t.put(key, pages * PAGE)
    t.take("a")  # a spare of two pages; two pages free
    t.put("y", SPARE_MIN_BYTES - 1)  # too small to take the spare: the last two pages, the spare kept
    t.put("z", SPARE_MIN_BYTES - 1)  # the spare gives way: exactly its pages
    t.take("b")
    t.take("y")  # unkept (too small): two pages free, beside b's spare of four
    t.take("d")  # a second spare, of two pages
    t.put("w", 6 * PAGE)  # b's spare grows into the last two pages; d's stays
    t.sweep()


def full_names(t: Twins) -> None:
    """Names run out: spares giving way to a segment's, a lock file's and a ring's name; a
    segment retired with no name left for its spare. The room: 6 names besides the owner's."""
    t.put("a", PAGE)
    t.put("b", PAGE)
    t.take("a")
    t.take("b")  # two spares
    for lock in ("l1", "l2", "l3"):
        t.do(f"make lock {lock}", lambda s, lock=lock: s.keep(lock, s.store.open_lock(lock, create=True)))
    t.put("c", PAGE)  # the last name
    t.put("d", PAGE)  # the spares give way
    t.put("e", PAGE)
    t.put("f", PAGE)  # refused: no name left, no spare to give way
    t.take("c")  # no name left for its spare
    t.take("d")
    t.do("make ring r as r1", lambda s: s.keep("r1", s.store.create_ring("r", PAGE)))
    t.do("make ring s as r2, the spare giving way", lambda s: s.keep("r2", s.store.create_ring("s", PAGE)))
    t.do("make ring s anew as r3, no name left", lambda s: s.keep("r3", s.store.create_ring("s", PAGE)))
    t.do("make lock l4, no name left", lambda s: s.keep("l4", s.store.open_lock("l4", create=True)))
    t.do("open lock l5, not made, no name left", lambda s: s.store.open_lock("l5", create=False))
    t.do("remove lock l1", lambda s: s.store.remove_lock("l1"))
    t.do("make lock l4, l1 open though unnamed", lambda s: s.keep("l4", s.store.open_lock("l4", create=True)))
    t.close("l1")
    t.do("make lock l4", lambda s: s.keep("l4", s.store.open_lock("l4", create=True)))
    for name in ("l2", "l3", "l4", "r1", "r2", "r3"):
        t.close(name)
    t.sweep()


SCRIPTS: dict[str, tuple[Callable[[Twins], None], Room]] = {
    "spares": (spares, AMPLE),
    "locks_and_rings": (locks_and_rings, AMPLE),
    "full_space": (full_space, Room(bytes=16 * PAGE, names=64, spare_min_bytes=SPARE_MIN_BYTES)),
    "exact_fit": (exact_fit, Room(bytes=16 * PAGE, names=64, spare_min_bytes=SPARE_MIN_BYTES)),
    "full_names": (full_names, Room(bytes=64 * PAGE, names=6, spare_min_bytes=PAGE)),
}


def model_world(store_kind: str, params: Params) -> World:
    return World(store_kind)


def unavailable(store: str) -> str | None:
    """The real store's room is a private tmpfs, whichever store the world runs on."""
    return tmpfs.why_unavailable()


def twins(world: World, room: Room) -> Twins:
    """Two fresh stores of ``room``: (model, real), the real one in a private tmpfs of its own.
    (Not the world's: the scripts sweep their stores, owner records and all.)"""
    directory = devshm.mounted(tmpfs.mount(room.bytes, room.names + 2))
    real = make_store("posix", spare_min_bytes=room.spare_min_bytes, directory=directory)
    model = make_store("memory", world.owners[MAIN_PROCESS], spare_min_bytes=room.spare_min_bytes, room=room)
    return Twins(model, real)


@scenario(
    "store_model_agrees",
    summary="the in-memory store every simulated run stands on does what the real one does on a tmpfs of the same "
    "room, call by call: the same results and errors, the same names of each kind, the same handles open and the "
    "same room left, for spares, locks, rings, a full store (space and names) and a sweep",
    issue="issue 11 (the model the simulator runs on, checked against the real /dev/shm)",
    build=model_world,
    params=(Param("script", tuple(SCRIPTS), "which store calls the two run side by side"),),
    invariants=(*DEFAULT_INVARIANTS, "store-model-faithful"),
    # One run is the whole check: the script has no await for a schedule to reorder.
    budget_share=0.05,
    unavailable=unavailable,
)
async def store_model_agrees(world: World) -> None:
    script, room = SCRIPTS[world.params["script"]]
    script(twins(world, room))
