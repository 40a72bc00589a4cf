"""The per-edge ring under load (omnisim issue 13), at the Talker → Code2Wav edge.

These run on every store; on ``--store ring`` the edge has a 16 KiB ring
(:data:`omnisim.world.SIM_RING`) that holds about four 25-frame chunks, so the workloads below
fill it, wrap around it and send the chunks that find it full to segments of their own:

* ``ring_full_slow_consumer`` — a Talker that outruns Code2Wav on two requests at once, one read
  slowly and one briskly: the ring fills, puts wait a moment for room and then take segments, the
  ring wraps around as the consumer catches up, and every frame arrives once, in order, whichever
  way its chunk went;
* ``ring_eager_reader`` — a Code2Wav that waits for every chunk before it is put, on two requests
  the Talker produces in step: a reader asks for a key while its frame is being written (and the
  space it is written into may hold an older frame's bytes), and takes only whole frames;
* ``ring_wrap_cancel`` — one request streams through the ring while another one's chunks sit
  unread on it and that request is aborted: its frames are cancelled and their space reused by
  the first request's wrapped-around frames, which all arrive intact.

What else the ring meets runs in the scenarios of every store: a writer or reader killed at each
point of a put or get (``writer_crash``, ``reader_crash``), a reader stopped mid-copy holding the
ring (``stalled_reader``), bytes changed after a commit (``corrupt_chunk``), a stage process dying
and coming back in a new namespace (``stage_crash``), ids reused while frames are in flight.
Every frame is recorded as sent and as received, so ``no-corrupt-accept`` checks content.
"""

from __future__ import annotations

import functools
import random

from omnisim.registry import Param, Params, scenario
from omnisim.sim_kernel import MAIN_PROCESS
from omnisim.world import World
from runtime.kernel import current_kernel
from scenarios.crash import DATA_PLANE, in_process, receive, send
from scenarios.edge import CODE2WAV, EdgeRequest, edge_world

#: How long the slow consumer idles before it asks for each chunk: the Talker puts several
#: chunks meanwhile.
SLOW_CONSUMER_S = 0.03
#: Codec frames per chunk of each request: chunks of different sizes leave every remainder at the
#: ring's end, so wrap-arounds skip bytes of many sizes.
MIXED_CHUNKS = ([4, 25, 10, 25, 7, 25], [25, 10, 25, 4, 25, 10])
#: Chunks per request when their sizes are drawn, and the largest (the Talker's 25 frames).
DRAWN_CHUNKS, MAX_CHUNK_FRAMES = 8, 25
CHUNK_SIZES = Param(
    "chunks",
    ("mixed", "drawn"),
    f"the chunks' sizes: fixed and mixed ({MIXED_CHUNKS}), or drawn from the run's seed ({DRAWN_CHUNKS} per "
    f"request, 1 to {MAX_CHUNK_FRAMES} frames), so that runs leave the ring's head, tail and end at many "
    "different distances from one another when a frame must wrap",
)
CODE2WAV_PROCESS = Param(
    "code2wav",
    ("same_process", "own_process"),
    "Code2Wav in the Talker's process (in-process wakeups), or in a process of its own as stage processes run "
    "(a full ring's producer then waits for room on a FIFO wakeup across processes)",
)


def ring_world(store_kind: str, params: Params) -> World:
    return edge_world(store_kind, code2wav_process=params["code2wav"] == "own_process")


@scenario(
    "ring_full_slow_consumer",
    summary="a Talker outruns a slow Code2Wav on two requests: the edge's ring fills, puts wait a moment and then "
    "take segments, the ring wraps around, and every frame arrives exactly once and in order, whichever way its "
    "chunk went",
    issue="omnisim issue 13 (ring back-pressure, fallback, wrap-around)",
    build=ring_world,
    params=(CODE2WAV_PROCESS, CHUNK_SIZES),
    invariants=DATA_PLANE,
)
async def ring_full_slow_consumer(world: World) -> None:
    await two_streams(world, read_pauses=(SLOW_CONSUMER_S, SLOW_CONSUMER_S / 10), write_pause=0.0)


async def two_streams(world: World, *, read_pauses: tuple[float, float], write_pause: float) -> None:
    """Requests R and S streamed at once (chunk sizes as the ``chunks`` parameter says), each
    read with its pause before every chunk and written with ``write_pause`` before every chunk;
    both must finish intact."""
    requests = [EdgeRequest(world, ext) for ext in ("R", "S")]
    consumer = world.stages[CODE2WAV].process
    jobs = []
    for req, chunks, read_pause in zip(requests, chunk_sizes(world), read_pauses, strict=True):
        req.stream.allowed_outcomes = frozenset({"finished"})
        jobs.append((consumer, f"{req.name}.consume", functools.partial(receive, req, pause_s=read_pause)))
        jobs.append((MAIN_PROCESS, f"{req.name}.produce", functools.partial(send, req, chunks, pause_s=write_pause)))
    await in_process(jobs)
    for req in requests:
        await req.talker.adapter.finish_requests([req.sender])
        await req.talker.adapter.release_shm_resources(req.ext)


def chunk_sizes(world: World) -> tuple[list[int], list[int]]:
    """Each request's chunk sizes, in codec frames, as the ``chunks`` parameter says."""
    if world.params["chunks"] == "mixed":
        return MIXED_CHUNKS
    draw = random.Random(world.seed)
    first, second = ([draw.randint(1, MAX_CHUNK_FRAMES) for _ in range(DRAWN_CHUNKS)] for _ in range(2))
    return first, second


@scenario(
    "ring_eager_reader",
    summary="Code2Wav waits for every chunk before it is put, on two requests the Talker produces in step: it asks "
    "for keys while their frames are being written into reused ring space, and takes only whole frames",
    issue="omnisim issue 13 (a frame readable only once written)",
    build=ring_world,
    params=(CODE2WAV_PROCESS, CHUNK_SIZES),
    invariants=DATA_PLANE,
)
async def ring_eager_reader(world: World) -> None:
    await two_streams(world, read_pauses=(0.0, 0.0), write_pause=SLOW_CONSUMER_S)


@scenario(
    "ring_wrap_cancel",
    summary="request A streams through the edge's ring while request B's chunks sit unread on it and B is "
    "aborted: B's frames are cancelled and reclaimed, A's frames wrap around into their space, and A gets every "
    "frame intact",
    issue="omnisim issue 13 (cancelled frames reclaimed, wrap-around)",
    build=ring_world,
    params=(CODE2WAV_PROCESS,),
    invariants=DATA_PLANE,
)
async def ring_wrap_cancel(world: World) -> None:
    k = current_kernel()
    a = EdgeRequest(world, "A")
    a.stream.allowed_outcomes = frozenset({"finished"})
    b = EdgeRequest(world, "B")
    b.stream.allowed_outcomes = frozenset({"aborted"})

    async def abort_b() -> None:
        # B's consumer never asks: its chunks wait on the ring until the orchestrator aborts it.
        await send(b, [25, 25, 25])
        await k.sleep(SLOW_CONSUMER_S)
        b.stream.outcome = "aborted"
        await b.talker.adapter.finish_requests([b.sender])
        await b.talker.adapter.release_shm_resources(b.ext)
        await b.code2wav.adapter.finish_requests([b.receiver])

    await in_process(
        [
            (MAIN_PROCESS, "B", abort_b),
            (world.stages[CODE2WAV].process, "A.consume", lambda: receive(a, pause_s=SLOW_CONSUMER_S / 3)),
            (MAIN_PROCESS, "A.produce", lambda: send(a, [25] * 8)),
        ]
    )
    await a.talker.adapter.finish_requests([a.sender])
    await a.talker.adapter.release_shm_resources(a.ext)
