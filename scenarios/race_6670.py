"""#6670: a receiver learns that a stream ended only from a chunk carrying ``finished`` — two paths
lost that terminal: a cleanup that discarded a queued terminal, and a parked sender stage."""

from __future__ import annotations

from omnisim.faults import Fault, FaultPlan
from omnisim.world import World
from runtime.kernel import current_kernel
from scenarios.edge import EdgeRequest, abort, consume, edge_scenario, produce, produce_then_finish, release, together


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
