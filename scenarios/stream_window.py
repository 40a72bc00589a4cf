"""The active-stream window (spec §5.2 step 5, #5349): a chunk-fed stage takes up at most K
requests' chunk streams at once; the others wait their turn, first come first served.

#5349's bug was a window that let a stream go when its *upstream* finished — the Talker request
was evicted once the Thinker's terminal arrived, with frames still to speak, and never taken up
again: its audio stopped and the request hung. A slot is freed only when the request ends at the
stage (its receiver is cleaned up), on completion or abort.
"""

from __future__ import annotations

from omnisim.registry import DEFAULT_INVARIANTS, Param, Params
from omnisim.world import World
from scenarios.edge import together
from scenarios.pipeline import (
    ASYNC_CHUNK,
    BOUNDARY,
    REMAINDER,
    SHORT,
    SHUTDOWN,
    Client,
    pipeline_scenario,
    pipeline_world,
    shipped_config,
    with_every_stage,
)

WINDOW = Param("window", ("1", "2"), "how many requests' streams the Talker and Code2Wav take up at once")


def windowed_world(store_kind: str, params: Params) -> World:
    """The shipped pipeline with the window set on every stage, as a deploy file sets it."""
    config = with_every_stage(shipped_config(), active_stream_window=int(params["window"]))
    return pipeline_world(store_kind, params, config=config)


@pipeline_scenario(
    "active_stream_window",
    summary="three requests through a pipeline whose Talker and Code2Wav take up one or two streams at once: the "
    "others wait their turn, a stream stays taken up after its upstream finished until it ends there, and each "
    "request gets its exact text and audio",
    issue="#5349 (fixed by #5373), spec §5.2 step 5",
    params=(WINDOW, ASYNC_CHUNK, SHUTDOWN),
    build=windowed_world,
    invariants=(*DEFAULT_INVARIANTS, "stream-window-kept"),
)
async def active_stream_window(world: World) -> None:
    clients = [
        Client(world, "first", REMAINDER, "A", modalities=("text", "audio")),
        Client(world, "second", BOUNDARY, "B", modalities=("audio",)),
        Client(world, "third", SHORT, "C", modalities=("text", "audio")),
    ]
    await together(*((c.name, c.run) for c in clients))
