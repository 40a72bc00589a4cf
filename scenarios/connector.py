"""The connector's own contract, under races the transfer adapter never makes (spec §2.5, §2.7).

The adapter queues a request's cleanup behind its puts, so through it no cleanup ever meets a put
of the same key in flight. The connector promises more to anyone who drives it directly: a
cleanup that meets a write in flight wins (the segment it unlinked, or the ring frame it
cancelled, never reads as a chunk), and whatever the order, once the key is cleaned up after both
nothing of it is left: no segment, no lock file, no ring frame holding space for good. A reader
polls the key all along and takes the chunk whole or not at all.
"""

from __future__ import annotations

import contextlib

from omnisim.faults import InjectedCrash
from omnisim.world import World
from runtime.connectors.base import CorruptChunk
from runtime.kernel import current_kernel
from scenarios.crash import DATA_PLANE
from scenarios.edge import CODE2WAV, CONSUMER_WAIT_S, TALKER, codec_frames, edge_scenario

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
