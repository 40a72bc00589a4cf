"""The connector's own contract, under races the transfer adapter never makes (spec §2.5, §2.7).

The adapter queues a request's cleanup behind its puts, so through it no cleanup ever meets a put
of the same key in flight. The connector promises more to anyone who drives it directly: a
cleanup that meets a write in flight wins (the segment it unlinked, or the ring frame it
cancelled, never reads as a chunk), and whatever the order, once the key is cleaned up after both
nothing of it is left: no segment, no lock file, no ring frame holding space for good. A reader
polls the key all along and takes the chunk whole or not at all. And a connector's close removes
every key it tracks, unread ones included, wherever they went.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from omnisim.faults import InjectedCrash
from omnisim.registry import Param, Params, scenario
from omnisim.world import World
from runtime.connectors.base import CorruptChunk
from runtime.connectors.shm import CLEANUP_RETRY_S, ShmConnector
from runtime.connectors.stores import StoreError
from runtime.kernel import current_kernel
from scenarios.crash import DATA_PLANE
from scenarios.edge import CODE2WAV, CONSUMER_WAIT_S, TALKER, codec_frames, edge_scenario, edge_world

KEY = "C_1_0"
#: How often the reader looks for the key while the put and the cleanup race.
LOOKS = 4


@edge_scenario(
    "cleanup_during_put",
    summary="a connector's cleanup of a key races a put of the same key (on the ring or a segment) while a reader "
    "polls it: the reader takes the chunk whole or not at all, and once the key is cleaned up after both, nothing "
    "of it is left (no segment, no lock file, no ring frame holding space)",
    issue="spec §2.5/§2.7 (the connector's contract, driven directly)",
    invariants=DATA_PLANE,
)
async def cleanup_during_put(world: World) -> None:
    k = current_kernel()
    talker, code2wav = world.stages[TALKER].connector, world.stages[CODE2WAV].connector

    async def put() -> None:
        # A put that raises (an injected fault: a bug or an interrupted call) leaves its caller
        # to clean up after it, as the cleanup below does.
        with contextlib.suppress(InjectedCrash):
            await talker.put(str(TALKER), str(CODE2WAV), KEY, {"codes": {"audio": codec_frames(4)}})

    async def clean() -> None:
        await talker.cleanup(KEY)

    async def read() -> None:
        for _ in range(LOOKS):
            try:
                if await code2wav.get(str(TALKER), str(CODE2WAV), KEY) is not None:
                    return
            except CorruptChunk:
                return  # (an injected decode failure: consumed all the same)
            await k.sleep(CONSUMER_WAIT_S / LOOKS)

    async with k.task_group() as race:
        race.start_soon(put, name="C.put")
        race.start_soon(clean, name="C.cleanup")
        race.start_soon(read, name="C.read")
    await talker.cleanup(KEY)  # what a release does once the request is gone


#: The chunks ``cancelled_write_space`` puts after the one it cancels: together more than its
#: ring holds, so they wrap around into the cancelled frame's space if anything lets them.
REFILLS = 6


@edge_scenario(
    "cancelled_write_space",
    summary="a cleanup cancels a chunk while its put still writes it, as puts of other keys of the same connector "
    "fill the edge's ring and a reader takes them: no put reserves the cancelled frame's space before its writer is "
    "done with it (else that writer's last bytes land in another chunk), every other chunk arrives intact, and "
    "nothing is left once all are cleaned up",
    issue="issue 13 (a bug the harness was not told about: a ring's tail that passes a frame still being written)",
    invariants=DATA_PLANE,
    # The cancelled frame is the ring's first; the fourth refill is the one that would wrap into it.
    constraints=(
        "shm.put.reserved[key=C_1_0] < shm.cleanup.begin[key=C_1_0] < shm.put.end[key=B_1_3] "
        "< shm.put.written[key=C_1_0]",
    ),
)
async def cancelled_write_space(world: World) -> None:
    k = current_kernel()
    talker, code2wav = world.stages[TALKER].connector, world.stages[CODE2WAV].connector
    edge = (str(TALKER), str(CODE2WAV))
    refills = [f"B_1_{i}" for i in range(REFILLS)]

    async def put(key: str, first_code: int) -> None:
        with contextlib.suppress(InjectedCrash):
            await talker.put(*edge, key, {"codes": {"audio": codec_frames(25) + first_code}})

    async def cancel() -> None:
        await talker.cleanup(KEY)

    async def refill() -> None:
        for i, key in enumerate(refills):
            await put(key, i + 1)

    fired = len(world.fired_faults())

    async def read() -> None:
        for key in refills:
            for _ in range(LOOKS):
                with contextlib.suppress(CorruptChunk):  # (an injected decode failure: consumed all the same)
                    if await code2wav.get(*edge, key) is not None:
                        break
                await k.sleep(CONSUMER_WAIT_S / LOOKS)
            else:
                # (a fault injected into any of the puts is a cause for a chunk not to arrive)
                world.probe("liveness", len(world.fired_faults()) > fired, f"Code2Wav never took {key}")

    async with k.task_group() as race:
        race.start_soon(lambda: put(KEY, 0), name="C.put")
        race.start_soon(cancel, name="C.cleanup")
        race.start_soon(refill, name="C.refill")
        race.start_soon(read, name="C.read")
    for key in (KEY, *refills):
        await talker.cleanup(key)


def params_world(store_kind: str, params: Params) -> World:
    """The edge's world, for a scenario whose parameters change only what its body does."""
    return edge_world(store_kind)


@scenario(
    "producer_replaced",
    build=params_world,
    summary="the Talker's connector closes while Code2Wav still has its ring mapped, and a new connector of the same "
    "stage takes over the edge (as a stage rebuilt in its process does), or the old one closes only once the new one "
    "made its ring: Code2Wav lets go of the old ring and takes the new connector's chunks, the old close leaves the "
    "successor's ring alone, and nothing of either is left",
    issue="spec §2.7 (close), issue 13 (a ring a successor may make under the same name)",
    invariants=DATA_PLANE,
    params=(
        Param("old_closes", ("first", "last"), "whether the old connector closes before the new one sends, or after"),
    ),
)
async def producer_replaced(world: World) -> None:
    k = current_kernel()
    old, code2wav = world.stages[TALKER].connector, world.stages[CODE2WAV].connector
    edge = (str(TALKER), str(CODE2WAV))
    payload = {"codes": {"audio": codec_frames(4)}}

    async def put_and_take(connector: ShmConnector, key: str) -> None:
        fired = len(world.fired_faults())
        with contextlib.suppress(InjectedCrash):
            await connector.put(*edge, key, payload)
        for _ in range(LOOKS):
            with contextlib.suppress(CorruptChunk):  # (an injected decode failure: consumed all the same)
                if await code2wav.get(*edge, key) is not None:
                    return
            await k.sleep(CONSUMER_WAIT_S / LOOKS)
        # (a fault injected on the way is a cause for the chunk not to arrive)
        world.probe("liveness", len(world.fired_faults()) > fired, f"Code2Wav never took {key}")

    await put_and_take(old, "P_1_0")
    first = world.params["old_closes"] == "first"
    if first:
        await old.close()
    new = ShmConnector(
        old.store, stage_id=TALKER, wakeups=world.wakeups_of(world.stages[TALKER].process), **world.transport()
    )
    world.watch_connector(new)
    try:
        await put_and_take(new, "P_2_0")
        if not first:
            rings = old.store.rings()
            # (where the new connector's chunk went on a ring, the edge's ring is the new one's)
            replaced = any(
                e.name == "shm.put.created" and e.attrs.get("key") == "P_2_0" and e.attrs.get("via") == "ring"
                for e in k.trace  # type: ignore[attr-defined]
            )
            await old.close()
            # (an old cleanup must not remove a new one's: here the successor's ring)
            kept = not replaced or old.store.rings() == rings
            world.probe("exact-key-ownership", kept, f"the old connector's close removed the new one's ring of {rings}")
            await put_and_take(new, "P_2_1")
    finally:
        await new.close()


#: The chunks ``closed_with_unread`` leaves unread, by key: codec frames small enough for a ring
#: (where the store has one) and too large for it.
UNREAD = {"U_1_0": 4, "U_1_1": 64, "U_1_2": 4}


@edge_scenario(
    "closed_with_unread",
    summary="the Talker's connector closes with chunks nobody took yet, on the ring and in segments (which the "
    "runtime reports unread on the ring as they are): its close removes every one (no segment, no lock file, no ring "
    "frame is left), a second close does nothing more, the closed connector has no wakeups, and a reader that looks "
    "for them afterwards finds none",
    issue="spec §2.7 (close removes every tracked key, unread ones included)",
    invariants=DATA_PLANE,
)
async def closed_with_unread(world: World) -> None:
    talker, code2wav = world.stages[TALKER].connector, world.stages[CODE2WAV].connector
    edge = (str(TALKER), str(CODE2WAV))
    for key, frames in UNREAD.items():
        with contextlib.suppress(InjectedCrash):
            await talker.put(*edge, key, {"codes": {"audio": codec_frames(frames)}})
    world.check_unread_frames_report()
    await talker.close()
    await talker.close()
    generation = talker.get_wakeup_generation()
    if generation is not None:  # (a closed connector has no wakeups: answers-true)
        what = "the wakeup generation of a closed connector"
        current_kernel().note("connector.answer", what=what, got=str(generation), want="None")
    for key in UNREAD:
        with contextlib.suppress(CorruptChunk):  # (an injected decode failure: nothing handed out)
            taken = await code2wav.get(*edge, key)
            world.probe("no-orphan-shm", taken is None, f"a get of {key} after its producer's close took it")


@edge_scenario(
    "closed_during_puts",
    summary="the Talker's connector closes while puts of chunks for the ring and for segments are in flight: each "
    "put either ends before the close (which then removes its chunk) or fails, and no segment, lock file or ring "
    "frame of any of them is left",
    issue="spec §2.7 (close removes every tracked key; a put that outlives it must not leave its key behind)",
    invariants=DATA_PLANE,
)
async def closed_during_puts(world: World) -> None:
    k = current_kernel()
    talker = world.stages[TALKER].connector
    edge = (str(TALKER), str(CODE2WAV))

    async def put(key: str, frames: int) -> None:
        with contextlib.suppress(InjectedCrash, StoreError):  # (ConnectorClosed, once the close ran first)
            await talker.put(*edge, key, {"codes": {"audio": codec_frames(frames)}})

    async def close() -> None:
        k.note("fault.close", connector=str(TALKER))  # (a put it fails has this cause)
        await talker.close()

    async with k.task_group() as puts:
        for key, frames in UNREAD.items():
            puts.start_soon(functools.partial(put, key, frames), name=f"{key}.put")
        puts.start_soon(close, name="close")


#: The two payloads ``puts_of_one_key`` puts under one key at once, by how many codec frames: one
#: small enough for a ring (where the store has one), one too large for it.
RACING = {"small": 4, "large": 64}


@edge_scenario(
    "puts_of_one_key",
    summary="two puts of one key race on one connector, one small enough for the ring and one too large for it: "
    "once both ended, the key holds one payload, the one written last (a get takes it whole, a second get finds "
    "nothing), and after its cleanup nothing of either is left",
    issue="spec §2.5 (a put replaces unread data of the same key), issue 13 (one key's payload in one place, ring or "
    "segment)",
    invariants=DATA_PLANE,
)
async def puts_of_one_key(world: World) -> None:
    k = current_kernel()
    talker, code2wav = world.stages[TALKER].connector, world.stages[CODE2WAV].connector
    edge = (str(TALKER), str(CODE2WAV))
    key = "K_1_0"

    async def put(frames: int) -> None:
        with contextlib.suppress(InjectedCrash):
            await talker.put(*edge, key, {"codes": {"audio": codec_frames(frames)}})

    async with k.task_group() as race:
        for name, frames in RACING.items():
            race.start_soon(functools.partial(put, frames), name=f"K.put_{name}")
    # (the put that wrote last is the one that committed last, whichever returned last)
    committed = [
        e.task
        for e in k.trace
        if e.name == "shm.put.committed" and e.attrs.get("key") == key  # type: ignore[attr-defined]
    ]
    takes = []
    for _ in range(2):
        try:
            taken = await code2wav.get(*edge, key)
        except CorruptChunk:
            taken = None  # (an injected decode failure)
        frames = taken[0]["codes"]["audio"].shape[-1] if taken is not None else None
        takes.append(next((name for name, n in RACING.items() if n == frames), "nothing"))
    if committed and not world.fired_faults():
        last = committed[-1].removeprefix("K.put_")
        what = f"what two gets of {key} take once both its puts ended"
        k.note("connector.answer", what=what, got=", ".join(takes), want=f"{last}, nothing")
    await talker.cleanup(key)


#: The key whose segment the store refuses once to remove, and how many codec frames it carries
#: (too many for a ring: a segment on every store).
REFUSED, REFUSED_FRAMES = "F_1_0", 64


@scenario(
    "failed_cleanup",
    build=params_world,
    summary="the store refuses once (EACCES) to remove the segment of an unread chunk its connector cleans up: the "
    "connector keeps the key and its reap removes the segment once the back-off is over; or the key is put again "
    "meanwhile (by another connector of the stage, or by the same one: an id reused), and the retry leaves that "
    "segment and its lock file to its reader",
    issue="spec §2.12 (a failed cleanup stays owned and is tried again; a cleanup removes only its own put's segment)",
    invariants=DATA_PLANE,
    params=(
        Param(
            "then",
            ("reap", "put_again", "put_again_here"),
            "what follows the failed cleanup: the reap, or first a put of the key by another connector or by its own",
        ),
    ),
)
async def failed_cleanup(world: World) -> None:
    k = current_kernel()
    talker, code2wav = world.stages[TALKER].connector, world.stages[CODE2WAV].connector
    edge = (str(TALKER), str(CODE2WAV))
    store = talker.store
    unlink_segment = store.unlink_segment
    refusals = [REFUSED]

    def refusing(key: str, **kwargs: Any) -> bool:
        if key in refusals:
            refusals.remove(key)
            k.note("fault.store", at="unlink_segment", key=key)
            raise StoreError(f"cannot remove segment {key!r}: Permission denied")
        return unlink_segment(key, **kwargs)

    store.unlink_segment = refusing  # type: ignore[method-assign]
    payload = {"codes": {"audio": codec_frames(REFUSED_FRAMES)}}
    with contextlib.suppress(InjectedCrash):
        await talker.put(*edge, REFUSED, payload)
    await talker.cleanup(REFUSED)
    if world.params["then"] != "reap":
        putter = talker
        if world.params["then"] == "put_again":
            process = world.stages[TALKER].process
            putter = ShmConnector(store, stage_id=TALKER, wakeups=world.wakeups_of(process), **world.transport())
            world.watch_connector(putter)
        fired = len(world.fired_faults())
        again = None
        with contextlib.suppress(InjectedCrash):
            again = await putter.put(*edge, REFUSED, payload)
        await k.sleep(2 * CLEANUP_RETRY_S)
        talker.reap_consumed()  # (the retry, once its back-off is over)
        taken = None
        with contextlib.suppress(CorruptChunk):  # (an injected decode failure: consumed all the same)
            taken = await code2wav.get(*edge, REFUSED)
        put_ok = again is not None and again.ok and len(world.fired_faults()) == fired
        message = f"the retry of the old cleanup of {REFUSED} removed the segment a later put of it made"
        world.probe("exact-key-ownership", not put_ok or taken is not None, message)
        if putter is not talker:
            await putter.close()
    else:
        await k.sleep(2 * CLEANUP_RETRY_S)
        talker.reap_consumed()
