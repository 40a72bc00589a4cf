"""A streaming session's saves across segments: spec §3.3's admission of each ``save_async``.

A resumable request's scheduler may save a chunk twice (a replay after a preemption: its
confirmed token count is below what the id already sent) or save for a segment that has already
ended (a late save). Both are dropped without a word; a segment end always goes out and starts
the next segment's count afresh. No other scenario sends either kind, so the watermark and the
segment generations ran unchecked. Here each refused save carries frames of its own: were it
sent, Code2Wav would accept frames nobody sent (``no-corrupt-accept``); were a save the spec
admits refused, its frames would be missing (``terminal-delivered``); and ``save_async`` must
answer which saves it queued (``sender-contract``).

A producer may also keep no segment generations at all (``generations=none``: the request's
``segment_generation`` stays None, every save is generation 0). A segment end must then leave
the expected generation where it is: #6816 moved it on, and every later save of the session was
dropped as late — no audio, and a hang.
"""

from __future__ import annotations

from typing import NamedTuple

from omnisim.registry import Param, scenario
from omnisim.world import World
from runtime.kernel import current_kernel
from runtime.request import RequestStatus
from scenarios.edge import EdgeRequest, codec_frames, consume, edge_world, release, together


class Save(NamedTuple):
    frames: int
    segment_generation: int
    #: The request's token counts at the save: the confirmed count is computed minus placeholders.
    computed: int
    placeholders: int = 0
    segment_end: bool = False
    #: A late save: its caller passes the segment generation it still holds, not the request's.
    late: bool = False
    #: Whether spec §3.3 sends it (the scenario's expectation, not the runtime's answer).
    admitted: bool = True


#: In the order the Talker's scheduler makes them; the last one is the terminal.
SAVES = (
    Save(4, 0, computed=0),  # the prefill chunk: nothing confirmed yet
    Save(3, 0, computed=8),
    Save(4, 0, computed=6, placeholders=2, admitted=False),  # a replay: 4 confirmed, below the watermark of 8
    Save(3, 0, computed=8),  # equal to the watermark: not a replay
    Save(2, 0, computed=10, segment_end=True),  # ends segment 0; its count starts afresh
    Save(2, 0, computed=12, late=True, admitted=False),  # segment 0 has ended
    Save(3, 1, computed=3, placeholders=2),  # 1 confirmed: below segment 0's count, but a new segment's
    Save(2, 1, computed=2, placeholders=2, admitted=False),  # a replay: 0 confirmed, below the watermark of 1
    Save(2, 2, computed=5),  # the scheduler moved on to segment 2
    Save(2, 1, computed=9, late=True, admitted=False),  # segment 1 is behind it
    Save(1, 2, computed=6),  # the terminal
)


#: A producer that keeps no segment generations (#6816): everything is generation 0, so there are
#: no late saves; a replay is still a replay.
UNKEPT_SAVES = (
    Save(4, 0, computed=0),
    Save(3, 0, computed=8),
    Save(2, 0, computed=10, segment_end=True),
    Save(3, 0, computed=3, placeholders=2),  # 1 confirmed: a new segment's count
    Save(2, 0, computed=2, placeholders=2, admitted=False),  # a replay: 0 confirmed, below the watermark of 1
    Save(2, 0, computed=5, segment_end=True),
    Save(1, 0, computed=1),  # the terminal, in a third segment
)
GENERATIONS = Param(
    "generations", ("kept", "none"), "whether the producer keeps segment generations (#6816: none is kept)"
)


def answer(queued: bool) -> str:
    return "queued" if queued else "refused"


@scenario(
    "streaming_segments",
    summary="spec §3.3: a streaming session saves across three segments, with a replayed save (below the "
    "watermark), one equal to it, a segment end, and late saves for ended segments: exactly the admitted "
    "saves reach Code2Wav, in order, save_async answers which it queued, and nothing is left behind; with a "
    "producer that keeps no segment generations too (#6816)",
    issue="spec §3.3 (late saves, replays, segment ends), #6816; omnisim issue 11 (a blind spot of the mutation score)",
    params=(GENERATIONS,),
    build=lambda store_kind, _params: edge_world(store_kind),
)
async def streaming_segments(world: World) -> None:
    req = EdgeRequest(world, "S")
    req.sender.resumable = True
    kept = world.params["generations"] == "kept"
    saves = SAVES if kept else UNKEPT_SAVES

    async def produce() -> None:
        offset = 0
        for i, save in enumerate(saves):
            if req.stream.outcome != "open":
                break  # the request failed (a sampled fault): a scheduler saves nothing more for it
            if i == len(saves) - 1:
                req.sender.resumable = False
                req.sender.status = RequestStatus.FINISHED_STOPPED
            if kept and not save.late:
                req.sender.segment_generation = save.segment_generation
            req.sender.num_computed_tokens = save.computed
            req.sender.num_output_placeholders = save.placeholders
            frames = codec_frames(save.frames, offset)
            offset += save.frames
            if save.admitted:
                # What Code2Wav may accept, recorded before the hand-off and checked by content.
                req.stream.sent_frames.extend(tuple(frames[:, j].tolist()) for j in range(save.frames))
                req.stream.frames_sent += save.frames
            queued = await req.talker.adapter.save_async(
                {"frames": frames},
                req.sender,
                is_segment_finished=save.segment_end,
                segment_generation=save.segment_generation if save.late else None,
            )
            current_kernel().note(
                "sender.answer", req=req.sender.request_id, got=answer(queued), want=answer(save.admitted)
            )

    await together(("S.consume", lambda: consume(req)), ("S.produce", produce))
    await release(req)
