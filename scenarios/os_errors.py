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

import errno
import os
from collections.abc import Callable
from typing import Any

import torch

from omnisim.faults import InjectedCrash
from omnisim.registry import DEFAULT_INVARIANTS, Param, Params, scenario
from omnisim.world import World
from runtime.connectors import posix_store
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
    try:
        for key in CHUNKS:
            struck, faults = failing.fired, len(world.fired_faults())
            put = await _outcome(lambda key=key: talker.put(*EDGE, key, payload(key)))  # type: ignore[misc]
            put_struck = failing.fired and not struck
            want = f"ok, or a failure naming {NAMED[error]!r}" if put_struck else "ok"
            got = want if put == "ok" or (put_struck and NAMED[error] in put) else put
            if len(world.fired_faults()) == faults:  # (one injected on top is the other invariants' to judge)
                note_case(f"the put of {key}", got, want)
            # (``faults`` is not counted again: a get after a put an injected fault struck, which may
            # have left a torn frame, is the other invariants' to judge too)
            struck = failing.fired
            taken = await _taken(code2wav, key)
            get_struck = failing.fired and not struck
            if put != "ok":
                want = "nothing"
            elif get_struck:
                # (a get that could not look answers nothing now: the chunk is there for the next)
                want = f"{ROUND_TRIP} (now or at the next get), or a corrupt chunk naming {NAMED[error]!r}"
                if taken == "nothing":
                    taken = await _taken(code2wav, key)
                named = taken.startswith("corrupt") and NAMED[error] in taken
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


async def _taken(code2wav: Any, key: str) -> str:
    try:
        taken = await code2wav.get(*EDGE, key)
    except CorruptChunk as e:
        return f"corrupt: {e}"
    except OSError as e:
        return f"raised a raw {type(e).__name__}: {e}"
    if taken is None:
        return "nothing"
    got = taken[0].get("codes") if isinstance(taken[0], dict) else None
    return ROUND_TRIP if isinstance(got, torch.Tensor) and torch.equal(got, payload(key)["codes"]) else repr(got)[:80]
