"""#6670: a receiver learns that a stream ended only from a chunk carrying ``finished`` — two paths
lost that terminal: a cleanup that discarded a queued terminal, and a parked sender stage."""

from __future__ import annotations

import functools

from omnisim.faults import Fault, FaultPlan
from omnisim.registry import scenario
from omnisim.world import World
from runtime.kernel import current_kernel
from runtime.request import Request
from scenarios.edge import (
    EdgeRequest,
    abort,
    codec_frames,
    consume,
    edge_scenario,
    edge_world,
    produce,
    produce_then_finish,
    release,
    together,
)


@edge_scenario(
    "abort_with_terminal_queued",
    summary="cleanup while the terminal is queued: the terminal still reaches Code2Wav (the fence); a failed "
    "fenced terminal still reclaims; an aborted request's fenced terminal is swept",
    issue="#6670 (a)",
    constraints=tuple(
        f"adapter.save_async[ext={ext},finished=True] < adapter.cleanup_sender.end[ext={ext}] "
        f"< adapter.send.begin[ext={ext},finished=True]"
        for ext in ("R", "F")
    ),
    faults=lambda seed: FaultPlan([Fault("put_fail", match={"key": "F_1_2"})], seed),
)
async def abort_with_terminal_queued(world: World) -> None:
    finished = EdgeRequest(world, "R")
    finished.stream.complete_required = False  # finished externally: queued chunks may be vetoed
    finished.stream.vetoable = True
    failing = EdgeRequest(world, "F")
    failing.stream.allowed_outcomes = frozenset({"failed"})
    aborted = EdgeRequest(world, "A")
    aborted.stream.allowed_outcomes = frozenset({"finished", "aborted"})

    async def produce_then_abort() -> None:
        await produce(aborted, [4, 3])
        await abort(aborted)

    async def produce_then_fail_terminal() -> None:
        # Its chunks are sent first, so the terminal is F_1_2, the key whose put fails.
        await produce(failing, [4, 25], finish=False)
        await current_kernel().sleep(0.2)
        await produce_then_finish(failing, [3])

    await together(
        ("R.consume", lambda: consume(finished)),
        ("R.produce", lambda: produce_then_finish(finished, [4, 25, 3])),
        ("F.consume", lambda: consume(failing)),
        ("F.produce", produce_then_fail_terminal),
        ("A.consume", lambda: consume(aborted)),
        ("A.produce", produce_then_abort),
    )
    for req in (finished, failing, aborted):
        await release(req)


@edge_scenario(
    "parked_sender_terminal",
    summary="a streaming request parked between segments gets its terminal update: the terminal is sent before "
    "the request is finished, even with its chunks still queued",
    issue="#6670 (b)",
)
async def parked_sender_terminal(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.sender.resumable = True  # a streaming session: its chunks carry no terminal
    # Finishing the session vetoes its chunks still queued (cancellation vetoes all but the
    # terminal), so only the terminal is guaranteed.
    req.stream.complete_required = False
    req.stream.vetoable = True

    async def stream_then_terminal_update() -> None:
        await produce(req, [4, 25], finish=False)
        await req.talker.adapter.finish_parked_streaming_session(req.sender)

    await together(("R.consume", lambda: consume(req)), ("R.produce", stream_then_terminal_update))
    await release(req)


@scenario(
    "parked_session_after_segment",
    summary="a streaming session parked after a segment end, registered for its next input, gets its terminal "
    "update: the terminal counts as the next segment (not a late save of the ended one) and the session's "
    "registration goes with it; one parked before its first chunk gets no terminal (nothing of it went "
    "downstream) and loses its registration all the same",
    issue="#6670 (b), with segment generations (spec §3.3 step 5)",
    build=functools.partial(edge_world, talker_receives=True),
)
async def parked_session_after_segment(world: World) -> None:
    req = EdgeRequest(world, "R")
    req.sender.resumable = True
    req.sender.segment_generation = 0  # its producer keeps segment generations
    req.stream.complete_required = False
    req.stream.vetoable = True

    async def segment_then_terminal_update() -> None:
        talker = req.talker.adapter
        await produce(req, [4], finish=False)
        await talker.save_async({"frames": codec_frames(0)}, req.sender, is_segment_finished=True)
        await talker.load_async(req.sender)  # parked: waiting for the Thinker's next segment
        await talker.finish_parked_streaming_session(req.sender)

    async def park_before_first_chunk() -> None:
        talker = req.talker.adapter
        await talker.load_async(silent)
        await talker.finish_parked_streaming_session(silent)

    # Only the Talker ever knew of it: no stream, no Code2Wav request.
    silent = Request("Q-talker", "Q", resumable=True, segment_generation=0)
    await together(
        ("R.consume", lambda: consume(req)),
        ("R.produce", segment_then_terminal_update),
        ("Q.park", park_before_first_chunk),
    )
    await release(req)


@edge_scenario(
    "release_after_stage_stop",
    summary="the Talker stops with an aborted request's reclaim still queued; the orchestrator's release sweep "
    "comes after its save loop ended, sweeps at once instead of queueing behind a loop that will not run again, "
    "and leaves nothing behind",
    issue="spec §2.11 (the request-level sweep) at shutdown; omnisim issue 11 (a blind spot of the mutation score)",
)
async def release_after_stage_stop(world: World) -> None:
    req = await abort_then_stop_talker(world, put_first=False)
    await release(req)


@edge_scenario(
    "stop_with_queued_reclaim",
    summary="the Talker stops right after an abort queued the reclaim of two sent chunks, and no release sweep "
    "follows (a shutdown whose grace period ran out): the save loop still runs the reclaim before it ends, and "
    "nothing is left behind",
    issue="spec §3.5 (the exact-range reclaim) at shutdown; omnisim issue 11 (a blind spot of the mutation score)",
)
async def stop_with_queued_reclaim(world: World) -> None:
    await abort_then_stop_talker(world, put_first=True)


async def abort_then_stop_talker(world: World, *, put_first: bool) -> EdgeRequest:
    """Request R sends two chunks nobody reads and is aborted, and the Talker stops right after
    the abort: its save loop ends with whatever the abort queued. ``put_first``: both chunks are
    put before the abort, so the abort has a reclaim to queue."""
    req = EdgeRequest(world, "R")
    req.stream.allowed_outcomes = frozenset({"aborted"})
    await produce(req, [4, 3], finish=False)
    if put_first:
        await current_kernel().sleep(0.5)
    await abort(req)
    req.talker.adapter.shutdown()  # the save loop runs its queued reclaim, then ends
    await current_kernel().sleep(1.0)
    return req
