"""A /dev/shm whose system calls fail (omnisim issue 9: a hostile /dev/shm beyond a full one).

A full /dev/shm is one way a store's system calls fail; ``store_fills_up`` makes it happen for
real. The others — an I/O error, a write or a read that moves fewer bytes than asked — cannot be
provoked on a healthy tmpfs, so the store's own handling of them ran nowhere. Here, for one run,
the ``os`` module the POSIX store calls stands behind a proxy that makes the first call of one
function fail (``EIO``, or ``ENOSPC`` for a write) or come back short, and notes that as the
fault it is; every other call is the real one. Through that, the Talker puts three chunks (the
second takes the spare the first left, the third is small enough for the edge's ring, where
there is one), Code2Wav takes each, and the Talker cleans each up.

Each outcome is an ``os.case`` note that ``os-errors-clean`` compares with what it must be: a put
succeeds, or fails cleanly naming the error, and only if the fault struck it; a get hands back
the chunk whole, or nothing if its put failed, or, if the fault struck the get, a corrupt chunk
naming the error (a short read: that the segment ended early) or nothing now and the chunk whole
at the next get; nothing the runtime raises is a raw ``OSError``. The residue invariants check that
nothing is left.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from omnisim.faults import InjectedCrash
from omnisim.registry import DEFAULT_INVARIANTS, Param, Params, scenario
from omnisim.world import World
from runtime.connectors import namespaces, posix_store, wakeup
from runtime.connectors.base import CorruptChunk
from runtime.connectors.posix_store import PosixStore
from runtime.kernel import current_kernel
from scenarios.edge import CODE2WAV, TALKER, edge_world

#: Which call fails, and how: ``(function, errno, n)``, the ``n``-th call of ``function``; errno
#: None: it moves half the bytes. (The opens: a put's segment and lock file, then a get's lock
#: file and segment; the later ``fstat`` calls include a reader's look at the edge's ring.)
FAILURES: dict[str, tuple[str, int | None, int]] = {
    "open_eio": ("open", errno.EIO, 1),
    "open_eio_3": ("open", errno.EIO, 3),
    "open_eio_4": ("open", errno.EIO, 4),
    "fallocate_eio": ("posix_fallocate", errno.EIO, 1),
    "pwrite_eio": ("pwrite", errno.EIO, 1),
    "pwrite_enospc": ("pwrite", errno.ENOSPC, 1),
    "pwrite_short": ("pwrite", None, 1),
    "pread_eio": ("pread", errno.EIO, 1),
    "pread_short": ("pread", None, 1),
    "preadv_eio": ("preadv", errno.EIO, 1),
    "preadv_short": ("preadv", None, 1),
    "ftruncate_eio": ("ftruncate", errno.EIO, 1),
    "rename_eio": ("rename", errno.EIO, 1),
    "link_eio": ("link", errno.EIO, 1),
    **{f"unlink_eio_{n}": ("unlink", errno.EIO, n) for n in range(1, 7)},
    **{f"fstat_eio_{n}": ("fstat", errno.EIO, n) for n in range(1, 7)},
}
#: The chunks, by key: int64 elements (the first two go to segments, the third fits a ring).
CHUNKS = {"O_1_0": 2048, "O_1_1": 1536, "O_1_2": 32}
ROUND_TRIP = "round trip"
EDGE = (str(TALKER), str(CODE2WAV))
#: What a clean failure of each kind names: a short read, that the segment ended early.
NAMED = {errno.EIO: os.strerror(errno.EIO), errno.ENOSPC: "/dev/shm is full", None: "ended after"}


class FailingOs:
    """The ``os`` module, but for the ``nth`` call of ``function`` made through it: that one fails
    with ``error``, or (``error`` None) moves only half its bytes."""

    def __init__(self, function: str, error: int | None, nth: int) -> None:
        self.function = function
        self.error = error
        self.calls_left = nth
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        return self._failing(real) if name == self.function else real

    def _failing(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls_left -= 1
            if self.fired or self.calls_left:
                return real(*args, **kwargs)
            self.fired = True
            how = errno.errorcode[self.error] if self.error is not None else "short"
            # (its own name: the fault plan's "fault" events are what a shrinker replays)
            current_kernel().note("fault.os", at=self.function, errno=how)
            if self.error is not None:
                raise OSError(self.error, os.strerror(self.error))
            fd, data, offset = args
            if self.function == "pwrite":
                view = memoryview(data).cast("B")
                return real(fd, view[: len(view) // 2], offset, **kwargs)
            if self.function == "pread":
                return real(fd, data // 2, offset, **kwargs)
            out = memoryview(data[0]).cast("B")
            return real(fd, [out[: len(out) // 2]], offset, **kwargs)

        return call


def os_world(store_kind: str, params: Params) -> World:
    return edge_world(store_kind)


def unavailable(store: str) -> str | None:
    return "only a POSIX store makes system calls" if store == "memory" else None


def payload(key: str) -> dict[str, torch.Tensor]:
    return {"codes": torch.arange(CHUNKS[key], dtype=torch.int64) * (int(key[-1]) + 1)}


def note_case(what: str, got: str, want: str) -> None:
    current_kernel().note("os.case", what=what, got=got, want=want)


@scenario(
    "os_errors",
    summary="the first call of one system call the POSIX store makes fails (EIO, ENOSPC on a write) or moves half "
    "its bytes: each put succeeds or fails cleanly naming the error, each get hands the chunk back whole (or "
    "nothing, or a corrupt chunk naming the error, where the fault struck), no raw OSError escapes, nothing is left",
    issue="omnisim issue 9 (a hostile /dev/shm: every storage error a clean failure), issue 11 (the store's "
    "error paths)",
    build=os_world,
    params=(Param("call", tuple(FAILURES), "which system call fails first, and how"),),
    invariants=(*DEFAULT_INVARIANTS, "os-errors-clean"),
    unavailable=unavailable,
)
async def os_errors(world: World) -> None:
    assert isinstance(world.store, PosixStore)
    function, error, nth = FAILURES[world.params["call"]]
    failing = FailingOs(function, error, nth)
    talker, code2wav = world.stages[TALKER].connector, world.stages[CODE2WAV].connector
    posix_store.os = failing  # type: ignore[assignment]
    # Each payload stays alive until the end: freed after its put, its memory would be what the
    # get's new tensor is given, already holding the right values, and a read that filled half of
    # it would pass for a whole one.
    sent = {key: payload(key) for key in CHUNKS}
    try:
        for key in CHUNKS:
            struck, faults = failing.fired, len(world.fired_faults())
            put = await _outcome(lambda key=key: talker.put(*EDGE, key, sent[key]))  # type: ignore[misc]
            put_struck = failing.fired and not struck
            want = f"ok, or a failure naming {NAMED[error]!r} and {key!r}" if put_struck else "ok"
            named = NAMED[error] in put and repr(key) in put
            got = want if put == "ok" or (put_struck and named) else put
            if len(world.fired_faults()) == faults:  # (one injected on top is the other invariants' to judge)
                note_case(f"the put of {key}", got, want)
            # (``faults`` is not counted again: a get after a put an injected fault struck, which may
            # have left a torn frame, is the other invariants' to judge too)
            struck = failing.fired
            taken = await _taken(code2wav, key, sent[key])
            get_struck = failing.fired and not struck
            if put != "ok":
                want = "nothing"
            elif get_struck:
                # (a get that could not look answers nothing now: the chunk is there for the next)
                want = f"{ROUND_TRIP} (now or at the next get), or a corrupt chunk naming {key} and {NAMED[error]!r}"
                if taken == "nothing":
                    taken = await _taken(code2wav, key, sent[key])
                named = taken.startswith(f"corrupt: corrupt chunk {key}: ") and NAMED[error] in taken
                taken = want if taken == ROUND_TRIP or named else taken
            else:
                want = ROUND_TRIP
            if len(world.fired_faults()) == faults:
                note_case(f"the get of {key}", taken, want)
        for key in CHUNKS:
            await _outcome(lambda key=key: talker.cleanup(key))  # type: ignore[misc]
    finally:
        posix_store.os = os


async def _outcome(call: Callable[[], Any]) -> str:
    """``ok``, a put's error, or how the call raised."""
    try:
        result = await call()
    except (InjectedCrash, CorruptChunk) as e:
        return f"raised {type(e).__name__}: {e}"
    except OSError as e:  # (a raw one: the store let it through)
        return f"raised a raw {type(e).__name__}: {e}"
    ok = getattr(result, "ok", True)
    return "ok" if ok else str((result.metadata or {}).get("error"))


async def _taken(code2wav: Any, key: str, sent: dict[str, torch.Tensor]) -> str:
    """How the get of ``key`` went: the round trip of ``sent``, nothing, a corrupt chunk, or a raw error."""
    try:
        taken = await code2wav.get(*EDGE, key)
    except CorruptChunk as e:
        return f"corrupt: {e}"
    except OSError as e:
        return f"raised a raw {type(e).__name__}: {e}"
    if taken is None:
        return "nothing"
    got = taken[0].get("codes") if isinstance(taken[0], dict) else None
    return ROUND_TRIP if isinstance(got, torch.Tensor) and torch.equal(got, sent["codes"]) else repr(got)[:80]


# == the store's own calls =========================================================================
#
# The connector-level run above cannot see a store call that swallows its error: the connector
# treats most of the store's answers as a hint (a cleanup that "removed" a lock file it did not
# remove leaves a name the exit sweep takes later). So here each call the store makes on behalf
# of a cleanup, a sweep or a reader meets the failure itself, and must say so: a StoreError of
# the right kind, naming the key and the error, with nothing changed — or, where nothing fails
# but the names are odd, the answer the names call for.


def _names(store: PosixStore) -> str:
    return f"segments {store.segments()}, spares {store.spares()}, locks {store.lock_files()}, rings {store.rings()}"


def _attempt(call: Callable[[], object], fails: tuple[str, int], nth: int = 1) -> str:
    """``call()`` while the ``nth`` call of ``fails[0]`` through ``os`` fails with ``fails[1]``:
    what it returned, or the error it raised as ``Type: message``."""
    failing = FailingOs(fails[0], fails[1], nth)
    # (a sweep removes through namespaces; the wakeup bus makes its FIFOs through wakeup)
    posix_store.os = namespaces.os = wakeup.os = failing  # type: ignore[assignment]
    try:
        result = call()
    except Exception as e:  # (the outcome to judge: which error, and what it names)
        return f"{type(e).__name__}: {e}"
    finally:
        posix_store.os = namespaces.os = wakeup.os = os
    return f"returned {result!r}"


def _must_refuse(
    store: PosixStore, what: str, call: Callable[[], object], fails: tuple[str, int], key: str, nth: int = 1
) -> None:
    """``call`` meets the failure ``fails`` (at the ``nth`` call of its function): it must raise
    the StoreError that errno calls for (:class:`ForeignName` for a refusal, :class:`StoreFull`
    for no room), naming ``key`` and the error, and change no name."""
    function, error = fails
    before = _names(store)
    got = _attempt(call, fails, nth).replace(store.namespace, "NS")  # (a fresh one each run: not in the trace)
    kind = {errno.EACCES: "ForeignName", errno.ENOSPC: "StoreFull"}.get(error, "StoreError")
    named = "/dev/shm is full" if error == errno.ENOSPC else os.strerror(error)
    want = f"{kind} naming {key!r} and {named!r}"
    # (a plain StoreError says "cannot <what> <key>: <the error>", as an OSError would)
    said = f"{key!r}: {named}" in got if kind == "StoreError" else repr(key) in got and named in got
    if got.startswith(f"{kind}: ") and said:
        got = want
    note_case(f"{what}, its {function} failing with {errno.errorcode[error]}", got, want)
    note_case(f"the names after {what} failed", _names(store), before)


def _segment(store: PosixStore, key: str, size: int = 4096) -> None:
    segment = store.create_segment(key)
    segment.reserve(size)
    segment.write(0, bytes(size))
    segment.close()


def _lock_file(store: PosixStore, key: str) -> None:
    lock = store.open_lock(key, create=True)
    assert lock is not None
    lock.close()


def _refused_calls(store: PosixStore) -> None:
    eio, eacces = errno.EIO, errno.EACCES
    _lock_file(store, "k")
    _must_refuse(store, "remove lock file k", lambda: store.remove_lock("k"), ("unlink", eio), "k")
    _must_refuse(store, "remove lock file k", lambda: store.remove_lock("k"), ("unlink", eacces), "k")
    store.remove_lock("k")
    _segment(store, "s")
    _must_refuse(store, "unlink segment s", lambda: store.unlink_segment("s"), ("unlink", eio), "s")
    _must_refuse(store, "retire segment s", lambda: store.retire_segment("s"), ("lstat", eio), "s")
    _must_refuse(store, "retire segment s", lambda: store.retire_segment("s"), ("link", eio), "s")
    store.retire_segment("s")  # (the world's store keeps every consumed segment as a spare)
    _must_refuse(store, "remove spare s", lambda: store.remove_spare("s"), ("unlink", eio), "s")
    store.remove_spare("s")
    _segment(store, "w")
    segment = store.create_segment("x")
    _must_refuse(store, "reserve segment x", lambda: segment.reserve(4096), ("posix_fallocate", eio), "x")
    segment.reserve(4096)
    _must_refuse(store, "write segment x", lambda: segment.write(0, bytes(4096)), ("pwrite", errno.ENOSPC), "x")
    segment.close()
    # A put that takes a spare looks twice at what it opened: whether the key still names its new
    # segment, then whether the spare is ours. The second look fails.
    _segment(store, "t")
    store.retire_segment("t")
    segment = store.create_segment("y")
    _must_refuse(store, "reserve y from a spare", lambda: segment.reserve(4096), ("fstat", eio), "y", nth=2)
    segment.close()
    store.unlink_segment("y")
    store.remove_spare("t")
    _must_refuse(
        store,
        "claim namespace oscase",
        lambda: PosixStore("oscase", claim=True, directory=store.directory),
        ("write", eio),
        "oscase",
    )
    note_case("names of namespace oscase after its claim failed", str(_named(store.directory, "oscase")), "[]")
    # (a sweep removes its owner record last: w's segment first)
    _must_refuse(store, "sweep", store.sweep, ("unlink", eio), "omnisim-NS-seg-w")
    for key in ("w", "x"):
        store.unlink_segment(key)


def _named(directory: str, namespace: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith(f"omnisim-{namespace}-"))


def _odd_names(store: PosixStore) -> None:
    """Names a death or a careless user leaves: a ring whose maker died before reserving its
    bytes; a spare with two names (its consumer died between linking it and unlinking the
    segment's name, as an unlink that fails there leaves it); a spare that is not ours."""
    with open(store.ring_path("e"), "x"):
        pass  # an empty ring file of ours, mode 0600 aside: made by hand below
    os.chmod(store.ring_path("e"), posix_store.MODE)
    try:
        got = f"{store.open_ring('e')!r}"
    except Exception as e:  # (the outcome to judge)
        got = f"{type(e).__name__}: {e}"
    want = "ForeignName naming 'e': its maker is still reserving its bytes"
    note_case(
        "open ring e, no bytes reserved yet", want if got.startswith("ForeignName") and "'e'" in got else got, want
    )
    store.unlink_ring("e")

    _segment(store, "a")
    _attempt(lambda: store.retire_segment("a"), ("unlink", errno.EIO))
    _segment(store, "b")  # the same size: it would take a's spare, but that one has two names
    note_case(
        "the names after b's put, a's spare having two names",
        _names(store),
        "segments ['a', 'b'], spares ['a'], locks [], rings []",
    )
    for key in ("a", "b"):
        store.unlink_segment(key)
    store.remove_spare("a")

    _segment(store, "f")
    store.retire_segment("f")
    spare = store.segment_path("f").replace("-seg-f", "-spare-f")
    os.chmod(spare, 0o644)  # (someone made it readable to all: no longer a name of ours)
    try:
        got = f"{store.remove_spare('f')}"
    except Exception as e:  # (the outcome to judge)
        got = f"{type(e).__name__}: {e}"
    got = "refused" if got.startswith("ForeignName: ") and "'f'" in got else got
    note_case("remove spare f, not ours", f"{got}, spares {store.spares()}", "refused, spares ['f']")
    os.chmod(spare, posix_store.MODE)
    # (as if another process removed it between the store's look and its unlink)
    got = _attempt(lambda: store.remove_spare("f"), ("unlink", errno.ENOENT))
    note_case("remove spare f, gone meanwhile", got, "returned False")
    store.remove_spare("f")
    note_case("remove spare f, gone", f"{store.remove_spare('f')}", "False")


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def _stdin_closed() -> Iterator[None]:
    """As in a process started with its standard input closed: the next descriptor opened is 0,
    a descriptor like any other."""
    saved = os.dup(0)
    os.close(0)
    try:
        yield
    finally:
        os.dup2(saved, 0)
        os.close(saved)


def _zero_open() -> bool:
    try:
        os.fstat(0)
    except OSError:
        return False
    return True


def _descriptor_zero(store: PosixStore) -> None:
    """A segment and a wakeup receiver that get descriptor 0 close it like any other."""
    with _stdin_closed():
        _segment(store, "z")
        note_case("descriptor 0 after a segment that had it closed", str(_zero_open()), "False")
        bus = wakeup.FifoWakeups(store.namespace, store.directory)
        got = _attempt(lambda: bus.generation("s1"), ("open", errno.EIO), 2)
        note_case(
            "descriptor 0 after a receiver whose FIFO could not open",
            f"{got}, {_zero_open()}",
            "returned None, False",
        )
        bus.close()
    store.unlink_segment("z")


def _wakeup_calls(store: PosixStore) -> None:
    """The FIFO wakeup bus of the store's namespace: a receiver whose FIFO cannot be opened, a
    folder that cannot be looked at, a bus once closed. None of them makes a receiver, and none
    leaves a FIFO or a descriptor behind."""
    bus = wakeup.FifoWakeups(store.namespace, store.directory)
    _, first_look = bus.generation("s0"), _descriptors()
    bus.close()
    for what, fails, nth in (
        ("the read end of a receiver's FIFO cannot be checked", ("fstat", errno.EIO), 1),
        ("the hold end of a receiver's FIFO cannot be opened", ("open", errno.EIO), 2),
        ("the wakeup folder cannot be looked at", ("lstat", errno.EIO), 1),
    ):
        bus = wakeup.FifoWakeups(store.namespace, store.directory)
        got = _attempt(lambda bus=bus: bus.generation("s1"), fails, nth)  # type: ignore[misc]
        fifos = sorted(os.listdir(bus.directory)) if os.path.isdir(bus.directory) else []
        leaked = len(_descriptors() - first_look)
        want = "returned None, FIFOs [], 0 descriptors left open"
        note_case(f"a receiver of s1 when {what}", f"{got}, FIFOs {fifos}, {leaked} descriptors left open", want)
        bus.close()
    # (a folder whose look failed cannot be told ours, so its bus leaves it: a sweep takes it)
    with contextlib.suppress(OSError):
        os.rmdir(bus.directory)
    bus = wakeup.FifoWakeups(store.namespace, store.directory)
    bus.close()
    generation = bus.generation("s1")
    made = os.path.lexists(bus.directory)
    note_case("a receiver of a closed bus", f"{generation}, folder made: {made}", "None, folder made: False")


@scenario(
    "store_calls_fail",
    summary="each call a cleanup, a sweep or a reader makes of the POSIX store meets a failing system call "
    "(EIO, EACCES, ENOSPC) and says so: the StoreError the errno calls for, naming the key and the error, no "
    "name changed; names a death leaves (a ring with no bytes yet, a spare with two names) are refused, not used",
    issue="omnisim issue 9 (a hostile /dev/shm), issue 11 (the store's error paths, which no connector-level run "
    "could tell from success)",
    build=World,
    invariants=(*DEFAULT_INVARIANTS, "os-errors-clean"),
    # One run is the whole check: nothing here awaits, so no schedule reorders it.
    budget_share=0.05,
    unavailable=unavailable,
)
async def store_calls_fail(world: World) -> None:
    assert isinstance(world.store, PosixStore)
    _refused_calls(world.store)
    _odd_names(world.store)
    _wakeup_calls(world.store)
    _descriptor_zero(world.store)
