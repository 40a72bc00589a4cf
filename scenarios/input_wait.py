"""#4855 R1.1 and #3736: the Code2Wav scheduler's input-wait deadline, with the real scheduler.

A producer that dies between chunks must turn into an error for its client within the deadline
(not a hang), a long but healthy stream must never time out (the deadline measures stall time),
and a deadline of 0 means "disabled", not "immediately". The request that times out does so
while parked for a chunk, in the middle of a step: the #3736 path, where a freed request must
never be polled or re-queued again.
"""

from __future__ import annotations

from omnisim.registry import scenario
from omnisim.world import World
from scenarios.codec import audio_requests, code2wav_scheduler, code2wav_stage, codec_world, talk
from scenarios.edge import failure_watch, release, together

#: Short enough for a virtual-time run, longer than any gap of the healthy stream (25 frames × 40 ms).
DEADLINE_S = 2.0
FRAME_INTERVAL_S = 0.04


@scenario(
    "input_wait_deadline",
    summary="a producer dies mid-stream: its client gets a timeout error within the deadline; a stream longer "
    "than the deadline but never stalled finishes; a deadline of 0 disables the check",
    issue="#4855 R1.1, #3736",
    build=codec_world,
    horizon_s=60.0,
    budget_share=0.25,
)
async def input_wait_deadline(world: World) -> None:
    lengths = {"healthy": 80, "dead": 6}
    healthy, dead = reqs = audio_requests(world, lengths)
    dead.stream.allowed_outcomes = frozenset({"failed"})
    scheduler = code2wav_scheduler(world, reqs, input_wait_timeout_s=DEADLINE_S)
    await together(
        ("healthy.talk", lambda: talk(healthy, lengths["healthy"], 0, frame_interval_s=FRAME_INTERVAL_S)),
        ("dead.talk", lambda: talk(dead, lengths["dead"], 1, frame_interval_s=FRAME_INTERVAL_S, finish=False)),
        ("code2wav", lambda: code2wav_stage(world, scheduler, reqs)),
        failure_watch(world, reqs),
    )
    # The dead producer's sender still owns its id; the orchestrator finishes it on the error.
    await dead.talker.adapter.finish_requests([dead.sender])

    # Deadline 0: disabled, so a stream with gaps far longer than 0 s still finishes.
    (undeadlined,) = later = audio_requests(world, {"undeadlined": 30})
    unlimited = code2wav_scheduler(world, later, input_wait_timeout_s=0, name="code2wav.scheduler.no_deadline")
    await together(
        ("undeadlined.talk", lambda: talk(undeadlined, 30, 2, frame_interval_s=FRAME_INTERVAL_S)),
        ("code2wav.no_deadline", lambda: code2wav_stage(world, unlimited, later)),
        failure_watch(world, later),
    )
    for req in (*reqs, *later):
        await release(req)
