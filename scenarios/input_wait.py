"""#4855 R1.1 and #3736: the input-wait deadline, with the real schedulers.

A producer that dies between chunks must turn into an error for its client within the deadline
(not a hang), a long but healthy stream must never time out (the deadline measures stall time),
and a deadline of 0 means "disabled", not "immediately". The request that times out does so
while parked for a chunk, in the middle of a step: the #3736 path, where a freed request must
never be polled or re-queued again. ``input_wait_deadline`` drives Code2Wav's scheduler at its
edge; ``talker_input_wait_deadline`` the Talker's, in the whole pipeline, behind a Thinker whose
steps are slower than the Talker's deadline.
"""

from __future__ import annotations

from omnisim.registry import Param, Params, scenario
from omnisim.sim_kernel import SimKernel
from omnisim.world import World
from runtime.kernel import current_kernel
from scenarios.codec import audio_requests, code2wav_scheduler, code2wav_stage, codec_world, talk
from scenarios.edge import failure_watch, release, together
from scenarios.pipeline import REMAINDER, SHORT, TALKER_STAGE, Client, engine_of, pipeline_scenario, pipeline_world

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


#: Virtual seconds each model call takes behind the Talker's deadline: the Thinker's steps come
#: further apart than the Talker waits (a long prompt's prefill, a GPU shared with other work).
SLOW_STEP_S = 0.2
#: The Talker's input-wait deadline there: half a Thinker step.
TALKER_DEADLINE_S = 0.1
#: By when the request must have ended: the deadline and the Talker's next look (within a step),
#: then the Thinker's round of steps in flight before it drops the request (one step for each of
#: its two requests) and one step more.
FAILED_WITHIN_S = TALKER_DEADLINE_S + 4 * SLOW_STEP_S
#: A deadline longer than any stall of the healthy stream (chunk 0 waits two Thinker rounds),
#: far shorter than the whole stream: it measures stall time, so it never fires.
LONG_DEADLINE_S = 1.0
DEADLINES = {"short": TALKER_DEADLINE_S, "long": LONG_DEADLINE_S, "off": 0.0}
DEADLINE = Param(
    "deadline",
    tuple(DEADLINES),
    "the Talker's input-wait deadline: half a Thinker step, longer than any stall but not the stream, or 0 (off)",
)


def slow_thinker_world(store_kind: str, params: Params) -> World:
    """The pipeline with every model call taking :data:`SLOW_STEP_S` and the Talker's deadline
    set as a deploy file sets a stage's (Code2Wav keeps the default, far longer)."""
    world = pipeline_world(store_kind, params)
    kernel = current_kernel()
    assert isinstance(kernel, SimKernel)
    kernel.compute_cost_s = SLOW_STEP_S
    talker = engine_of(world).stages[TALKER_STAGE].scheduler
    talker.input_wait_timeout_s = DEADLINES[params["deadline"]]
    return world


@pipeline_scenario(
    "talker_input_wait_deadline",
    summary="the Thinker's steps come further apart than the Talker's input-wait deadline: the Talker fails the "
    "audio request within its deadline, naming the timeout, and the text-only request next to it is answered in "
    "full; with a deadline longer than any stall (shorter than the stream), or off (0), it is answered in full too",
    issue="#4855 R1.1 (the AR stage's deadline); omnisim issue 11 (a blind spot of runtime/sched's mutation score)",
    params=(DEADLINE,),
    build=slow_thinker_world,
)
async def talker_input_wait_deadline(world: World) -> None:
    short = world.params["deadline"] == "short"
    spoken = Client(world, "spoken", REMAINDER, "S", modalities=("text", "audio"))
    spoken.outcomes = frozenset({"failed"} if short else {"finished"})
    written = Client(world, "written", SHORT, "W", modalities=("text",))
    await together(("S", spoken.run), ("W", written.run))
    if short and spoken.stream.outcome == "failed":
        error = spoken.stream.error or ""
        world.probe(
            "failures-have-causes",
            "talker" in error and "Timed out waiting for connector input" in error,
            f"{spoken.name} failed with {error!r}, which names no input-wait timeout of the Talker",
        )
        ended_s = (spoken.stream.ended_us or 0) / 1e6
        world.probe(
            "liveness",
            ended_s <= FAILED_WITHIN_S,
            f"{spoken.name} failed {ended_s:g}s in, past the Talker's deadline of {TALKER_DEADLINE_S:g}s and its "
            f"next steps ({FAILED_WITHIN_S:g}s)",
        )
