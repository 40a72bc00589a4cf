"""/dev/shm fills up for real (spec §2.2, data-plane hardening).

A full /dev/shm is where production is hard: every put may meet it, and the spares the store
keeps for speed hold room that a put needs. The other storage scenarios inject the failure above
the store; here the store is small and fills up by itself. On a POSIX store it lives in a private
tmpfs of that size and inode count (:mod:`omnisim.tmpfs`), so the kernel's own ENOSPC — from
``posix_fallocate`` for space, from ``open`` for inodes — meets the store's own translation of it;
in memory the store is bounded the same way.

The Talker puts chunks of three sizes (the smallest goes on the edge's ring, where there is one)
and Code2Wav takes them, each on its own connector:

* ``in_step``: each chunk is taken before the next is put. What is unread never outgrows the
  room, so every put must succeed, however many chunks went before: the spares the consumed
  segments became give way (for space and for inodes) rather than fail a put.
* ``backlog``: every chunk is put before any is taken, more than the room holds. Puts succeed
  until one fails, cleanly, naming a full /dev/shm, and every chunk that was put comes back
  whole. Then a second backlog the same: as many of its chunks must fit as of the first, though
  the first left its consumed segments behind as spares (a cache never costs room).

Each outcome is a ``room.case`` note that ``full-store-clean`` compares with what it must be.
"""

from __future__ import annotations

import torch

from omnisim.faults import InjectedCrash
from omnisim.registry import DEFAULT_INVARIANTS, Param, Params, scenario
from omnisim.tmpfs import why_unavailable
from omnisim.world import Room, World
from runtime.connectors.base import CorruptChunk
from runtime.kernel import current_kernel
from scenarios.crash import CAUSES
from scenarios.edge import CODE2WAV, TALKER, edge_world

#: The smallest segment kept as a spare: the 1 KiB chunks take none, as small ones in production
#: do not, but need names and pages all the same.
SPARE_MIN_BYTES = 2 << 10
#: What the store holds, by what runs out: space (64 KiB: a backlog of about seven chunks), or
#: names (six segments, lock files, rings and spares: three unread chunks in segments).
ROOMS = {
    "space": Room(bytes=64 << 10, names=64, spare_min_bytes=SPARE_MIN_BYTES),
    "inodes": Room(bytes=4 << 20, names=6, spare_min_bytes=SPARE_MIN_BYTES),
}
#: The elements (int64) of each chunk's tensor in turn: 1 KiB (on the edge's ring, where there
#: is one), 6 KiB and 12 KiB.
SIZES = (128, 768, 1536)
#: Chunks per run: in a backlog, about twice what the room holds.
CHUNKS = 12
ROUND_TRIP = "round trip"
#: How a put that met a full store names the cause.
FULL = CAUSES["store_full"]
EDGE = (str(TALKER), str(CODE2WAV))


def payload(i: int) -> dict[str, torch.Tensor]:
    return {"codes": torch.full((SIZES[i % len(SIZES)],), i, dtype=torch.int64)}


def full_world(store_kind: str, params: Params) -> World:
    return edge_world(store_kind, room=ROOMS[params["full"]])


def unavailable(store: str) -> str | None:
    """A POSIX store's room is a private tmpfs: not every machine lets a run mount one."""
    return None if store == "memory" else why_unavailable()


def note_case(what: str, got: str, want: str) -> None:
    current_kernel().note("room.case", what=what, got=got, want=want)


class Transfers:
    """The Talker's puts and Code2Wav's gets, each judged against what it must give; a case
    an injected fault struck is not judged (its clean failure is the other invariants' to check)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.talker = world.stages[TALKER].connector
        self.code2wav = world.stages[CODE2WAV].connector

    async def put(self, key: str, i: int) -> str:
        """Put chunk ``i`` under ``key``: ``ok``, or the error it failed with."""
        try:
            result = await self.talker.put(*EDGE, key, payload(i))
        except InjectedCrash as e:  # (an injected fault: a bug or an interrupted call)
            return str(e)
        return "ok" if result.ok else str((result.metadata or {}).get("error"))

    async def take(self, key: str, i: int) -> str:
        """Take ``key``: ``round trip`` if chunk ``i`` came back whole, else what came."""
        try:
            taken = await self.code2wav.get(*EDGE, key)
        except CorruptChunk as e:
            return f"corrupt: {e}"
        if taken is None:
            return "nothing"
        got = taken[0].get("codes") if isinstance(taken[0], dict) else None
        want = payload(i)["codes"]
        return ROUND_TRIP if isinstance(got, torch.Tensor) and torch.equal(got, want) else f"{taken[0]!r}"[:80]

    def judge(self, fired: int, what: str, got: str, want: str) -> None:
        if len(self.world.fired_faults()) == fired:
            note_case(what, got, want)


async def in_step(t: Transfers) -> None:
    for i in range(CHUNKS):
        key, fired = f"F_1_{i}", len(t.world.fired_faults())
        put = await t.put(key, i)
        got = await t.take(key, i) if put == "ok" else put
        t.judge(fired, f"the in-step chunk {key} ({SIZES[i % len(SIZES)] * 8} bytes)", got, ROUND_TRIP)
        await t.talker.cleanup(key)


async def backlog(t: Transfers) -> None:
    fired = len(t.world.fired_faults())
    first = await one_backlog(t, "F_1")
    second = await one_backlog(t, "F_2")
    t.judge(
        fired,
        "a second backlog, put where the first left its spares",
        "as many fit" if second >= first else f"{second} fit, the first time {first}",
        "as many fit",
    )


async def one_backlog(t: Transfers, stem: str) -> int:
    """Put every chunk, then take and clean up each; how many puts succeeded."""
    fired = len(t.world.fired_faults())
    put = {f"{stem}_{i}": await t.put(f"{stem}_{i}", i) for i in range(CHUNKS)}
    refused = [error for error in put.values() if error != "ok"]
    t.judge(fired, f"a backlog of {CHUNKS} chunks", "a put refused" if refused else "every put fit", "a put refused")
    for error in refused:
        t.judge(fired, "a put refused for want of room", "names it" if FULL in error else error, "names it")
    for i, key in enumerate(put):
        fired = len(t.world.fired_faults())
        if put[key] == "ok":
            t.judge(fired, f"the backlog's chunk {key}", await t.take(key, i), ROUND_TRIP)
        await t.talker.cleanup(key)
    return CHUNKS - len(refused)


READERS = {"in_step": in_step, "backlog": backlog}


@scenario(
    "store_fills_up",
    summary="the store is small (on POSIX, a private tmpfs) and fills up for real, for space or for inodes: "
    "chunks taken in step all go through; a backlog larger than the room fails a put cleanly, naming a full "
    "/dev/shm, and every chunk put comes back whole; and the spares a backlog leaves never cost the next one room",
    issue="spec §2.2 (a full /dev/shm: a clean ENOSPC, never SIGBUS), issue 11 (the store's own ENOSPC paths)",
    build=full_world,
    params=(
        Param("full", tuple(ROOMS), "what runs out: space or inodes"),
        Param("reader", tuple(READERS), "chunks taken in step with the puts, or a backlog put first"),
    ),
    # Every failure here is one the room provoked: full-store-clean judges each instead.
    invariants=(*(i for i in DEFAULT_INVARIANTS if i != "failures-have-causes"), "full-store-clean"),
    unavailable=unavailable,
)
async def store_fills_up(world: World) -> None:
    await READERS[world.params["reader"]](Transfers(world))
